"""DAPO's soft overlong punishment (Yu et al., 2025, https://arxiv.org/abs/2503.14476, §3.4), as verl's
``dapo`` reward manager adds it to each response's score.

With L_max = ``max_resp_len`` and a buffer of L_cache = ``len`` tokens before it, a response of |y| tokens gets

    penalty(|y|) = min(0, -(|y| - (L_max - L_cache)) / L_cache * penalty_factor)

0 up to L_max - L_cache tokens, then falling linearly to -penalty_factor at L_max (and further below it past
L_max, which a response cut at data.max_response_length = L_max never reaches).
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalties(
    lengths: Sequence[int], *, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> list[float]:
    """The penalty of each response from its length in tokens (EOS included, as the response mask counts it);
    each <= 0, to be added to the response's score. ``buffer_len`` > 0."""
    expected = max_resp_len - buffer_len
    return [min(0.0, -(length - expected) / buffer_len * penalty_factor) for length in lengths]
