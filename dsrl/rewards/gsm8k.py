"""GSM8K reward: the final answer after ``####``, compared as a string (verl-compatible).

GSM8K solutions end with ``#### <number>`` (Cobbe et al. 2021, https://arxiv.org/abs/2110.14168);
the rule-based reward of ReFT (Luong et al. 2024, https://arxiv.org/abs/2401.08967) as verl scores
it:

- ``strict``: the number after the LAST ``"#### "`` (one space) with ``,`` and ``$`` removed;
  a response without that marker scores 0. This also rewards the format.
- ``flexible``: the last run of digits, ``.`` and ``,`` (optionally ``-``) anywhere, as written
  (commas kept), ignoring runs that are only ``.``.

Only the last 300 characters are searched, as in verl, which bounds regex time on long responses.
Score 1.0 when the extracted string equals the ground truth exactly (``prepare_data.py`` stores it
without commas), else 0.0 (verl's ``format_score`` 0).
"""

import re

# verl searches only the tail of the response; keeping the same window keeps scores identical.
TAIL_CHARS = 300
_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string of a GSM8K-style response, or None when there is none (see module doc)."""
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        found = _STRICT_ANSWER.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        found = _NUMBER.findall(tail)
        numbers = [n for n in found if n != "."]
        # verl falls through to the first match when every match is "."; kept for identical scores.
        return numbers[-1] if numbers else (found[0] if found else None)
    raise ValueError(f"method={method!r}: must be 'strict' or 'flexible'")


def compute_score(solution_str: str, ground_truth: str, method: str = "strict") -> float:
    """1.0 if the extracted answer equals ``ground_truth`` (exact string), else 0.0."""
    return 1.0 if extract_answer(solution_str, method) == ground_truth else 0.0
