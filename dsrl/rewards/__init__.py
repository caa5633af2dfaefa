"""Rewards: rule-based scores chosen by ``data_source``, user functions, and a time-limited batch scorer.

Public API (verl's signature, so a verl ``custom_reward_function`` works unchanged):

- ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float``: the built-in
  dispatcher (``arithmetic``; ``openai/gsm8k``; ``lighteval/MATH``,
  ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``).
- ``load_custom_reward_function(path, name)``: a user's function with the same signature.
- ``RewardScorer(custom_path, custom_name, timeout_s).score_batch(...)``: what the trainer calls;
  every call runs in a worker process under a time limit, and exceptions and timeouts score 0 and
  are counted.

This package imports no torch, so the worker process starts in a fraction of a second.
"""

from collections.abc import Callable

from dsrl.rewards import arithmetic, gsm8k
from dsrl.rewards import math as math_answer
from dsrl.rewards.custom import load_custom_reward_function
from dsrl.rewards.scorer import RewardScorer, numeric_extras

_RULES: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_answer.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_answer.compute_score,
    "HuggingFaceH4/MATH-500": math_answer.compute_score,
}


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Score one response with the rule registered for ``data_source`` (1.0 correct, 0.0 otherwise).

    ``extra_info`` is accepted for signature compatibility with verl; the built-in rules ignore it.
    """
    rule = _RULES.get(data_source)
    if rule is None:
        raise ValueError(
            f"data_source={data_source!r} has no built-in reward (known: {sorted(_RULES)}). "
            "Fix: write the rows with one of these data_source values, or set custom_reward_function.path "
            "to a file defining compute_score(data_source, solution_str, ground_truth, extra_info=None)."
        )
    return float(rule(solution_str, ground_truth))


__all__ = ["RewardScorer", "compute_score", "load_custom_reward_function", "numeric_extras"]
