"""The checks that stop a run that cannot go on. Each is asked once per training step in the same way:
``record(metrics, step)`` returns the message to stop with (the loop raises ``TrainingStopped`` with it, exit code 1
and the MLflow run FAILED) or None. ``SkipLimit``: ``trainer.max_consecutive_skips``; ``FailureStreak``:
``reward.max_failed_steps``; ``RolloutMismatch``: ``algorithm.rollout_mismatch``. What they count is the same on every
rank (all-reduced metrics, ZeRO's global overflow check), so every rank stops at the same step."""

from __future__ import annotations

from dsrl.rewards import FAILURE_COUNTS

DIFF_MEAN, DIFF_MAX, VALID = (
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_valid",
)
STREAK = "training/rollout_mismatch_streak"


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many optimizer steps in a row with non-finite values)."""


class SkipLimit:
    """``trainer.max_consecutive_skips``: the optimizer steps in a row that a trained engine (``roles``, by name)
    skipped for non-finite values."""

    def __init__(self, cfg, roles: dict):
        self.limit = cfg.trainer.max_consecutive_skips
        self.roles = roles

    def record(self, metrics: dict[str, float], step: int) -> str | None:
        """The message that stops the run when an engine's skips in a row reach the limit, else None."""
        for role in self.roles.values():
            if role.skips.consecutive >= self.limit:
                bad = ", ".join(f"{name}={value}" for name, value in role.skips.last_bad.items())
                return (
                    f"step {step}: {role.skips.consecutive} {role.skips.prefix} optimizer steps in a row skipped for "
                    f"non-finite values (last: {bad}); trainer.max_consecutive_skips={self.limit}. Look for a reward "
                    "or advantage that is not finite, or lower the learning rate; resume from the last checkpoint"
                )
        return None


class RolloutMismatch:
    """``algorithm.rollout_mismatch``: the run stops when the rollout engine keeps sampling from another policy
    than the one being trained. Counts the training steps in a row whose rollout-vs-actor probability gap is above
    ``max_probs_diff`` and keeps their gaps for the message.

    After every weight push the rollout's token probabilities equal the actor's up to numerics:
    ``training/rollout_probs_diff_mean`` (the mean of ``|p_rollout - p_actor|`` over the step's response tokens,
    ``dsrl.trainer.metrics.rollout_logprob_metrics``) is ~1e-7 with fp32 on CPU and ~1e-3 to 1e-2 with a bf16
    rollout. A gap above ``max_probs_diff`` for ``patience`` training steps in a row is not numerics: the policy
    loss's ratios and the rollout correction would be correcting for a broken push, so the run stops with the gap
    of each of those steps and the likely causes.

    A step without the metric (``training/rollout_probs_diff_valid`` 0: no rank has a response token) neither
    counts nor resets the streak: it says nothing either way. A nan gap on a valid step (a log-prob that is not
    a number on one side) counts as above the bound."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.streak: list[tuple[int, float, float]] = []  # (step, mean gap, max gap) of the steps in a row

    def record(self, metrics: dict[str, float], step: int) -> str | None:
        """Count this step's gap and add the streak's length to ``metrics`` as ``training/rollout_mismatch_streak``;
        the message that stops the run when the streak reaches ``patience``, else None. With ``max_probs_diff``
        null nothing is counted or added."""
        gate = self.cfg.algorithm.rollout_mismatch
        if gate.max_probs_diff is None:
            return None
        if metrics.get(VALID):
            mean = metrics[DIFF_MEAN]
            if mean <= gate.max_probs_diff:  # False for nan
                self.streak = []
            else:
                self.streak.append((step, mean, metrics[DIFF_MAX]))
        metrics[STREAK] = len(self.streak)
        if len(self.streak) < gate.patience:
            return None
        return self._message(step)

    def _message(self, step: int) -> str:
        gate = self.cfg.algorithm.rollout_mismatch
        model, rollout = self.cfg.actor_rollout_ref.model, self.cfg.actor_rollout_ref.rollout
        gaps = ", ".join(f"step {s}: {mean:.3g} (max {top:.3g})" for s, mean, top in self.streak)
        if rollout.name == "vllm":
            rollout_dtype, keys = (
                rollout.dtype or model.dtype,
                "actor_rollout_ref.rollout.dtype, actor_rollout_ref.model.dtype",
            )
        else:
            rollout_dtype, keys = model.dtype, "actor_rollout_ref.model.dtype, which the transformers rollout follows"
        causes = [
            "stale rollout weights: a weight push that failed or was skipped (look for update_weights in the log)"
        ]
        # Sleep mode null = on where vLLM has it (GPUs): a level-2 wake without a push is possible.
        if rollout.name == "vllm" and rollout.enable_sleep_mode is not False and rollout.sleep_level == 2:
            causes.append(
                "vLLM woken from sleep level 2 without a full push: a parameter not pushed again holds garbage "
                "(actor_rollout_ref.rollout.sleep_level=1 keeps the weights)"
            )
        causes += [
            f"a dtype mismatch between rollout and actor (here the rollout runs in {rollout_dtype}, the actor in "
            f"{model.dtype}: {keys})",
            "a padded vocabulary: output-layer rows beyond the tokenizer's vocabulary that one side masks and the "
            "other does not",
        ]
        return (
            f"step {step}: the rollout's token probabilities left the actor's in {len(self.streak)} steps in a row "
            f"(training/rollout_probs_diff_mean above algorithm.rollout_mismatch.max_probs_diff="
            f"{gate.max_probs_diff:g}, patience={gate.patience}; {gaps}): the rollout is not sampling from the policy "
            f"being trained. Likely causes: {'; '.join(causes)}. Fix it, then run again (trainer.resume_mode=auto "
            "resumes from the last checkpoint); algorithm.rollout_mismatch.max_probs_diff=null trains on regardless"
        )


class FailureStreak:
    """Counts the training steps in a row whose every response failed to score (the counts are all-reduced
    metrics, so every rank counts alike) and remembers the first failure of the first of them (``scorer``'s
    ``first_failure``, ``dsrl.rewards.RewardScorer``)."""

    def __init__(self, cfg, scorer):
        self.cfg, self.scorer = cfg, scorer
        self.steps, self.first_failure = 0, None

    def record(self, metrics: dict[str, float], step: int) -> str | None:
        """Count this step's failures (``metrics``' ``reward/fail_*``); the message that stops the run when the
        streak reaches ``reward.max_failed_steps``, else None."""
        cfg = self.cfg
        rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n  # every step's responses (drop_last)
        failed = {name: int(metrics[name]) for name in FAILURE_COUNTS if metrics[name]}
        if sum(failed.values()) < rows:
            self.steps, self.first_failure = 0, None
            return None
        self.steps += 1
        self.first_failure = self.first_failure or self.scorer.first_failure  # this step's
        limit = cfg.reward.max_failed_steps
        if not limit or self.steps < limit:
            return None
        fn = cfg.custom_reward_function
        where = f"custom_reward_function.path={fn.path}, name={fn.name}" if fn.path else "the built-in rules"
        fix = f"Fix the reward function ({where})"
        if "reward/fail_timeout" in failed:
            fix += f", or raise reward.timeout_s={cfg.reward.timeout_s:g} if it is only slow"
        counts = " ".join(f"{name}={count}" for name, count in failed.items())
        return (
            f"step {step}: every reward call failed in {self.steps} steps in a row (this step's {rows} rows: "
            f"{counts}; reward.max_failed_steps={limit}). First failure: {self.first_failure}. {fix}, then run "
            "again (trainer.resume_mode=auto resumes from the last checkpoint); reward.max_failed_steps=0 trains "
            "on through such steps"
        )
