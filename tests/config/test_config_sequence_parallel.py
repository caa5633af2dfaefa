"""``actor_rollout_ref.actor.ulysses_sequence_parallel_size`` and ``critic.ulysses_sequence_parallel_size``: what
validation refuses beside them, with the key, the rule and the fix; a model whose heads do not split is named at
``--validate-only`` (before anything loads). Also what ``actor_rollout_ref.actor.router_aux_loss_coef`` refuses
beside it: sequence parallelism, and shared-prompt forwards."""

from __future__ import annotations

import json
import shutil

import pytest

from dsrl import config as C
from dsrl.config.files import sequence_parallel_problem
from tests.helpers.config import recipe

SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
PACKED = "actor_rollout_ref.model.use_remove_padding=true"
CRITIC_SP = "critic.ulysses_sequence_parallel_size"
CRITIC_PACKED = "critic.model.use_remove_padding=true"


def violations(overrides: list[str], world_size: int = 2, name: str = "grpo") -> list[str]:
    try:
        C.load_and_validate(recipe(name), overrides, world_size)
    except C.ConfigError as err:
        return err.violations
    return []


def test_sequence_parallelism_over_packed_rows_validates():
    assert [v for v in violations([f"{SP}=2", PACKED]) if v.startswith(SP)] == []
    for actor_sp in (1, 2):  # the critic's alone, or the actor's size
        found = violations([f"{SP}={actor_sp}", PACKED, f"{CRITIC_SP}=2", CRITIC_PACKED], name="ppo")
        assert [v for v in found if "ulysses" in v] == []


@pytest.mark.parametrize(
    "overrides, key, rule, fix",
    [
        ([f"{CRITIC_SP}=2", "critic.model.use_remove_padding=false"], CRITIC_SP, "packed rows", CRITIC_PACKED),
        ([f"{CRITIC_SP}=4", CRITIC_PACKED], CRITIC_SP, "does not divide the 2 ranks", "multiple"),
        ([f"{CRITIC_SP}=2", CRITIC_PACKED, f"{SP}=4", PACKED], CRITIC_SP, f"differs from {SP}", "the same size"),
        (
            [f"{CRITIC_SP}=2", CRITIC_PACKED, "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=64"],
            "critic.ppo_max_token_len_per_gpu",
            "times ulysses_sequence_parallel_size must hold one whole sequence",
            "set it to at least",
        ),
    ],
)
def test_what_the_critics_sequence_parallelism_cannot_run_beside_is_refused(overrides, key, rule, fix):
    found = [v for v in violations(overrides, 2, "ppo") if v.startswith(key + "=") and rule in v]
    assert len(found) == 1, violations(overrides, 2, "ppo")
    assert fix in found[0].split("; fix: ")[1]


@pytest.mark.parametrize(
    "overrides, world_size, key, rule, fix",
    [
        (
            [f"{SP}=2", "actor_rollout_ref.model.use_remove_padding=false"],
            2,
            SP,
            "packed rows",
            "use_remove_padding=true",
        ),
        ([f"{SP}=4", PACKED], 2, SP, "does not divide the 2 ranks", "multiple"),
        ([f"{SP}=0"], 2, SP, "must be >= 1", "set it to 1"),
        (
            [f"{SP}=2", PACKED, "actor_rollout_ref.actor.measure_grad_variance=true"],
            2,
            "actor_rollout_ref.actor.measure_grad_variance",
            "no rank sees its norm",
            f"{SP}=1",
        ),
    ],
)
def test_what_sequence_parallelism_cannot_run_beside_is_refused(overrides, world_size, key, rule, fix):
    found = [v for v in violations(overrides, world_size) if v.startswith(key + "=") and rule in v]
    assert len(found) == 1, violations(overrides, world_size)
    assert fix in found[0].split("; fix: ")[1]


@pytest.mark.parametrize(
    "heads, kv_heads, size, problem",
    [
        (14, 2, 2, None),  # Qwen2.5-0.5B: 2 or 14 only
        (14, 2, 4, "its 14 attention heads do not split over 4 ranks"),
        (32, 8, 16, None),  # Qwen3-8B: KV heads copied to 16
        (28, 4, 2, None),
        (12, 3, 2, "its 3 KV heads neither split over 2 ranks nor divide 2"),
    ],
)
def test_the_heads_must_split_over_the_ranks(heads, kv_heads, size, problem):
    assert sequence_parallel_problem({"num_attention_heads": heads, "num_key_value_heads": kv_heads}, size) == problem


def test_a_local_model_whose_heads_do_not_split_is_refused_at_validation(tiny_model_dir, tmp_path):
    model = tmp_path / "three_heads"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3, "num_key_value_heads": 3}))
    found = [v for v in violations([f"actor_rollout_ref.model.path={model}", f"{SP}=2", PACKED]) if v.startswith(SP)]
    assert found == [
        f"{SP}=2: {model}: its 3 attention heads do not split over 2 ranks; fix: set a divisor of the heads"
    ]


@pytest.mark.parametrize(
    "overrides, rule, fix",
    [
        (["actor_rollout_ref.actor.router_aux_loss_coef=-1"], "must be >= 0", "set it to 0"),
        (["actor_rollout_ref.actor.router_aux_loss_coef=0.01", f"{SP}=2", PACKED], "see its shard", f"{SP}=1"),
        (
            ["actor_rollout_ref.actor.router_aux_loss_coef=0.01", "actor_rollout_ref.model.shared_prompt_forward=true",
             "actor_rollout_ref.model.use_remove_padding=false"],
            "two forwards",
            "shared_prompt_forward=false",
        ),
    ],
)  # fmt: skip
def test_what_the_router_aux_loss_cannot_run_beside_is_refused(overrides, rule, fix):
    key = "actor_rollout_ref.actor.router_aux_loss_coef"
    found = [v for v in violations(overrides) if v.startswith(key + "=") and rule in v]
    assert len(found) == 1, violations(overrides)
    assert fix in found[0].split("; fix: ")[1]
