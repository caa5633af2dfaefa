"""Math-Verify answers (the optional extra dsrl[math]) chosen per data source by reward.math_verify_sources,
beside the default MATH rule, which stays verl's."""

import importlib.util
import sys

import pytest

from dsrl.rewards import FAILURE_COUNTS, RewardScorer, compute_score, make_compute_score

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None,
    reason="math-verify is not installed (pip install 'dsrl[math]' or pip install math-verify)",
)


@needs_math_verify
@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so the answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # fraction = decimal
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),  # \dfrac, unbraced \frac
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # equal values, different strings
        ("\\boxed{50\\%}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("$x \\in \\boxed{[1,2)}$", "[1,2)", 1.0),  # an interval
        ("\\boxed{[1,2]}", "[1,2)", 0.0),  # closed at 2: a different interval
        ("\\boxed{(1,2]}", "[1,2)", 0.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{2, 1}", "1,2", 1.0),  # a set, in any order
        ("\\boxed{0.6}", "\\frac{1}{2}", 0.0),
        ("I do not know", "1", 0.0),
    ],
)
def test_math_verify_equivalences(response, truth, score):
    from dsrl.rewards import mathverify

    assert mathverify.compute_score(response, truth) == score


def test_the_default_math_rule_stays_verls_string_match():
    # What Math-Verify accepts above, verl's normalised string match (the default) does not.
    assert compute_score("lighteval/MATH", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 0.0
    assert compute_score("lighteval/MATH", "\\boxed{50\\%}", "\\frac{1}{2}") == 0.0
    assert compute_score("lighteval/MATH", "\\boxed{\\dfrac{1}{2}}", "\\frac12") == 1.0


@needs_math_verify
def test_the_scorer_uses_math_verify_only_for_the_listed_sources():
    sources = ["lighteval/MATH", "my/olympiad"]
    rows = ["lighteval/MATH", "HuggingFaceH4/MATH-500", "my/olympiad", "openai/gsm8k"]
    responses = ["\\boxed{\\frac{2}{4}}", "\\boxed{\\frac{2}{4}}", "\\boxed{[1,2)}", "#### 5"]
    truths = ["\\frac{1}{2}", "\\frac{1}{2}", "[1,2)", "5"]
    with RewardScorer(math_verify_sources=sources, num_workers=1, timeout_s=30) as scorer:
        scores, _, counts = scorer.score_batch(rows, responses, truths, [None] * 4)
    assert scores == [1.0, 0.0, 1.0, 1.0]  # MATH-500 is not listed: the default rule
    assert counts == dict.fromkeys(FAILURE_COUNTS, 0)


def test_math_verify_sources_without_the_package_fail_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    monkeypatch.delitem(sys.modules, "dsrl.rewards.mathverify", raising=False)
    with pytest.raises(ValueError, match=r"math_verify_sources=\['lighteval/MATH'\].*pip install 'dsrl\[math\]'"):
        make_compute_score(["lighteval/MATH"])
    assert make_compute_score([]) is compute_score  # nothing listed: nothing needed
