"""Worded-sums reward: the last integer of the response (the task of ``dsrl.data.worded``).

A chat model answers ``"What is 4+5? Answer with just the number."`` with ``"9"``, ``"4 + 5 = 9"`` or
``"The answer is 9."``: each scores 1.0, as its last integer is the sum; ``"4 + 5 = 10"`` and a response
cut off before any number score 0.0.
"""

import re

_INTEGER = re.compile(r"-?[0-9]+")


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last integer of ``solution_str`` equals ``ground_truth``, else 0.0."""
    integers = _INTEGER.findall(solution_str)
    return 1.0 if integers and int(integers[-1]) == int(ground_truth) else 0.0
