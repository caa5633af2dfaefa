"""Rewards: rule-based scores chosen by ``data_source``, user functions, and a time-limited batch scorer.

Public API (verl's signature, so a verl ``custom_reward_function`` works unchanged):

- ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float``: the built-in
  dispatcher (``arithmetic``; ``calculator``; ``worded_arithmetic``; ``openai/gsm8k``; ``lighteval/MATH``,
  ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``; with ``reward.sandbox_fusion.url``, the
  code sources ``codecontests``, ``apps``, ``codeforces``, ``taco``: ``dsrl.rewards.code``).
- ``load_custom_reward_function(path, name)``: a user's function with the same signature.
- ``make_compute_score(math_verify_sources)``: the dispatcher with some data sources scored by
  Math-Verify (``dsrl.rewards.mathverify``, the optional extra ``dsrl[math]``) instead.
- ``RewardScorer.from_config(cfg).score_batch(...)``: what the trainer calls; the calls run in a
  pool of worker processes (pebble), each under ``reward.timeout_s``; a call that raises, times out,
  returns no finite number or kills its worker scores ``reward.fallback_score`` and is counted
  (``reward/fail_exception``, ``reward/fail_timeout``, ``reward/fail_invalid``, ``reward/fail_crash``);
  a batch that hangs on every call is cut short; ``first_failure`` quotes what went wrong first; the
  workers' output goes to the scorer's log file (rotated at ``reward.log_max_mb``); each worker's memory
  is bounded by ``reward.memory_limit_mb`` and the processes a call starts are killed with its worker.
  With ``custom_reward_function.batch: true`` the function takes lists (verl's batch reward manager).
- ``overlong_penalties(lengths, ...)``: DAPO's soft overlong punishment (``reward_model.reward_manager: dapo``).

This package imports no torch, so a worker process starts in a fraction of a second; ``dsrl.rewards.model_inputs``
(the reward model's token sequences of a batch, and the checks of the reward model's and the distillation teacher's
tokenizers) needs torch and is imported on its own.
"""

import importlib
from collections.abc import Callable, Iterable

from dsrl.rewards import arithmetic, calculator, code, gsm8k, worded
from dsrl.rewards import math as math_answer
from dsrl.rewards.custom import load_custom_reward_function
from dsrl.rewards.overlong import overlong_penalties
from dsrl.rewards.scorer import FAILURE_COUNTS, RewardScorer, numeric_extras, reward_components
from dsrl.workers.pool import default_num_workers

_RULES: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic.compute_score,
    "calculator": calculator.compute_score,
    "worded_arithmetic": worded.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_answer.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_answer.compute_score,
    "HuggingFaceH4/MATH-500": math_answer.compute_score,
}


def rule_sources() -> list[str]:
    """The data sources with a built-in rule."""
    return sorted(_RULES)


def check_reward_rules(
    prompt_sets: dict[str, object], *, custom_path: str | None, math_verify_sources, sandbox_fusion_url: str | None
) -> None:
    """ValueError naming every data source of ``prompt_sets`` ({config key: a PromptStore or None}) that nothing
    would score: without a custom reward function every data source needs a built-in rule (or Math-Verify, or for
    the code sources a SandboxFusion server); one without would score 0 on every row for the whole run."""
    if custom_path:
        return
    scored = set(rule_sources()) | set(math_verify_sources) | set(code.CODE_SOURCES if sandbox_fusion_url else ())
    unmatched = [
        (source, f"{source!r} ({rows} rows of {key})")
        for key, prompts in prompt_sets.items()
        if prompts is not None
        for source, rows in prompts.source_counts().items()
        if source not in scored
    ]
    if not unmatched:
        return
    fixes = (
        "set custom_reward_function.path to a file defining compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None), list them in reward.math_verify_sources, or rename data_source"
    )
    if any(source in code.CODE_SOURCES for source, _ in unmatched):
        fixes = (
            f"the code sources {list(code.CODE_SOURCES)} are scored by running the code on a SandboxFusion server: "
            f"set reward.sandbox_fusion.url to its /run_code URL; others: {fixes}"
        )
    raise ValueError(
        f"data sources without a reward rule: {', '.join(shown for _, shown in unmatched)}; built-in rules: "
        f"{rule_sources()}. Fix: {fixes}"
    )


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Score one response with the rule registered for ``data_source`` (1.0 correct, 0.0 otherwise).

    ``extra_info`` is accepted for signature compatibility with verl; the built-in rules ignore it. The code
    sources run on the SandboxFusion server of ``reward.sandbox_fusion.url`` (``dsrl.rewards.code``): in a
    reward worker of a run that sets it; elsewhere they raise ValueError.
    """
    if data_source in code.CODE_SOURCES:
        return code.compute_score(solution_str, ground_truth, code.sandbox_client())
    rule = _RULES.get(data_source)
    if rule is None:
        raise ValueError(
            f"data_source={data_source!r} has no built-in reward (known: {rule_sources()}). "
            "Fix: write the rows with one of these data_source values, or set custom_reward_function.path "
            "to a file defining compute_score(data_source, solution_str, ground_truth, extra_info=None)."
        )
    return float(rule(solution_str, ground_truth))


def make_compute_score(math_verify_sources: Iterable[str] = ()) -> Callable:
    """``compute_score``, except that the data sources in ``math_verify_sources`` (any names, built-in
    or not) are scored by Math-Verify. ValueError naming the fix when math-verify is not installed."""
    sources = frozenset(math_verify_sources)
    if not sources:
        return compute_score
    try:
        mathverify = importlib.import_module("dsrl.rewards.mathverify")
    except ImportError as exc:
        raise ValueError(f"reward.math_verify_sources={sorted(sources)}: {exc}") from None

    def compute_score_with_math_verify(data_source, solution_str, ground_truth, extra_info=None) -> float:
        if data_source in sources:
            return mathverify.compute_score(solution_str, ground_truth)
        return compute_score(data_source, solution_str, ground_truth, extra_info)

    return compute_score_with_math_verify


__all__ = [
    "FAILURE_COUNTS",
    "RewardScorer",
    "check_reward_rules",
    "compute_score",
    "default_num_workers",
    "load_custom_reward_function",
    "make_compute_score",
    "numeric_extras",
    "overlong_penalties",
    "reward_components",
    "rule_sources",
]
