"""Arithmetic reward: exact match of the integer answer (the synthetic task of ``dsrl.data.arithmetic``).

Format: the whole response is the integer, e.g. ``"82"`` for the prompt ``"37+45="``. Surrounding
whitespace and one trailing end marker (``<|im_end|>`` or ``<|endoftext|>``, present when the
response is decoded with special tokens) are allowed; anything else (words, a second number)
scores 0, so the policy cannot collect reward by listing candidates.
"""

import re

_ANSWER = re.compile(r"\s*(-?[0-9]+)\s*(?:<\|im_end\|>|<\|endoftext\|>)?\s*")


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response is exactly the integer ``ground_truth`` (see module doc), else 0.0."""
    match = _ANSWER.fullmatch(solution_str)
    return 1.0 if match is not None and int(match.group(1)) == int(ground_truth) else 0.0
