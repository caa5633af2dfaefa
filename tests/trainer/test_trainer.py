"""Every algorithm config trains the tiny model end to end in one process (ZeRO-3 + CPU offload).

The reward pays for digits in the response (the ``arithmetic_data`` fixture), so that even the
untrained model gets rewards that differ within a group and the update has a real gradient. Weight
decay is off: a parameter that moved was moved by the loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.trainer import changed_fraction, run_config, trainer_for

pytestmark = pytest.mark.e2e

ALGORITHM_CONFIGS = ("ppo", "grpo", "rloo", "reinforce_pp", "opo", "otb", "dapo")
# Recipes whose old-log-prob pass is read before the update (OTB's estimator, RLOO's in-reward KL); the
# others are exactly on-policy under the CPU overlay and fold it into the update.
SEPARATE_OLD_LOG_PROB = ("rloo", "otb")


def verl_step_metrics(name: str) -> list[str]:
    """The names verl 0.9 logs for a training step of this recipe (metric_utils.compute_data_metrics,
    compute_timing_metrics, compute_throughout_metrics, the actor's and critic's update metrics)."""
    stats = lambda key: [f"{key}/{s}" for s in ("mean", "max", "min")]  # noqa: E731
    names = [
        *stats("critic/score"),
        *stats("critic/rewards"),
        *stats("critic/advantages"),
        *stats("critic/returns"),
        *stats("response_length"),
        "response_length/clip_ratio",
        *stats("prompt_length"),
        "prompt_length/clip_ratio",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/loss",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/adv",
        "timing_s/update_actor",
        "timing_s/step",
        "timing_per_token_ms/gen",
        "timing_per_token_ms/adv",
        "timing_per_token_ms/update_actor",
        "perf/total_num_tokens",
        "perf/time_per_step",
        "perf/throughput",
        "training/global_step",
        "training/epoch",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
    ]
    if name == "ppo":
        names += [
            *stats("critic/values"),
            "critic/vf_explained_var",
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/vpred_mean",
            "critic/grad_norm",
            "critic/lr",
            "timing_s/values",
            "timing_s/update_critic",
            "timing_per_token_ms/values",
            "timing_per_token_ms/update_critic",
        ]
    if name == "grpo":
        names += ["actor/kl_loss", "actor/kl_coef", "timing_s/ref", "timing_per_token_ms/ref"]
    if name in SEPARATE_OLD_LOG_PROB:
        names += ["timing_s/old_log_prob"]
    if name == "dapo":  # verl's DAPO trainer: the step's generation rounds
        names += ["train/num_gen_batches"]
    if name == "otb":  # compute_variance_proxy_metrics, with sum_pi_squared
        names += [
            f"variance_proxy/{k}"
            for k in (
                "proxy1_signal_strength",
                "proxy2_total_power",
                "proxy3_pure_noise",
                "expected_a_squared",
                "expected_w",
            )
        ]
    return names


@pytest.mark.parametrize("name", ALGORITHM_CONFIGS)
def test_config_trains_two_steps(
    name, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    overrides = []
    if name == "ppo":
        ds_critic = ds_test_config("zero3_offload")
        overrides = [
            f"critic.model.path={tiny_model_dir}",
            f"critic.deepspeed_config={ds_critic}",
            "critic.optim.weight_decay=0",
        ]
    trainer, logged, (actor_before, actor_after), (critic_before, critic_after) = run_config(
        name, tiny_model_dir, arithmetic_data, ds_test_config, tmp_path, *overrides
    )
    assert [step for step, _ in logged] == [0, 1, 2]  # validation before training, then two steps
    for step, metrics in logged:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (step, bad)
    step_metrics = logged[1][1]
    missing = set(verl_step_metrics(name)) - set(step_metrics)
    assert not missing, sorted(missing)
    assert step_metrics["actor/grad_norm"] > 0
    assert step_metrics["training/rollout_probs_diff_mean"] < 1e-4  # the rollout copy holds the actor's weights
    assert step_metrics["actor/entropy"] > 0 and "actor/entropy_loss" not in step_metrics  # entropy_coeff 0
    assert step_metrics["training/global_step"] == 1 and logged[2][1]["training/global_step"] == 2
    assert step_metrics["reward/digits/mean"] == pytest.approx(4 * step_metrics["critic/score/mean"])  # an extra
    for step in (0, 2):  # before training and at the last step
        assert {"val-core/arithmetic/reward/mean@1", "val-aux/arithmetic/digits/mean@1"} <= set(logged[step][1])
    # Every parameter tensor of the actor moved (Adam moves any parameter with a non-zero gradient).
    assert changed_fraction(actor_before, actor_after) == 1.0
    if name == "ppo":
        assert "critic/vf_loss" in step_metrics and "timing_s/values" in step_metrics
        assert changed_fraction(critic_before, critic_after) == 1.0
    if name == "grpo":
        assert "actor/kl_loss" in step_metrics and "timing_s/ref" in step_metrics
    if name == "otb":
        assert trainer.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
    if name == "dapo":  # dynamic sampling filled the batch with groups whose score varies
        assert step_metrics["dynamic_sampling/groups_kept"] == trainer.cfg.data.train_batch_size
    if name not in SEPARATE_OLD_LOG_PROB:
        assert "timing_s/old_log_prob" not in step_metrics
    # No checkpoint was asked for (save_freq -1), but the trained model is always exported.
    assert trainer.model_dir == tmp_path / "huggingface" and not list(tmp_path.glob("global_step_*"))
    assert (trainer.model_dir / "model.safetensors.index.json").is_file()


# Every recipe trains LoRA adapters with the KL loss against the adapter-off reference; RLOO keeps its in-reward
# KL too (its recipe's k1, and k3, k2); ReMax adds its greedy rollout. GRPO in the default run, the rest with -m slow.
LORA_RUNS = {
    **{name: (name, []) for name in ALGORITHM_CONFIGS},
    **{f"rloo-{kl}": ("rloo", [f"algorithm.kl_penalty={kl}"]) for kl in ("low_var_kl", "mse")},
    "remax": ("grpo", ["algorithm.adv_estimator=remax"]),
}


@pytest.mark.parametrize(
    "run", [run if run == "grpo" else pytest.param(run, marks=pytest.mark.slow) for run in LORA_RUNS]
)
def test_config_trains_lora_adapters_two_steps(
    run, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """``actor_rollout_ref.model.lora_rank``: the base weights stay bit-identical, every adapter moves (PPO's critic
    trains in full), the metrics are finite, and the reference (the actor with its adapters off) scores every
    step's batch as a plain ``ReferenceEngine`` of the initial weights, after an update too."""
    from dsrl.engines import ReferenceEngine
    from dsrl.engines.lora import adapter_parameters
    from dsrl.engines.weight_sync import iter_full_parameters

    # No lr warm-up (DAPO's would run the first step at lr 0): A moves only once B has left 0, so both steps train.
    overrides = [
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
    ]
    name, settings = LORA_RUNS[run]
    overrides += settings
    if name == "ppo":
        overrides += [
            f"critic.model.path={tiny_model_dir}",
            f"critic.deepspeed_config={ds_test_config('zero3_offload')}",
            "critic.optim.weight_decay=0",
        ]
    trainer = trainer_for(name, tiny_model_dir, arithmetic_data, ds_test_config, tmp_path, *overrides)
    kl_in_reward = trainer.cfg.algorithm.use_kl_in_reward
    assert trainer.actor.lora and kl_in_reward == (name == "rloo")
    scored, compute_ref = [], trainer.ref.compute_log_probs
    trainer.ref.compute_log_probs = lambda batch, **kw: (
        scored.append((batch, kw, compute_ref(batch, **kw))) or scored[-1][2]
    )
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append(metrics)
    snapshot = lambda module: {k: v.clone() for k, v in iter_full_parameters(module)}  # noqa: E731
    actor_before = snapshot(trainer.actor.module)
    critic_before = snapshot(trainer.critic.module) if trainer.critic else None
    trainer.fit()
    actor_after = snapshot(trainer.actor.module)

    adapters = {k for k, _ in adapter_parameters(trainer.actor.module)}
    assert adapters and all(torch.equal(actor_after[k], actor_before[k]) for k in actor_before.keys() - adapters)
    assert changed_fraction({k: actor_before[k] for k in adapters}, {k: actor_after[k] for k in adapters}) == 1.0
    if trainer.critic:
        assert changed_fraction(critic_before, snapshot(trainer.critic.module)) == 1.0
    assert len(logged) == 2 and len(scored) == 2
    for metrics in logged:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/kl_loss"] >= 0
    assert logged[1]["actor/kl_loss"] > 0  # the policy left its reference at the first step
    if kl_in_reward:
        assert logged[1]["actor/reward_kl_penalty"] != 0
    plain = ReferenceEngine(trainer.cfg)
    for batch, kw, ref_log_probs in scored:
        torch.testing.assert_close(ref_log_probs, plain.compute_log_probs(batch, **kw), atol=1e-5, rtol=1e-5)


# verl's other policy losses; sapo (its own parameters, its own aggregation) in the default run, the rest with -m slow
NEW_LOSSES = ("sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "dro")
LOSS_SETTINGS = {
    "sapo": ["actor_rollout_ref.actor.tau_neg=2.0"],
    "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
}


@pytest.mark.parametrize(
    "loss_mode", [m if m == "sapo" else pytest.param(m, marks=pytest.mark.slow) for m in NEW_LOSSES]
)
def test_each_policy_loss_trains_two_steps(
    loss_mode, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """The GRPO config with the loss and its parameters from the config: two steps with finite metrics that
    move every parameter of the actor."""
    from dsrl.algorithms import policy_loss_params

    trainer, logged, (actor_before, actor_after), _ = run_config(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        *LOSS_SETTINGS.get(loss_mode, []),
    )
    assert trainer.actor.loss_params.keys() == policy_loss_params(loss_mode).keys()
    if loss_mode == "sapo":
        assert trainer.actor.loss_params == {"tau_pos": 1.0, "tau_neg": 2.0}
    assert [step for step, _ in logged] == [1, 2]
    for step, metrics in logged:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (step, bad)
        assert {"actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"} <= set(metrics)
    assert logged[0][1]["actor/grad_norm"] > 0
    assert changed_fraction(actor_before, actor_after) == 1.0


def test_folding_the_old_log_prob_pass_changes_no_number(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """GRPO (with the reference's KL loss) on-policy: the update's forward stands in for the old-log-prob
    pass. The same two steps with the separate pass give bit-identical parameters and losses, and the
    pass's metrics (entropy, rollout-vs-actor gaps) to float rounding."""
    from dsrl.engines.weight_sync import iter_full_parameters

    runs = {}
    for fold in (True, False):
        trainer = trainer_for(
            "grpo",
            tiny_model_dir,
            arithmetic_data,
            ds_test_config,
            tmp_path / str(fold),
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
        )
        if not fold:
            trainer.folds_old_log_prob = lambda batch: False
        logged = []
        trainer.tracker.log_metrics = lambda metrics, step, logged=logged: logged.append(metrics)
        trainer.fit()
        runs[fold] = logged, {name: tensor.clone() for name, tensor in iter_full_parameters(trainer.actor.module)}
    (folded, folded_params), (separate, separate_params) = runs[True], runs[False]
    assert all(torch.equal(folded_params[k], separate_params[k]) for k in separate_params)
    for with_fold, without in zip(folded, separate, strict=True):
        assert "timing_s/old_log_prob" not in with_fold and "timing_s/old_log_prob" in without
        for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert with_fold[name] == without[name], name
        for name in ("actor/entropy", "training/rollout_probs_diff_mean", "rollout_corr/is_ratio_mean"):
            assert with_fold[name] == pytest.approx(without[name], rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("mini_batch", [8, 4])
def test_bypass_mode_trains_without_the_old_log_prob_pass(
    mini_batch, tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """verl's bypass mode (REINFORCE with sequence IS weights and token rejection), on-policy and with two
    mini-batches: no old-log-prob pass runs, the update sees the rollout's log-probs as the old ones, the
    actor trains, and the pass's metrics come from the update's forward."""
    corr = "actor_rollout_ref.actor.policy_loss.rollout_correction"
    settings = {
        "loss_type": "reinforce",
        "rollout_is": "sequence",
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.5_2.0",
    }
    overrides = [
        f"{prefix}.{key}={value}"
        for prefix in (corr, "algorithm.rollout_correction")
        for key, value in settings.items()
    ]
    trainer = trainer_for("grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path,
                          "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
                          "algorithm.rollout_correction.bypass_mode=true",
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}", "trainer.val_before_train=false",
                          "trainer.test_freq=-1", *overrides)  # fmt: skip
    trainer.actor.compute_log_probs = lambda *a, **kw: pytest.fail("bypass mode ran the old-log-prob pass")
    seen, update = [], trainer.actor.update
    trainer.actor.update = lambda batch, **kw: (
        seen.append(batch.old_log_probs.equal(batch.rollout_log_probs)) or update(batch, **kw)
    )
    from dsrl.engines.weight_sync import iter_full_parameters

    before = {name: tensor.clone() for name, tensor in iter_full_parameters(trainer.actor.module)}
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append(metrics)
    trainer.fit()
    after = dict(iter_full_parameters(trainer.actor.module))
    assert seen == [True, True] and len(logged) == 2
    assert changed_fraction(before, after) > 0.9
    for metrics in logged:
        assert "timing_s/old_log_prob" not in metrics and math.isfinite(metrics["actor/pg_loss"])
        for name in ("actor/entropy", "training/rollout_probs_diff_mean", "rollout_corr/rollout_is_mean",
                     "rollout_corr/rollout_rs_token_k1_masked_fraction", "rollout_corr/kl",
                     "actor/ppo_kl"):  # fmt: skip
            assert math.isfinite(metrics[name]), name


def test_applied_rollout_correction_keeps_the_separate_pass_and_weights_the_loss(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """Rollout IS reads the old log-probs before the update: the step is not folded, the weights computed with
    them reach the batch, and their metrics are logged."""
    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=1",
    )
    seen, update = {}, trainer.actor.update
    trainer.actor.update = lambda batch, **kw: seen.setdefault("batch", batch) and update(batch, **kw)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append(metrics)
    trainer.fit()
    [metrics] = logged
    assert "timing_s/old_log_prob" in metrics and seen["batch"].rollout_is_weights is not None
    mask = seen["batch"].response_mask.bool()
    assert seen["batch"].rollout_is_weights[mask].mean().item() == pytest.approx(
        metrics["rollout_corr/is_weight_mean"], rel=1e-5
    )


def test_remax_and_in_reward_kl(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """ReMax's greedy baseline rollout (with sampled validation, n=4) and the adaptive in-reward KL controller,
    on the GRPO config."""
    trainer, logged, (actor_before, actor_after), _ = run_config(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "algorithm.adv_estimator=remax",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.01",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.micro_batch_size=3",
    )
    assert trainer.rollout.micro_batch_size == 3  # 8 prompts: three generate calls per rollout
    step1, step2 = logged[1][1], logged[2][1]
    assert step1["actor/reward_kl_penalty_coeff"] == 0.01
    # verl's update counts the step's rows, train_batch_size x n = 8 x 5, not its 8 prompts.
    error = min(max(step1["actor/reward_kl_penalty"] / 0.1 - 1, -0.2), 0.2)
    assert step2["actor/reward_kl_penalty_coeff"] == pytest.approx(0.01 * (1 + error * 8 * 5 / 10000), rel=1e-12)
    assert step2["actor/reward_kl_penalty_coeff"] != 0.01
    assert step2["actor/reward_kl_penalty"] > 0  # the actor left the reference after one update
    assert changed_fraction(actor_before, actor_after) == 1.0


@pytest.mark.parametrize("critic_warmup, actor_trains", [(2, False), (1, True)])
def test_critic_warmup_counts_steps_as_verl(
    critic_warmup,
    actor_trains,
    tiny_model_dir,
    arithmetic_data,
    ds_test_config,
    world_of_one,
    deepspeed_cpu_ops,
    tmp_path,
):
    """verl's count: the actor trains from step critic_warmup on, so 1 means no warm-up and 2 one critic-only step."""
    trainer, logged, (actor_before, actor_after), (critic_before, critic_after) = run_config(
        "ppo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        f"critic.model.path={tiny_model_dir}",
        f"trainer.critic_warmup={critic_warmup}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
    )
    assert changed_fraction(critic_before, critic_after) == 1.0
    assert changed_fraction(actor_before, actor_after) == (1.0 if actor_trains else 0.0)
    assert ("actor/pg_loss" in logged[0][1]) == actor_trains


def test_a_tokenizer_without_a_pad_token_pads_with_eos(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, capsys
):
    """Llama 3's tokenizers have no pad token: prompts are padded with EOS, as verl and the rollouts do."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "no_pad"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model)
    assert AutoTokenizer.from_pretrained(model).pad_token_id is None
    trainer, logged, (actor_before, actor_after), _ = run_config(
        "grpo",
        model,
        arithmetic_data,
        ds_test_config,
        tmp_path / "out",
        "trainer.total_training_steps=1",
    )
    assert "the tokenizer has no pad token; padding with EOS" in capsys.readouterr().out
    assert trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    assert [step for step, _ in logged] == [0, 1] and changed_fraction(actor_before, actor_after) == 1.0


def test_val_only_validates_and_stops(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """verl's trainer.val_only: one validation (sampled, 2 responses per prompt: the bootstrapped
    best/worst metrics appear), no training step, no model written; data.val_max_samples keeps 3 prompts."""
    trainer, logged, (actor_before, actor_after), _ = run_config(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "trainer.val_only=true",
        "trainer.val_before_train=false",
        "data.val_max_samples=3",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    )
    assert len(trainer.val_prompts) == 3
    [(step, val)] = logged
    assert step == 0 and trainer.global_step == 0 and trainer.model_dir is None
    assert {
        "val-core/arithmetic/reward/mean@2",
        "val-core/arithmetic/reward/best@2/mean",
        "val-aux/arithmetic/reward/worst@2/mean",
        "val-aux/arithmetic/digits/mean@2",
    } <= set(val)
    assert val["val-core/arithmetic/reward/best@2/mean"] >= val["val-core/arithmetic/reward/mean@2"]
    assert changed_fraction(actor_before, actor_after) == 0.0
    assert not (tmp_path / "huggingface").exists()


COMPONENT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / 4.0, "digits": digits, "short": float(len(solution_str) < 24)}
"""


def test_gdpo_trains_on_the_reward_components(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """gdpo with a reward function returning a dict: its digits and short components reach the estimator."""
    from dsrl.trainer import loop as trainer_module

    reward = tmp_path / "components.py"
    reward.write_text(COMPONENT_REWARD)
    seen = []
    compute = trainer_module.compute_advantages

    def spy(name, inputs, **kwargs):
        seen.append((name, {k: v.clone() for k, v in inputs.reward_components.items()}, kwargs["gdpo_reward_weights"]))
        return compute(name, inputs, **kwargs)

    trainer_module.compute_advantages = spy
    try:
        trainer, logged, (actor_before, actor_after), _ = run_config(
            "grpo",
            tiny_model_dir,
            arithmetic_data,
            ds_test_config,
            tmp_path / "run",
            "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[digits,short]",
            "algorithm.gdpo_reward_weights=[1.0,0.5]",
            f"custom_reward_function.path={reward}",
        )
    finally:
        trainer_module.compute_advantages = compute
    assert [step for step, _ in logged] == [0, 1, 2]
    for step, metrics in logged:
        assert all(math.isfinite(v) for v in metrics.values()), step
    assert [name for name, _, _ in seen] == ["gdpo", "gdpo"]
    rows = 8 * 5  # train_batch_size x n
    for _, components, weights in seen:
        assert list(components) == ["digits", "short"] and list(weights) == [1.0, 0.5]
        assert components["digits"].shape == (rows,) and set(components["short"].tolist()) <= {0.0, 1.0}
    step1 = logged[1][1]
    assert step1["reward/digits/mean"] == pytest.approx(seen[0][1]["digits"].mean().item())
    assert abs(step1["critic/advantages/mean"]) < 0.2  # whitened over the batch's tokens
    assert changed_fraction(actor_before, actor_after) == 1.0


def test_gdpo_stops_when_a_row_lacks_a_component(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    from dsrl.trainer.loop import TrainingStopped

    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[digits,format]",
        "trainer.val_before_train=false",
    )
    with pytest.raises(TrainingStopped) as error:
        trainer.fit()
    message = str(error.value)
    assert message.startswith("step 1: algorithm.gdpo_reward_keys:")
    assert "data source 'arithmetic' gave no finite number under 'format' for 40 of 40 rows" in message
    assert "remove 'format' from algorithm.gdpo_reward_keys" in message and "'digits'" not in message


def test_pf_ppo_redraws_the_batch_after_gae(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """PPO with use_pf_ppo: each step's rows are redrawn by reward (max_random) with the step's seed, and
    both the critic and the actor train on them."""
    from dsrl.trainer import loop as trainer_module

    draws = []
    resample = trainer_module.pf_ppo_resample

    def spy(batch, reweight_method, weight_pow, seed):
        out = resample(batch, reweight_method, weight_pow, seed)
        draws.append((reweight_method, seed, batch, out))
        return out

    trainer_module.pf_ppo_resample = spy
    ds_critic = ds_test_config("zero3_offload")
    try:
        trainer, logged, (actor_before, actor_after), (critic_before, critic_after) = run_config(
            "ppo",
            tiny_model_dir,
            arithmetic_data,
            ds_test_config,
            tmp_path,
            f"critic.model.path={tiny_model_dir}",
            f"critic.deepspeed_config={ds_critic}",
            "critic.optim.weight_decay=0",
            "algorithm.use_pf_ppo=true",
            "algorithm.pf_ppo.reweight_method=max_random",
        )
    finally:
        trainer_module.pf_ppo_resample = resample
    seed = trainer.cfg.trainer.seed
    assert [(method, s) for method, s, _, _ in draws] == [
        ("max_random", seed * 1_000_003),
        ("max_random", seed * 1_000_003 + 1),
    ]
    for _, _, before, after in draws:
        assert len(after) == len(before)
        # every row drawn is a row of the batch, with its advantages; with replacement, some come twice
        keys = [tuple(row.tolist()) for row in before.response_ids]
        assert all(tuple(row.tolist()) in keys for row in after.response_ids)
        assert len({tuple(row.tolist()) for row in after.response_ids}) < len(after)
        assert after.advantages is not None
    for step, metrics in logged:
        assert all(math.isfinite(v) for v in metrics.values()), step
    assert changed_fraction(actor_before, actor_after) == 1.0
    assert changed_fraction(critic_before, critic_after) == 1.0


def test_dapo_overlong_punishment_and_truncated_masking(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """GRPO with DAPO's overlong punishment (max_response_length 16, a buffer of 8) and the truncated responses
    masked out of the actor's loss: the score is the reward plus the penalty, logged as an extra in training and
    validation, and the actor trains on the batch with exactly the cut responses' masks zeroed."""
    buffer = "reward_model.reward_kwargs.overlong_buffer_cfg"
    masked = []
    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "reward_model.reward_manager=dapo",
        f"{buffer}.enable=true",
        f"{buffer}.len=8",
        f"{buffer}.penalty_factor=1.0",
        f"{buffer}.log=true",
        "actor_rollout_ref.actor.mask_truncated_completions=true",
    )
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    without_truncated = trainer.without_truncated

    def spy(batch):
        out, metrics = without_truncated(batch)
        masked.append((batch, out, metrics))
        return out, metrics

    trainer.without_truncated = spy
    trainer.fit()
    assert [step for step, _ in logged] == [0, 1, 2]
    for step, metrics in logged:
        assert all(math.isfinite(v) for v in metrics.values()), step
    for (_, metrics), (before, after, ratio) in zip(logged[1:], masked, strict=True):
        lengths = before.response_mask.sum(-1)
        last = before.response_ids[torch.arange(len(before)), lengths - 1]
        cut = (lengths == 16) & ~torch.isin(last, torch.tensor(trainer.rollout.eos_token_ids))
        assert torch.equal(after.response_mask, before.response_mask * ~cut[:, None])
        assert (
            metrics["training/truncated_masked_ratio"]
            == ratio["training/truncated_masked_ratio"]
            == cut.double().mean().item()
        )
        penalties = (-(lengths.double() - 8) / 8).clamp(max=0)
        assert metrics["reward/overlong_reward/mean"] == pytest.approx(penalties.mean().item())
        assert metrics["reward/overlong/mean"] == pytest.approx((penalties < 0).double().mean().item())
        # digits_reward scores digits / 4; the score adds the penalty
        assert metrics["critic/score/mean"] == pytest.approx(
            metrics["reward/digits/mean"] / 4 + penalties.mean().item()
        )
        assert "timing_s/old_log_prob" in metrics  # masking keeps the separate old-log-prob pass
    assert any(ratio["training/truncated_masked_ratio"] > 0 for _, _, ratio in masked)  # the untrained model runs long
    for step in (0, 2):
        assert {"val-aux/arithmetic/overlong_reward/mean@1", "val-aux/arithmetic/overlong/mean@1"} <= set(
            logged[step][1]
        )


def test_bypass_mode_with_truncated_masking_reads_the_rollout_gap_on_the_trained_rows(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path
):
    """Bypass mode records the actor's log-probs in the update, which sees no tokens of a masked (truncated)
    row: the rollout-vs-actor gap is read over the rows it trained on, so the masked rows do not show as a
    gap (the rollout-mismatch gate reads it). The HF rollout is the actor's own model: the gap stays small."""
    trainer = trainer_for(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        ds_test_config,
        tmp_path,
        "data.max_response_length=16",
        "actor_rollout_ref.actor.mask_truncated_completions=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
        "algorithm.rollout_correction.bypass_mode=true",
    )
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    trainer.fit()
    trained = [metrics for step, metrics in logged if "training/truncated_masked_ratio" in metrics]
    assert trained and any(m["training/truncated_masked_ratio"] > 0 for m in trained)  # the untrained model runs long
    for metrics in trained:
        assert "timing_s/old_log_prob" not in metrics
        assert metrics["training/rollout_probs_diff_max"] < 0.05, metrics["training/rollout_probs_diff_max"]
