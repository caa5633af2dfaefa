"""bench/reward_model.py's reward functions (``custom_reward_function.path``): both log the built-in rule's exact
match as the extra ``acc`` (validation: ``val-core/arithmetic/acc/mean@1``), which never enters the reward."""

from dsrl.rewards import compute_score


def reward_model_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """The reward model's score (``extra_info["reward_model_score"]``): the reward the recipe trains on without a
    function, the same number."""
    return {"score": extra_info["reward_model_score"], "acc": compute_score(data_source, solution_str, ground_truth)}


def rule_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """The rule's exact match (the reward model, still enabled, only scores: ``reward_model_score`` is logged)."""
    exact = compute_score(data_source, solution_str, ground_truth)
    return {"score": exact, "acc": exact}
