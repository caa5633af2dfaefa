"""PF-PPO: verl's resampling weights by hand for each method, and a draw that only its generator decides."""

import pytest
import torch

from dsrl.algorithms import PF_PPO_METHODS, pf_ppo_indices, pf_ppo_weights

SCORES = torch.tensor([-2.0, 0.0, 1.0, 3.0])
FLOOR = 1e-8  # verl adds it to every weight, so each row keeps a chance


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("pow", [4.0, 0.0, 1.0, 9.0]),  # |s|^2
        ("max_min", [1.0, 0.0, 0.0, 1.0]),  # the highest (3) and the lowest (-2)
        ("max_random", [0.1, 0.1, 0.1, 0.4]),  # the highest 0.4, the others 0.1
    ],
)
def test_weights_by_hand(method, expected):
    torch.testing.assert_close(pf_ppo_weights(SCORES, method, 2.0), torch.tensor(expected) + FLOOR)


def test_pow_uses_weight_pow():
    torch.testing.assert_close(pf_ppo_weights(SCORES, "pow", 0.5), SCORES.abs().sqrt() + FLOOR)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'median'; valid: pow, max_min, max_random"):
        pf_ppo_weights(SCORES, "median", 2.0)
    assert PF_PPO_METHODS == ("pow", "max_min", "max_random")


def test_the_draw_is_decided_by_the_generator():
    scores = torch.linspace(-1.0, 1.0, 64)
    draw = lambda seed: pf_ppo_indices(scores, "pow", 2.0, torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))
    assert draw(3).shape == (64,) and draw(3).dtype == torch.int64


def test_rows_with_a_floor_weight_are_almost_never_drawn():
    scores = torch.cat([torch.ones(500), torch.zeros(500)])  # pow: weight 1 against 1e-8
    rows = pf_ppo_indices(scores, "pow", 2.0, torch.Generator().manual_seed(0))
    assert rows.max() < 500
    # max_random: the best rows weigh 4x the others
    scores = torch.cat([torch.ones(100), torch.zeros(900)])
    rows = pf_ppo_indices(scores, "max_random", 2.0, torch.Generator().manual_seed(0))
    share = (rows < 100).float().mean().item()
    assert share == pytest.approx(100 * 0.4 / (100 * 0.4 + 900 * 0.1), abs=0.05)  # 40 / 130
