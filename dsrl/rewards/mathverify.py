"""Math answers checked with Hugging Face's Math-Verify (``pip install 'dsrl[math]'``), as verl's
``verl/utils/reward_score/math_verify.py`` does it.

Chosen per data source with ``reward.math_verify_sources`` (the built-in dispatcher then scores those
data sources here instead of with its rule). The ground truth is parsed as ``\\boxed{<ground_truth>}``
with LaTeX extraction; the response with expression and LaTeX extraction (its last boxed answer first,
then plain numbers and expressions); 1.0 if any pair is mathematically equivalent (``0.5`` =
``\\frac{1}{2}`` = ``\\dfrac12`` = ``50\\%``, ``[1,2)`` as an interval, ``x = 3`` = ``3``, sets in any
order), else 0.0.

Math-Verify limits its own parsing and checking time with ``signal.alarm``, which works in a reward
worker (tasks run on its main thread); the worker's ``reward.timeout_s`` bounds the whole call anyway.
Importing it (sympy, antlr) takes about a second, once per worker.
"""

from __future__ import annotations

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as exc:  # pragma: no cover - exercised when the extra is missing
    raise ImportError(
        "reward.math_verify_sources needs the math-verify package. Fix: pip install 'dsrl[math]' "
        "(or pip install math-verify), or set reward.math_verify_sources=[]"
    ) from exc

_GOLD = (LatexExtractionConfig(),)
_PRED = (ExprExtractionConfig(), LatexExtractionConfig())


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if an answer in ``solution_str`` is equivalent to ``ground_truth`` by Math-Verify, else 0.0."""
    gold = parse("\\boxed{" + str(ground_truth) + "}", _GOLD)
    pred = parse(solution_str, _PRED)
    if not gold or not pred:
        return 0.0
    return 1.0 if any(verify(g, p) for g in gold for p in pred) else 0.0
