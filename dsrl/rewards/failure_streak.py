"""``reward.max_failed_steps``: steps in a row in which every reward call failed, and when that stops a run."""

from __future__ import annotations

from dsrl.rewards.scorer import FAILURE_COUNTS


class FailureStreak:
    """Counts the training steps in a row whose every response failed to score (the counts are all-reduced
    metrics, so every rank counts alike) and remembers the first failure of the first of them."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.steps, self.first_failure = 0, None

    def record(self, metrics: dict[str, float], step: int, first_failure: str | None) -> str | None:
        """Count this step's failures (``metrics``' ``reward/fail_*``); the message that stops the run when the
        streak reaches ``reward.max_failed_steps``, else None. ``first_failure``: this step's first failure."""
        cfg = self.cfg
        rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n  # every step's responses (drop_last)
        failed = {name: int(metrics[name]) for name in FAILURE_COUNTS if metrics[name]}
        if sum(failed.values()) < rows:
            self.steps, self.first_failure = 0, None
            return None
        self.steps += 1
        self.first_failure = self.first_failure or first_failure
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
