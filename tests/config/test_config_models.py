"""``reward_model.*`` and ``distillation.*``: what validates, and each bad input refused with its key, rule and fix at
load (``--validate-only``): a missing or absent checkpoint, a causal LM as the reward model, a reward model shorter
than the sequences it reads, verl's server and top-k keys; and, when the run loads the tokenizers (before any model),
a teacher with another vocabulary."""

from __future__ import annotations

import json
import shutil

import pytest

from dsrl import config as C
from tests.helpers.config import recipe

RM_ON = "reward_model.enable=true"
DISTILL_ON = "distillation.enabled=true"
TEACHER = "distillation.teacher_models.teacher_model.model_path"
LOSS = "distillation.distillation_loss"


def violations(overrides: list[str], name: str = "grpo") -> list[str]:
    try:
        C.load_and_validate(recipe(name), overrides, 2)
    except C.ConfigError as err:
        return err.violations
    return []


def ours(found: list[str]) -> list[str]:
    return [v for v in found if v.startswith(("reward_model", "distillation", "reward.reward_model"))]


def test_a_reward_model_and_a_teacher_validate(tiny_model_dir, tiny_reward_model_dir):
    overrides = [RM_ON, f"reward_model.model.path={tiny_reward_model_dir}", "data.max_prompt_length=128",
                 "data.max_response_length=64", DISTILL_ON, f"{TEACHER}={tiny_model_dir}"]  # fmt: skip
    assert ours(violations(overrides)) == []
    policy_gradient = [*overrides, f"{LOSS}.loss_mode=k1", f"{LOSS}.use_policy_gradient=true"]
    assert ours(violations(policy_gradient)) == []


def expect(found: list[str], key: str, rule: str, fix: str) -> None:
    lines = [v for v in found if v.startswith(f"{key}=")]
    assert lines, found
    assert any(rule in line and fix in line.partition("; fix: ")[2] for line in lines), lines


def test_a_causal_lm_is_no_reward_model(tiny_model_dir):
    found = violations([RM_ON, f"reward_model.model.path={tiny_model_dir}", "data.max_response_length=64"])
    rule = "is Qwen3ForCausalLM, not a sequence-classification"
    expect(found, "reward_model.model.path", rule, "a causal LM is a teacher")


def test_a_reward_model_shorter_than_its_sequences(tiny_reward_model_dir):
    path = f"reward_model.model.path={tiny_reward_model_dir}"  # 256 positions
    lengths = ["data.max_prompt_length=200", "data.max_response_length=100"]
    expect(violations([RM_ON, path, *lengths]), "reward_model.max_length", "reads 300 tokens at most (null",
           "set reward_model.max_length")  # fmt: skip
    expect(violations([RM_ON, path, "reward_model.max_length=300"]), "reward_model.max_length", "reads 300 tokens",
           "longer conversations lose their start")  # fmt: skip
    assert ours(violations([RM_ON, path, *lengths, "reward_model.max_length=256"])) == []


@pytest.mark.parametrize(
    "overrides, key, rule, fix",
    [
        ([RM_ON], "reward_model.model.path", "needs the reward model's checkpoint", "sequence-classification"),
        ([RM_ON, "reward_model.model.path=/no/such/model"], "reward_model.model.path", "no such model directory",
         "point it at a model directory"),
        ([DISTILL_ON], TEACHER, "needs the teacher's checkpoint", "causal LM with the student's tokenizer"),
        ([DISTILL_ON, f"{TEACHER}=/no/such/teacher"], TEACHER, "no such model directory", "model directory"),
        ([f"{LOSS}.loss_mode=forward_kl_topk"], f"{LOSS}.loss_mode", "student's logits inside the loss", "k3"),
        ([f"{LOSS}.loss_mode=k1"], f"{LOSS}.loss_mode", "does not depend on the teacher",
         "use_policy_gradient=true"),
        ([f"{LOSS}.policy_loss_mode=gspo"], f"{LOSS}.policy_loss_mode", "only vanilla", "set vanilla"),
        ([f"{LOSS}.loss_max_clamp=0"], f"{LOSS}.loss_max_clamp", "must be > 0 or null", "no clamp"),
        ([f"{LOSS}.distillation_loss_coef=-1"], f"{LOSS}.distillation_loss_coef", "must be >= 0", "0 or more"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused(overrides, key, rule, fix, tiny_model_dir):
    teacher = (
        [] if any(TEACHER in o for o in overrides) or overrides == [DISTILL_ON] else [f"{TEACHER}={tiny_model_dir}"]
    )
    on = [DISTILL_ON, *teacher] if key.startswith(LOSS) else teacher if DISTILL_ON in overrides else []
    expect(violations([*on, *overrides]), key, rule, fix)


def test_reward_model_scoring_inside_partial_rollout_judging_is_refused(tiny_reward_model_dir):
    found = violations([RM_ON, f"reward_model.model.path={tiny_reward_model_dir}", "reward_model.max_length=256",
                        "trainer.v1.trainer_mode=colocate_async"], name="dapo")  # fmt: skip
    expect(found, "reward_model.enable", "collective forward", "filter_groups.enable=false")


@pytest.mark.parametrize(
    "key, rule, fix",
    [
        ("reward.reward_model.enable", "new place of a reward_model key", "set reward_model.enable"),
        ("reward.reward_model.model_path", "new place of a reward_model key", "set reward_model.model.path"),
        ("reward_model.rollout.gpu_memory_utilization", "verl serves its reward model", "remove it"),
        ("reward.reward_model.enable_resource_pool", "verl serves its reward model", "remove it"),
        ("reward_model.model.input_tokenizer", "re-tokenises each conversation", "remove it"),
        (f"{LOSS}.topk", "forward_kl_topk", "loss_mode k1 | k2 | k3 | abs"),
        ("distillation.n_gpus_per_node", "resource pool of its own", "deepspeed_config sets that engine"),
        ("distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size", "resource pool",
         "remove it"),
        ("distillation.teacher_models.teacher_model.key", "routes no rows between teachers", "model_path"),
        ("distillation.teacher_key", "routes no rows between teachers", "model_path"),
    ],
)  # fmt: skip
def test_verls_keys_dsrl_does_not_read_are_refused(key, rule, fix):
    expect(violations([f"+{key}=1"]), key, rule, fix)


@pytest.mark.e2e
def test_a_teacher_with_another_vocabulary_is_refused_before_models_load(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, tmp_path
):
    from transformers import AutoTokenizer

    from dsrl.rewards.model_inputs import teacher_vocabulary_problem
    from tests.helpers.trainer import trainer_for

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer_file = other / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    vocab = spec["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens swap ids: same size, other ids
    tokenizer_file.write_text(json.dumps(spec))
    student = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert teacher_vocabulary_problem(student, AutoTokenizer.from_pretrained(tiny_model_dir), "same") is None
    with pytest.raises(C.ConfigError) as refused:  # the trainer's start-up, before any model loads
        trainer_for("grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path / "run", DISTILL_ON,
                    f"{TEACHER}={other}")  # fmt: skip
    (problem,) = refused.value.violations
    assert problem.startswith(f"{TEACHER}={other}: ") and "vocabulary differs from the student's" in problem
