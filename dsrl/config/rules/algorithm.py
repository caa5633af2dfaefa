"""The algorithm's rules: the advantage estimator and its options, the policy and value losses with their
parameters, KL (in the loss and in the reward), the optimizers, and DAPO's group filtering. The names of
estimators and losses include the ones the user's modules register (``user_code.registered_names``)."""

from __future__ import annotations

from collections.abc import Collection

from dsrl.config.keys import value_at
from dsrl.config.loading import policy_loss_param_key
from dsrl.config.names import (
    ADV_ESTIMATORS,
    KL_CTRL_TYPES,
    KL_KINDS,
    LENGTH_WEIGHTED_ESTIMATORS,
    LOSS_AGG_MODES,
    LR_SCHEDULES,
    PF_PPO_METHODS,
    POLICY_LOSS_MODES,
    POLICY_LOSS_PARAMS,
)
from dsrl.config.problems import show
from dsrl.config.rules.need import Need, critic_used, whole_forward_rules
from dsrl.config.schema import Config
from dsrl.config.user_code import estimator_needs, registered_names, registered_policy_loss_params


def estimator_rules(cfg: Config, need: Need) -> None:
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    estimator = algo.adv_estimator
    known = registered_names("algorithm.adv_estimator", ADV_ESTIMATORS)
    needs = estimator_needs(estimator)
    need(
        estimator in known,
        "algorithm.adv_estimator",
        "unknown estimator",
        "register it with dsrl.algorithms.register_estimator in a module listed in algorithm.import_modules, or use "
        f"one of {', '.join(known)}",
    )
    if "groups" in needs:
        need(
            cfg.actor_rollout_ref.rollout.n > 1,
            "actor_rollout_ref.rollout.n",
            f"{estimator} compares the responses to the same prompt, so it needs more than one",
            "set actor_rollout_ref.rollout.n=8 (4-16 is typical)",
        )
    if "critic" in needs:
        need(
            cfg.critic.model.path is not None,
            "critic.model.path",
            f"{estimator} learns a value function and needs a critic model",
            "set critic.model.path (usually the same as actor_rollout_ref.model.path)",
        )
    elif estimator in known:  # the trainer builds a critic for the estimators that need one only
        need(
            cfg.critic.model.path is None,
            "critic.model.path",
            f"{estimator} uses no critic, so none would be trained",
            "set critic.model.path=null, or algorithm.adv_estimator=gae to train one",
        )
        need(
            cfg.trainer.critic_warmup == 0,
            "trainer.critic_warmup",
            f"{estimator} has no critic to warm up",
            "set trainer.critic_warmup=0",
        )
    if estimator == "opo" and not algo.opo_allow_off_policy:
        need(
            actor.ppo_mini_batch_size == cfg.data.train_batch_size,
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "opo trains exactly on-policy: one optimizer step per batch, so it must equal "
            f"data.train_batch_size={cfg.data.train_batch_size}",
            f"set it to {cfg.data.train_batch_size}, or algorithm.opo_allow_off_policy=true",
        )
        need(
            actor.ppo_epochs == 1,
            "actor_rollout_ref.actor.ppo_epochs",
            "opo trains exactly on-policy: one pass over each batch",
            "set it to 1, or algorithm.opo_allow_off_policy=true",
        )


def estimator_option_rules(cfg: Config, need: Need) -> None:
    """gdpo's reward components, the length-weighted baselines and PF-PPO: set only where they take effect."""
    algo = cfg.algorithm
    estimator, keys, weights = algo.adv_estimator, algo.gdpo_reward_keys, algo.gdpo_reward_weights
    if estimator == "gdpo":
        need(
            keys,
            "algorithm.gdpo_reward_keys",
            "gdpo normalises each reward component separately, so it needs their names",
            "set it to keys of the dict your reward function returns, e.g. [acc,format]",
        )
        need(
            weights is None or not keys or len(weights) == len(keys),
            "algorithm.gdpo_reward_weights",
            f"needs one weight per algorithm.gdpo_reward_keys entry ({len(keys or [])})",
            "give one weight per key, in the same order, or null for equal weights",
        )
        need(
            not algo.use_kl_in_reward,
            "algorithm.use_kl_in_reward",
            "gdpo computes its advantages from the reward components alone, so an in-reward KL penalty never reaches "
            "them (verl ignores it too)",
            "set algorithm.use_kl_in_reward=false (actor_rollout_ref.actor.use_kl_loss=true keeps a KL term)",
        )
    else:
        for key, value in (("gdpo_reward_keys", keys), ("gdpo_reward_weights", weights)):
            need(
                value is None,
                f"algorithm.{key}",
                f"only gdpo reads it, and algorithm.adv_estimator is {estimator}",
                f"set algorithm.adv_estimator=gdpo, or algorithm.{key}=null",
            )
    need(
        not algo.length_weighted_baseline or estimator in LENGTH_WEIGHTED_ESTIMATORS,
        "algorithm.length_weighted_baseline",
        f"only {', '.join(LENGTH_WEIGHTED_ESTIMATORS)} have a group baseline to weigh by length "
        f"(opo's is length-weighted already), and algorithm.adv_estimator is {estimator}",
        "set algorithm.length_weighted_baseline=false, or algorithm.adv_estimator=rloo or reinforce_plus_plus_baseline",
    )
    pf = algo.pf_ppo
    need(
        pf.reweight_method in PF_PPO_METHODS,
        "algorithm.pf_ppo.reweight_method",
        "unknown method",
        f"use one of {', '.join(PF_PPO_METHODS)}",
    )
    need(
        pf.weight_pow > 0,
        "algorithm.pf_ppo.weight_pow",
        "must be > 0: 0 weighs every row alike, and a negative power gives a row scoring 0 an infinite weight",
        "set it to 2.0",
    )
    if algo.use_pf_ppo:
        need(
            "critic" in estimator_needs(estimator),
            "algorithm.use_pf_ppo",
            f"verl resamples the batch after GAE's advantages only; with {estimator} it would do nothing there",
            "set algorithm.adv_estimator=gae, or algorithm.use_pf_ppo=false",
        )
    else:
        for name, default in (("reweight_method", "pow"), ("weight_pow", 2.0)):
            need(
                value_at(pf, name) == default,
                f"algorithm.pf_ppo.{name}",
                "has no effect while algorithm.use_pf_ppo is false",
                f"set algorithm.use_pf_ppo=true, or remove it (the default is {default})",
            )


def loss_rules(cfg: Config, need: Need) -> None:
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    prefix = "actor_rollout_ref.actor"
    need(actor.clip_ratio > 0, f"{prefix}.clip_ratio", "must be > 0", "set it to 0.2")
    need(
        actor.clip_ratio_low is None or 0 < actor.clip_ratio_low < 1,
        f"{prefix}.clip_ratio_low",
        "must be in (0, 1): the ratio is clipped below at 1 - clip_ratio_low",
        "set it to 0.2 or null (= clip_ratio)",
    )
    need(
        actor.clip_ratio_high is None or actor.clip_ratio_high > 0,
        f"{prefix}.clip_ratio_high",
        "must be > 0",
        "set it to 0.2 (or 0.28, clip-higher) or null",
    )
    need(
        actor.clip_ratio_c > 1,
        f"{prefix}.clip_ratio_c",
        "must be > 1: dual clip bounds the loss of negative advantages at clip_ratio_c times the advantage "
        "(dppo_tv/dppo_kl truncate the importance weight at it)",
        "set it to 3.0",
    )
    losses = registered_names(f"{prefix}.policy_loss.loss_mode", POLICY_LOSS_MODES)
    need(
        actor.policy_loss.loss_mode in losses,
        f"{prefix}.policy_loss.loss_mode",
        "unknown policy loss",
        "register it with dsrl.algorithms.register_policy_loss in a module listed in algorithm.import_modules, or use "
        f"one of {', '.join(losses)}",
    )
    for key in (f"{prefix}.loss_agg_mode", "critic.loss_agg_mode"):
        need(
            value_at(cfg, key) in LOSS_AGG_MODES,
            key,
            "unknown loss aggregation",
            f"use one of {', '.join(LOSS_AGG_MODES)}",
        )
    _kl_kind_rule(f"{prefix}.kl_loss_type", actor.kl_loss_type, need)
    _kl_kind_rule("algorithm.kl_penalty", algo.kl_penalty, need)
    need(actor.kl_loss_coef >= 0, f"{prefix}.kl_loss_coef", "must be >= 0", "set it to 0.001")
    _router_aux_loss_rules(cfg, need)
    need(algo.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0", "set it to 0.001")
    need(
        algo.kl_ctrl.type in KL_CTRL_TYPES,
        "algorithm.kl_ctrl.type",
        "unknown KL controller",
        f"use one of {', '.join(KL_CTRL_TYPES)}",
    )
    if algo.kl_ctrl.type == "adaptive":
        need(
            algo.kl_ctrl.horizon > 0,
            "algorithm.kl_ctrl.horizon",
            "the adaptive controller divides by it, so it must be > 0",
            "set it to 10000",
        )
        need(
            algo.kl_ctrl.target_kl > 0,
            "algorithm.kl_ctrl.target_kl",
            "the adaptive controller steers toward it, so it must be > 0",
            "set it to 0.1",
        )
    need(0 <= algo.gamma <= 1, "algorithm.gamma", "must be in [0, 1]", "set it to 1.0")
    need(0 <= algo.lam <= 1, "algorithm.lam", "must be in [0, 1]", "set it to 1.0")
    _optim_rules(cfg, prefix, need)
    if critic_used(cfg):
        _optim_rules(cfg, "critic", need)
        need(cfg.critic.cliprange_value > 0, "critic.cliprange_value", "must be > 0", "set it to 0.5")


def _kl_kind_rule(key: str, value: str, need: Need) -> None:
    if value == "full":
        need(
            False,
            key,
            "the full-vocabulary KL needs both policies' whole distributions; dsrl computes KL from sampled-token "
            "log-probs only",
            "use low_var_kl (k3, low variance) or kl (k1)",
        )
    else:
        need(value in KL_KINDS, key, "unknown KL estimator", f"use one of {', '.join(KL_KINDS)}")


def _router_aux_loss_rules(cfg: Config, need: Need) -> None:
    key, coef = "actor_rollout_ref.actor.router_aux_loss_coef", cfg.actor_rollout_ref.actor.router_aux_loss_coef
    need(coef >= 0, key, "must be >= 0", "set it to 0 (off) or e.g. 0.001")
    if coef > 0:
        whole_forward_rules(cfg, key, "the coefficient to 0", need)


def _optim_rules(cfg: Config, role: str, need: Need) -> None:
    optim = value_at(cfg, f"{role}.optim")
    need(optim.lr > 0, f"{role}.optim.lr", "must be > 0", "set it to e.g. 1e-6 (actor) or 1e-5 (critic)")
    need(optim.weight_decay >= 0, f"{role}.optim.weight_decay", "must be >= 0", "set it to 0.01 or 0")
    need(
        len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas),
        f"{role}.optim.betas",
        "must be two numbers in [0, 1)",
        "set it to [0.9,0.999]",
    )
    need(
        0 <= optim.lr_warmup_steps_ratio <= 1,
        f"{role}.optim.lr_warmup_steps_ratio",
        "must be in [0, 1]",
        "set it to e.g. 0.05, or set lr_warmup_steps",
    )
    for key in ("lr_scheduler_type", "warmup_style"):
        value = optim[key]
        if value is not None:
            need(
                value in LR_SCHEDULES,
                f"{role}.optim.{key}",
                "unknown schedule",
                f"use one of {', '.join(LR_SCHEDULES)}",
            )
    need(0 <= optim.min_lr_ratio <= 1, f"{role}.optim.min_lr_ratio", "must be in [0, 1]", "set it to e.g. 0.1, or 0")
    need(optim.num_cycles > 0, f"{role}.optim.num_cycles", "must be > 0", "set it to 0.5 (one half-cosine)")
    for key in (f"{role}.optim.clip_grad", f"{role}.grad_clip"):
        value = value_at(cfg, key)
        need(value is None or value >= 0, key, "must be >= 0", "set it to 1.0, or 0 to turn clipping off")


def loss_param_rules(cfg: Config, given: Collection[str], need: Need) -> None:
    """The chosen policy loss's own parameters (``POLICY_LOSS_PARAMS``, or what a user loss declares) in range; a
    parameter of another loss, or one in policy_loss.params the loss does not declare, refused: it would do nothing."""
    prefix = "actor_rollout_ref.actor"
    actor, losses = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.actor.policy_loss
    mode = losses.loss_mode
    names = POLICY_LOSS_PARAMS.get(mode, ()) if mode in POLICY_LOSS_MODES else registered_policy_loss_params(mode)
    read = {policy_loss_param_key(name) for name in names}
    for loss, loss_names in POLICY_LOSS_PARAMS.items():
        for key in map(policy_loss_param_key, loss_names):
            need(
                key in read or key not in given,
                key,
                f"a parameter of the {loss} loss, which loss_mode={mode} does not read: it would do nothing",
                f"remove it, or set {prefix}.policy_loss.loss_mode={loss}",
            )
    ranges = {  # name: (ok, rule, fix)
        "clip_cov_ratio": (
            0 < losses.clip_cov_ratio <= 1,
            "must be in (0, 1]: a fraction of the tokens",
            "set it to 0.0002",
        ),
        "clip_cov_ub": (
            losses.clip_cov_lb < losses.clip_cov_ub,
            f"must be > clip_cov_lb ({show(losses.clip_cov_lb)}): the covariance band is (clip_cov_lb, clip_cov_ub)",
            "set clip_cov_lb=1.0 and clip_cov_ub=5.0",
        ),
        "kl_cov_ratio": (
            0 < losses.kl_cov_ratio <= 1,
            "must be in (0, 1]: a fraction of the tokens",
            "set it to 0.0002",
        ),
        "ppo_kl_coef": (losses.ppo_kl_coef >= 0, "must be >= 0: the weight of a penalty", "set it to 0.1"),
        "tau_pos": (actor.tau_pos > 0, "must be > 0: the gate's temperature", "set it to 1.0"),
        "tau_neg": (actor.tau_neg > 0, "must be > 0: the gate's temperature", "set it to 1.05"),
        "dro_beta": (
            losses.dro_beta is not None and losses.dro_beta > 0,
            f"must be > 0 with loss_mode={mode}: the weight of the quadratic log-ratio penalty (no default, as in "
            "verl)",
            "set it, e.g. to 0.1",
        ),
    }
    for name in names:
        if name in ranges:
            ok, rule, fix = ranges[name]
            need(ok, policy_loss_param_key(name), rule, fix)
    own = [name for name in names if policy_loss_param_key(name) is None]
    for name in losses.params:
        key = policy_loss_param_key(name)
        need(
            name in own,
            f"{prefix}.policy_loss.params.{name}",
            f"loss_mode={mode} declares no parameter {name}" if key is None else f"{name} has a key of its own",
            f"set {key} instead"
            if key
            else f"remove it (the parameters of {mode} set here: {', '.join(own) or 'none'})",
        )


def filter_groups_rules(cfg: Config, need: Need) -> None:
    """DAPO's dynamic sampling: a metric, groups of more than one response, and the score known when it filters.
    With enable false the other keys are accepted unread (DAPO's scripts set metric and max_num_gen_batches
    with enable=False)."""
    algo, fg = cfg.algorithm, cfg.algorithm.filter_groups
    if not fg.enable:
        return
    need(
        fg.metric,
        "algorithm.filter_groups.metric",
        "algorithm.filter_groups.enable=true needs the number a group's responses must differ in",
        "set it to acc (DAPO's recipe: a key the reward function's dict returns) or seq_reward (the score)",
    )
    need(
        cfg.actor_rollout_ref.rollout.n > 1,
        "actor_rollout_ref.rollout.n",
        "algorithm.filter_groups.enable=true drops groups whose responses all score alike; with one response per "
        "prompt every group is kept (as verl), so filtering would do nothing",
        "set actor_rollout_ref.rollout.n=8 (4-16 is typical), or algorithm.filter_groups.enable=false",
    )
    need(
        algo.adv_estimator != "remax",
        "algorithm.adv_estimator",
        "remax's greedy baseline is generated once per step, not for the extra rounds of algorithm.filter_groups",
        "use grpo or rloo with algorithm.filter_groups.enable=true, or set it to false",
    )
    need(
        not (fg.metric == "seq_final_reward" and algo.use_kl_in_reward),
        "algorithm.filter_groups.metric",
        "seq_final_reward is the score after the in-reward KL penalty, which needs the reference pass that runs after "
        "filtering",
        "set it to seq_reward (the score before KL), or algorithm.use_kl_in_reward=false",
    )
