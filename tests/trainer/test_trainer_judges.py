"""The models that judge the policy's responses, in real runs of the GRPO recipe on the tiny model (one rank):

- the reward model: every response's score is a transformers forward of the reward model on the response's own tokens
  (fp32, 1e-5), and the score the estimator sees (verl: the reward model's alone without a reward function); with a
  reward function, the function reads the score in ``extra_info`` and gdpo takes it as a component;
- distillation: the teacher's log-probs are a transformers forward of the teacher on the batch, the distillation loss
  and its metrics are logged, and the actor trains on it (supervised k3 and, slow, the policy-gradient k1); the
  distillation recipe's CPU command (configs/distill.yaml, its k1 reward without the task's loss) trains, and so does
  the reward-model recipe's (configs/ppo_rm.yaml, PPO with a critic on the reward model's scores alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.helpers.trainer import changed_fraction, run_config

pytestmark = pytest.mark.e2e


def full_sequences(batch) -> list[list[int]]:
    """Each row's prompt and attended response tokens."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]


@contextmanager
def spying(role: str, method: str, calls: list) -> Iterator[None]:
    """Every Trainer built inside records each call of its ``role``'s ``method``: (first argument, result)."""
    from dsrl.trainer import loop

    build = loop.Trainer.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        obj = getattr(self, role)
        original = getattr(obj, method)

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            calls.append((args[0], out))
            return out

        setattr(obj, method, recorded)

    loop.Trainer.__init__ = init
    try:
        yield
    finally:
        loop.Trainer.__init__ = build


def reward_model_scores(model_dir, rows: list[list[int]]) -> torch.Tensor:
    """The score head at each row's last token, one row at a time. Not the model's pooled logits: transformers pools
    at the last token that is not the pad token, and a sampled response may end in the pad token's id."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.tensor(
            [model.score(model.model(input_ids=torch.tensor([row])).last_hidden_state[0, -1]).item() for row in rows]
        )


RM_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = float(sum(ch.isdigit() for ch in solution_str))
    return {"score": digits + extra_info["reward_model_score"], "digits": digits}
"""


@pytest.mark.parametrize("with_function", [False, True], ids=["reward_model_alone", "with_a_reward_function"])
def test_the_reward_model_scores_every_response(
    with_function,
    tiny_model_dir,
    tiny_reward_model_dir,
    arithmetic_data,
    ds_test_config,
    world_of_one,
    deepspeed_cpu_ops,
    tmp_path,
):
    from dsrl.trainer import loop as trainer_module

    reward = tmp_path / "rm_reward.py"
    reward.write_text(RM_REWARD)
    overrides = [
        "reward_model.enable=true",
        f"reward_model.model.path={tiny_reward_model_dir}",
        f"reward_model.deepspeed_config={ds_test_config('zero3_offload_inference')}",
        "reward_model.micro_batch_size_per_gpu=16",
    ]
    if with_function:  # gdpo normalises each component on its own: the function's digits and the model's score
        overrides += [
            f"custom_reward_function.path={reward}",
            "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[digits,reward_model_score]",
        ]
    else:
        overrides += ["custom_reward_function.path=null"]
    scored, components = [], []
    compute = trainer_module.compute_advantages

    def advantages(name, inputs, **kwargs):
        components.append(inputs.reward_components)
        return compute(name, inputs, **kwargs)

    trainer_module.compute_advantages = advantages
    try:
        with spying("scoring", "score", scored):
            trainer, logged, (actor_before, actor_after), _ = run_config(
                "grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path / "run", *overrides
            )
    finally:
        trainer_module.compute_advantages = compute
    assert [step for step, _ in logged] == [0, 1, 2]
    for step, metrics in logged:
        assert all(math.isfinite(v) for v in metrics.values()), step
    assert trainer.model_inputs.same_template  # the tiny reward model has the policy's tokenizer
    train_calls = [(batch, scores) for batch, scores in scored if len(batch) == 8 * 5]
    assert len(train_calls) == 2
    for batch, scores in train_calls:
        want = reward_model_scores(tiny_reward_model_dir, full_sequences(batch))
        got = torch.tensor(scores.extras["reward_model_score"])
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        digits = torch.tensor(scores.extras["digits"]) if with_function else 0
        assert torch.allclose(scores.token_level.sum(-1), got + digits, atol=1e-6)
    step1 = logged[1][1]
    assert step1["reward/reward_model_score/mean"] == pytest.approx(
        torch.tensor(train_calls[0][1].extras["reward_model_score"]).mean().item(), abs=1e-6
    )
    assert step1["reward_model/truncated"] == 0 and "timing_s/reward" in step1
    assert "val-aux/arithmetic/reward_model_score/mean@1" in logged[2][1]  # the validation's responses too
    if with_function:
        assert all(list(c) == ["digits", "reward_model_score"] for c in components)
        assert torch.allclose(
            components[0]["reward_model_score"],
            got_first := torch.tensor(train_calls[0][1].extras["reward_model_score"]),
        )
        assert got_first.std() > 0
    assert changed_fraction(actor_before, actor_after) == 1.0


def lora_and_reward_model(reward_model_dir, tmp_path) -> list[str]:
    reward = tmp_path / "rm_reward.py"
    reward.write_text(RM_REWARD)
    return [
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "reward_model.enable=true",
        f"reward_model.model.path={reward_model_dir}",
        f"custom_reward_function.path={reward}",
    ]


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(["loss_mode=k3", "use_policy_gradient=false", "use_task_rewards=false"], id="supervised_k3"),
        pytest.param(  # with a LoRA actor (its reference the adapters off) and the reward model in its reward
            ["loss_mode=k1", "use_policy_gradient=true", "distillation_loss_coef=0.5"],
            id="policy_gradient_k1_lora_reward_model",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_distillation_trains_on_the_teachers_log_probs(
    form,
    tiny_model_dir,
    tiny_teacher_dir,
    tiny_reward_model_dir,
    arithmetic_data,
    ds_test_config,
    world_of_one,
    deepspeed_cpu_ops,
    tmp_path,
):
    from transformers import AutoModelForCausalLM

    taught = []
    with spying("teacher", "compute_log_probs", taught):
        trainer, logged, (actor_before, actor_after), _ = run_config(
            "grpo",
            tiny_model_dir,
            arithmetic_data,
            ds_test_config,
            tmp_path / "run",
            "distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={tiny_teacher_dir}",
            f"distillation.teacher_models.teacher_model.deepspeed_config={ds_test_config('zero3_offload_inference')}",
            *(f"distillation.distillation_loss.{setting}" for setting in form),
            *(lora_and_reward_model(tiny_reward_model_dir, tmp_path) if "use_policy_gradient=true" in form else []),
        )
    assert len(taught) == 2
    teacher = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    temperature = trainer.cfg.actor_rollout_ref.rollout.temperature
    batch, got = taught[0]
    for row in range(0, len(batch), 7):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
        length = int(batch.response_mask[row].sum())
        response = batch.response_ids[row][:length]
        with torch.no_grad():
            logits = teacher(input_ids=torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float() / temperature, -1).gather(-1, response[:, None])[:, 0]
        assert torch.allclose(got[row, :length], want, atol=1e-5, rtol=0)
        assert not got[row, length:].any()
    step1, step2 = logged[1][1], logged[2][1]
    for name in ("distillation/loss", "distillation/abs_loss", "distillation/reverse_kl", "timing_s/teacher"):
        assert name in step1 and math.isfinite(step1[name]), name
    assert step1["distillation/loss_max"] >= step1["distillation/loss_min"]
    if "use_policy_gradient=true" in form:
        assert "distillation/pg_clipfrac" in step1 and "actor/pg_loss" in step1
        assert trainer.actor.lora and "reward/reward_model_score/mean" in step1
    else:  # the distillation loss alone: k3 is non-negative, and the task's policy loss is not in the update
        assert step1["distillation/loss"] >= 0
    assert "distillation/loss" in step2
    trained = [k for k in actor_before if ".lora_" in k] or list(actor_before)  # a LoRA actor: its adapters
    assert changed_fraction({k: actor_before[k] for k in trained}, {k: actor_after[k] for k in trained}) == 1.0


def cpu_recipe(names: tuple[str, str, str], tiny_model_dir, arithmetic_data, ds_test_config, run_dir, *overrides):
    """The docs' CPU command of a recipe (``names``: its three config files, the recipe, the CPU overlay and the
    recipe's overlay) for two steps on one rank, validated: the tests' policy, data and actor DeepSpeed setup swapped
    in, ``overrides`` after, tracked to the console only."""
    from dsrl.config import load_and_validate
    from tests.conftest import REPO

    cfg, _ = load_and_validate(
        [str(REPO / "configs" / name) for name in names],
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            f"data.train_files={arithmetic_data / 'train.parquet'}",
            f"data.val_files={arithmetic_data / 'test.parquet'}",
            "trainer.total_training_steps=2",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={run_dir}",
            *overrides,
        ],
        world_size=1,
    )
    return cfg


def test_the_distillation_recipe_trains_under_its_cpu_overlays(
    tiny_model_dir, tiny_teacher_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """The docs' CPU command, configs/distill.yaml configs/cpu.yaml configs/distill_cpu.yaml (its models and data
    swapped for the tests'): the recipe's form, k1 as each token's reward without the task's loss, trains two steps
    on one rank, the teacher scoring each step's responses in one micro-batch, and every parameter moves."""
    from dsrl.engines.weight_sync import iter_full_parameters
    from dsrl.trainer.loop import Trainer

    cfg = cpu_recipe(
        ("distill.yaml", "cpu.yaml", "distill_cpu.yaml"),
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        f"distillation.teacher_models.teacher_model.model_path={tiny_teacher_dir}",
        f"distillation.teacher_models.teacher_model.deepspeed_config={ds_test_config('zero3_offload_inference')}",
    )
    loss = cfg.distillation.distillation_loss
    assert (loss.loss_mode, loss.use_policy_gradient, loss.use_task_rewards) == ("k1", True, False)
    trainer = Trainer(cfg)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    snapshot = lambda: {name: tensor.clone() for name, tensor in iter_full_parameters(trainer.actor.module)}  # noqa: E731
    before = snapshot()
    trainer.fit()
    assert [step for step, _ in logged] == [0, 1, 2]  # validation before training, then two steps
    for step, metrics in logged[1:]:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (step, bad)
        assert metrics["distillation/pg_clipfrac"] == 0  # one optimizer step a batch: the ratio is 1
        assert metrics["perf/micro_batches/teacher"] == 1  # 32 prompts x 4 responses in one forward
    assert changed_fraction(before, snapshot()) == 1.0


def test_the_reward_model_recipe_trains_under_its_cpu_overlays(
    tiny_model_dir, tiny_reward_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """The docs' CPU command, configs/ppo_rm.yaml configs/cpu.yaml configs/ppo_rm_cpu.yaml (its models and data
    swapped for the tests'): PPO with GAE and a critic trains two steps on one rank on the reward model's scores
    alone, a step's 64 responses scored in one forward, and every parameter of the actor and the critic moves."""
    from dsrl.engines.weight_sync import iter_full_parameters
    from dsrl.trainer.loop import Trainer

    cfg = cpu_recipe(
        ("ppo_rm.yaml", "cpu.yaml", "ppo_rm_cpu.yaml"),
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        f"reward_model.model.path={tiny_reward_model_dir}",
        f"reward_model.deepspeed_config={ds_test_config('zero3_offload_inference')}",
        f"critic.deepspeed_config={ds_test_config('zero3_offload')}",
        "trainer.total_epochs=2",  # the tests' 64 prompts are one step's
    )
    assert cfg.algorithm.adv_estimator == "gae" and cfg.reward_model.enable and cfg.custom_reward_function.path is None
    scored = []
    with spying("scoring", "score", scored):
        trainer = Trainer(cfg)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    snapshot = lambda module: {name: t.clone() for name, t in iter_full_parameters(module)}  # noqa: E731
    before = snapshot(trainer.actor.module), snapshot(trainer.critic.module)
    trainer.fit()
    assert [step for step, _ in logged] == [0, 1, 2]  # validation before training, then two steps
    for step, metrics in logged[1:]:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (step, bad)
    # A step's 64 prompts x 1 response in one forward; the validations' forwards count in no step
    assert [metrics["perf/micro_batches/reward_model"] for _, metrics in logged[1:]] == [1, 1]
    train_calls = [scores for batch, scores in scored if len(batch) == 64]
    assert len(train_calls) == 2
    for scores in train_calls:  # the reward model's score is each response's reward, and nothing else is
        assert torch.equal(scores.token_level.sum(-1), torch.tensor(scores.extras["reward_model_score"]))
    assert changed_fraction(before[0], snapshot(trainer.actor.module)) == 1.0
    assert changed_fraction(before[1], snapshot(trainer.critic.module)) == 1.0
