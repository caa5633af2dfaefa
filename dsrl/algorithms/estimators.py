"""Advantage estimators, registered by name.

Each estimator maps an `EstimatorInputs` to `(advantages, returns)`, both `[B, T]`, with the
semantics of verl 0.9.1 `core_algos.py` (values, edge cases), so a verl user gets the same numbers.
All of them are vectorised: groups are handled with segment reductions over `group_ids` (any
int64 ids), never a Python loop over samples or groups; only GAE and REINFORCE++ scan over time,
one `[B]` row per step. No gradient flows through an estimator.

Shared conventions:
    score s_i = Σ_t token_level_rewards[i, t]            (the outcome reward of response i)
    n_g = number of responses in group g; a group of one gets baseline 0
    outcome estimators broadcast a per-response scalar: A[i, t] = a_i · response_mask[i, t]
    masks are 0/1; mask-0 positions inside a response (tool outputs in multi-turn) are skipped
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch

from dsrl.algorithms.tensor_ops import masked_whiten_

Tensor = torch.Tensor
EstimatorFn = Callable[..., tuple[Tensor, Tensor]]

_GRPO_EPS = 1e-6  # added to the group std
_OTB_EPS = 1e-8  # added to the OTB baseline's denominator


@dataclass(frozen=True)
class EstimatorInputs:
    """The tensors an advantage estimator may read.

    Attributes:
        token_level_rewards: `[B, T]` reward per response token (outcome reward at the last token).
        response_mask: `[B, T]` 1 on tokens the policy generated, 0 on padding and observations.
        group_ids: `[B]` int64; equal ids = responses to the same prompt.
        values: `[B, T]` critic values (GAE).
        old_log_probs: `[B, T]` log-probs of the sampled tokens before the update (OTB).
        sum_pi_squared: `[B, T]` Σ_v π_v² of the policy at each token (OTB).
        rollout_is_weights: `[B, T]` truncated importance weights rollout -> trainer (OTB).
        reward_baselines: `[B]` score of the greedy response to the same prompt (ReMax).
        reward_components: `{name: [B]}` the reward function's separate scores, e.g. `acc`, `format` (GDPO).
    """

    token_level_rewards: Tensor
    response_mask: Tensor
    group_ids: Tensor
    values: Tensor | None = None
    old_log_probs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    rollout_is_weights: Tensor | None = None
    reward_baselines: Tensor | None = None
    reward_components: dict[str, Tensor] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.token_level_rewards.shape)
        if len(shape) != 2:
            raise ValueError(f"EstimatorInputs.token_level_rewards must be [B, T]; got shape {shape}")
        for name in ("response_mask", "values", "old_log_probs", "sum_pi_squared", "rollout_is_weights"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(
                    f"EstimatorInputs.{name} must have the shape of token_level_rewards {shape}; "
                    f"got {tuple(tensor.shape)}"
                )
        for name in ("group_ids", "reward_baselines"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != shape[:1]:
                raise ValueError(f"EstimatorInputs.{name} must be [B] = {shape[:1]}; got {tuple(tensor.shape)}")
        for key, tensor in (self.reward_components or {}).items():
            if tuple(tensor.shape) != shape[:1]:
                raise ValueError(
                    f"EstimatorInputs.reward_components[{key!r}] must be [B] = {shape[:1]}; got {tuple(tensor.shape)}"
                )


# What an estimator may need of a step, beyond the rewards and the mask (`register_estimator`'s `needs`).
ESTIMATOR_NEEDS = ("critic", "groups", "sum_pi_squared", "greedy_baseline")

_ESTIMATORS: dict[str, EstimatorFn] = {}
_POLICY_FREE: set[str] = set()  # estimators that read neither old_log_probs nor sum_pi_squared
_OPTIONS: dict[str, dict[str, object]] = {}  # estimator -> its own keyword options and their defaults
_NEEDS: dict[str, frozenset[str]] = {}  # estimator -> what it needs of a step


def register_estimator(
    name: str, *, reads_policy: bool = True, options: dict[str, object] | None = None, needs: Iterable[str] = ()
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator registering an advantage estimator under `name`.

    The function is called as `fn(inputs, *, gamma, lam, norm_adv_by_std, handle_zero_tail, **options)`
    and returns `(advantages [B, T], returns [B, T])`; it may ignore the keywords it has no use for.
    `options` declares the estimator's own keyword options with their defaults, named as verl's
    `algorithm.*` keys (e.g. `{"gdpo_reward_weights": None}`): `compute_advantages` passes each one,
    the caller's value or the default, and refuses any other; the trainer passes `algorithm.<option>`
    for each option the config has.
    `reads_policy=False` declares that it never reads `inputs.old_log_probs` or `inputs.sum_pi_squared`:
    the trainer may then fold the old-log-prob pass of an exactly on-policy step into the update and
    pass them as None.
    `needs` declares what the step must give it, from `ESTIMATOR_NEEDS`: `"critic"` (a critic trained beside
    the actor: `inputs.values`), `"groups"` (its baseline comes from the other responses to the same prompt:
    `rollout.n > 1`), `"sum_pi_squared"` (the actor's forward computes `inputs.sum_pi_squared`),
    `"greedy_baseline"` (a greedy response per prompt, scored: `inputs.reward_baselines`). The config's rules,
    the memory plan and the trainer read them (`estimator_needs`). Registering a taken name, or an unknown need,
    raises `ValueError`.
    """
    unknown = sorted(set(needs) - set(ESTIMATOR_NEEDS))
    if unknown:
        raise ValueError(f"advantage estimator {name!r}: unknown needs {unknown}; known: {', '.join(ESTIMATOR_NEEDS)}")

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered; register under another name")
        _ESTIMATORS[name] = fn
        _OPTIONS[name] = dict(options or {})
        _NEEDS[name] = frozenset(needs)
        if not reads_policy:
            _POLICY_FREE.add(name)
        return fn

    return decorator


def reads_policy(name: str) -> bool:
    """Whether estimator `name` may read `old_log_probs` or `sum_pi_squared` (see `register_estimator`)."""
    return name not in _POLICY_FREE


def estimator_needs(name: str) -> frozenset[str]:
    """What estimator `name` needs of a step (see `register_estimator`)."""
    return _NEEDS[_checked_name(name)]


def estimator_names() -> list[str]:
    """Sorted names accepted by `compute_advantages` (and `algorithm.adv_estimator`)."""
    return sorted(_ESTIMATORS)


def estimator_options(name: str) -> dict[str, object]:
    """The keyword options estimator `name` declared (see `register_estimator`), with their defaults."""
    return dict(_OPTIONS[_checked_name(name)])


def compute_advantages(
    name: str,
    inputs: EstimatorInputs,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    handle_zero_tail: bool = True,
    **options: object,
) -> tuple[Tensor, Tensor]:
    """Run the estimator registered as `name`.

    Args:
        name: an entry of `estimator_names()`.
        inputs: the batch's tensors; estimators check the optional ones they need.
        gamma: discount (GAE, REINFORCE++).
        lam: GAE λ.
        norm_adv_by_std: GRPO, GDPO (and pass@k) divide by the group std; False is Dr.GRPO.
        handle_zero_tail: OTB: baseline 0 where only the longest response of a group reaches.
        options: the estimator's own options (`estimator_options(name)`), e.g. `gdpo_reward_weights`
            (gdpo), `length_weighted_baseline` (rloo, reinforce_plus_plus_baseline); others raise.
    Returns:
        `(advantages, returns)`, each `[B, T]`. Outcome estimators return the same tensor twice.
    """
    fn = _ESTIMATORS[_checked_name(name)]
    declared = _OPTIONS[name]
    unknown = sorted(set(options) - set(declared))
    if unknown:
        valid = ", ".join(sorted(declared)) or "none"
        raise ValueError(f"advantage estimator {name!r} has no option {', '.join(unknown)}; its options: {valid}")
    with torch.no_grad():
        return fn(
            inputs,
            gamma=gamma,
            lam=lam,
            norm_adv_by_std=norm_adv_by_std,
            handle_zero_tail=handle_zero_tail,
            **{**declared, **options},
        )


# ----------------------------------------------------------------------------------------------
# helpers


def _checked_name(name: str) -> str:
    if name not in _ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {', '.join(estimator_names())}")
    return name


def _require(inputs: EstimatorInputs, field: str, estimator: str, what: str) -> Tensor:
    tensor = getattr(inputs, field)
    if tensor is None:
        raise ValueError(f"advantage estimator {estimator!r} needs EstimatorInputs.{field} ({what}); got None")
    return tensor


class _Groups:
    """Dense group index of each row, plus per-group sums over rows."""

    def __init__(self, group_ids: Tensor, dtype: torch.dtype) -> None:
        unique, self.index = torch.unique(group_ids, return_inverse=True)  # index: [B] in [0, G)
        self.num = unique.numel()
        self.size = self.sum(torch.ones_like(self.index, dtype=dtype))  # [G]

    def sum(self, rows: Tensor) -> Tensor:
        """`rows` `[B, ...]` -> per-group sums `[G, ...]`."""
        out = torch.zeros((self.num, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        return out.index_add_(0, self.index, rows)

    def max(self, rows: Tensor) -> Tensor:
        """`rows` `[B]` -> per-group maxima `[G]`."""
        out = torch.full((self.num,), torch.finfo(rows.dtype).min, dtype=rows.dtype, device=rows.device)
        return out.scatter_reduce_(0, self.index, rows, reduce="amax")

    def mean(self, rows: Tensor) -> Tensor:
        """Per-group mean `[G]` of `rows` `[B]`; 0 for groups of one."""
        return torch.where(self.size > 1, self.sum(rows) / self.size, 0.0)

    def std(self, rows: Tensor) -> Tensor:
        """Per-group unbiased std `[G]` of `rows` `[B]`; 1 for groups of one."""
        centred = rows - (self.sum(rows) / self.size)[self.index]
        var = self.sum(centred.square()) / (self.size - 1).clamp(min=1)
        return torch.where(self.size > 1, var.sqrt(), 1.0)


def _scores(inputs: EstimatorInputs) -> Tensor:
    return inputs.token_level_rewards.sum(dim=-1)


def _broadcast(per_response: Tensor, response_mask: Tensor) -> Tensor:
    """`[B]` -> `[B, T]` over the response tokens."""
    return per_response.unsqueeze(-1) * response_mask


def _reverse_cumsum(x: Tensor) -> Tensor:
    """G[:, t] = Σ_{j ≥ t} x[:, j]."""
    return x.flip(-1).cumsum_(-1).flip(-1)


def _time_major(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`[B, T]` -> contiguous `[T, B]` copy, so a scan over time reads contiguous rows."""
    x = x.to(dtype)
    return torch.empty((x.shape[1], x.shape[0]), dtype=dtype, device=x.device).copy_(x.t())


# ----------------------------------------------------------------------------------------------
# critic-based and token-level estimators


@register_estimator("gae", reads_policy=False, needs=("critic",))
def gae(inputs: EstimatorInputs, *, gamma: float, lam: float, **_: object) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438).

    Backwards over the valid tokens of each response, skipping mask-0 positions (they carry the
    next value and the running advantage through unchanged):

        δ_t = r_t + γ V_next(t) - V_t,   V_next(t) = V at the next valid token after t (0 at the end)
        Â_t = δ_t + γλ Â_next(t)
        returns = Â + V                  (before whitening, every position)
        advantages = whiten(Â) over the mask, batch-wide (every position shifted and scaled)

    Shapes: rewards, values, mask `[B, T]` -> advantages, returns `[B, T]`.
    """
    values = _require(inputs, "values", "gae", "the critic's values")
    rewards = inputs.token_level_rewards
    dtype = rewards.dtype
    mask = inputs.response_mask.to(dtype)

    # Time-major copies: each scan step then reads one contiguous [B] row.
    adv_T = _time_major(rewards, dtype)  # m·(r - V), then the advantages, in place row by row
    value_T = _time_major(values, dtype)
    mask_T = _time_major(mask, dtype)
    adv_T.sub_(value_T).mul_(mask_T)

    # With a 0/1 mask m the scan is linear and branch-free:
    #   Â_t = m_t (r_t - V_t + γ V_next) + (1 + m_t (γλ - 1)) Â_next
    #   V_next <- V_next + m_t (V_t - V_next)
    next_value = torch.zeros_like(adv_T[0])
    next_adv = torch.zeros_like(adv_T[0])
    step = torch.empty_like(adv_T[0])
    for t in range(adv_T.shape[0] - 1, -1, -1):
        m_t, adv_t = mask_T[t], adv_T[t]
        adv_t.addcmul_(m_t, next_value, value=gamma).add_(next_adv).addcmul_(m_t, next_adv, value=gamma * lam - 1.0)
        next_adv = adv_t
        next_value.addcmul_(m_t, torch.sub(value_T[t], next_value, out=step))

    advantages = torch.empty_like(rewards).copy_(adv_T.t())
    returns = advantages + values
    masked_whiten_(advantages, mask, scratch=value_T.view(advantages.shape))
    return advantages, returns


@register_estimator("reinforce_plus_plus", reads_policy=False)
def reinforce_plus_plus(inputs: EstimatorInputs, *, gamma: float, **_: object) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262): whitened discounted return.

    Backwards over the valid tokens, mask-0 positions carrying the running return unchanged:

        G_t = r_t + γ G_next(t)    at valid tokens; returns = G · mask (0 at mask-0 positions)
        advantages = whiten(returns) over the mask, batch-wide, · mask

    Shapes: rewards, mask `[B, T]` -> advantages, returns `[B, T]`.
    """
    rewards = inputs.token_level_rewards
    dtype = rewards.dtype
    mask = inputs.response_mask.to(dtype)

    returns_T = _time_major(rewards, dtype)  # m·r, then the returns, in place row by row
    mask_T = _time_major(mask, dtype)
    returns_T.mul_(mask_T)

    # With a 0/1 mask: returns_t = m_t (r_t + γ G),  G <- returns_t + (1 - m_t) G.
    running = torch.zeros_like(returns_T[0])
    for t in range(returns_T.shape[0] - 1, -1, -1):
        m_t, returns_t = mask_T[t], returns_T[t]
        returns_t.addcmul_(m_t, running, value=gamma)
        running.addcmul_(m_t, running, value=-1.0).add_(returns_t)

    returns = torch.empty_like(rewards).copy_(returns_T.t())
    advantages = masked_whiten_(returns.clone(), mask, scratch=returns_T.view(returns.shape)).mul_(mask)
    return advantages, returns


@register_estimator("remax", reads_policy=False, needs=("greedy_baseline",))
def remax(inputs: EstimatorInputs, **_: object) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505): the greedy response's score as baseline.

        returns[i, t] = Σ_{j ≥ t} r[i, j] m[i, j]       (reward-to-go; not masked itself)
        advantages[i, t] = returns[i, t] - b_i · m[i, t],  b_i = reward_baselines[i]

    Shapes: rewards, mask `[B, T]`, reward_baselines `[B]` -> advantages, returns `[B, T]`.
    """
    baselines = _require(inputs, "reward_baselines", "remax", "the greedy response's score per sample, [B]")
    mask = inputs.response_mask
    returns = _reverse_cumsum(inputs.token_level_rewards * mask)
    advantages = torch.addcmul(returns, baselines.to(returns.dtype).unsqueeze(-1), mask, value=-1.0)
    return advantages, returns


# ----------------------------------------------------------------------------------------------
# outcome estimators with a group baseline


@register_estimator("grpo", reads_policy=False, needs=("groups",))
def grpo(inputs: EstimatorInputs, *, norm_adv_by_std: bool, **_: object) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) and Dr.GRPO (Liu et al. 2025,
    https://arxiv.org/abs/2503.20783) outcome advantages.

        a_i = (s_i - mean_g) / (std_g + 1e-6)     norm_adv_by_std=True; std_g is unbiased (Bessel)
        a_i = s_i - mean_g                         norm_adv_by_std=False (Dr.GRPO)
        groups of one: mean 0, std 1

    Shapes: rewards, mask `[B, T]`, group_ids `[B]` -> advantages = returns `[B, T]`.
    Also registered as `grpo_vectorized` (verl's name for the same quantity).
    """
    scores = _scores(inputs)
    groups = _Groups(inputs.group_ids, scores.dtype)
    advantages = _broadcast(_group_normalised(scores, groups, norm_adv_by_std), inputs.response_mask)
    return advantages, advantages


register_estimator("grpo_vectorized", reads_policy=False, needs=("groups",))(grpo)


def _group_normalised(scores: Tensor, groups: _Groups, norm_adv_by_std: bool) -> Tensor:
    """GRPO's per-response advantage `[B]` of `scores` `[B]` (see `grpo`)."""
    centred = scores - groups.mean(scores)[groups.index]
    if norm_adv_by_std:
        centred = centred / (groups.std(scores)[groups.index] + _GRPO_EPS)
    return centred


@register_estimator("gdpo", reads_policy=False, options={"gdpo_reward_weights": None}, needs=("groups",))
def gdpo(
    inputs: EstimatorInputs, *, norm_adv_by_std: bool, gdpo_reward_weights: list[float] | None, **_: object
) -> tuple[Tensor, Tensor]:
    """GDPO, group reward-decoupled normalisation (https://arxiv.org/abs/2601.05242): each reward
    component is normalised within its group before the components are added, so a component with a
    large spread does not drown the others.

        a_ik = GRPO advantage of component k's scores r_ik (see `grpo`; norm_adv_by_std applies)
        x_i = Σ_k w_k a_ik          w = gdpo_reward_weights in the order of reward_components; None = all 1
        advantages = whiten(x_i · m) over the mask, batch-wide, · m   (unbiased variance, + 1e-8)

    `token_level_rewards` (and so an in-reward KL penalty) does not enter. As verl, the components
    are cast to float32 first. The token-level whitening is computed on `[B]` with weights |y_i|, as
    in `reinforce_plus_plus_baseline`.
    Shapes: mask `[B, T]`, group_ids `[B]`, reward_components `{k: [B]}` -> advantages = returns `[B, T]`.
    """
    components = inputs.reward_components
    if not components:
        raise ValueError(
            "advantage estimator 'gdpo' needs EstimatorInputs.reward_components ({name: [B] scores}, one or more); "
            f"got {components!r}"
        )
    weights = [1.0] * len(components) if gdpo_reward_weights is None else list(gdpo_reward_weights)
    if len(weights) != len(components):
        raise ValueError(
            f"gdpo_reward_weights has {len(weights)} weights for {len(components)} reward components "
            f"({', '.join(components)}); give one weight per component, or None for equal weights"
        )
    groups = _Groups(inputs.group_ids, torch.float32)
    normalised = [_group_normalised(r.to(torch.float32), groups, norm_adv_by_std) for r in components.values()]
    total = cast(Tensor, sum(w * a for w, a in zip(weights, normalised, strict=True)))  # [B]
    advantages = _broadcast(masked_whiten_(total, _lengths(inputs, torch.float32)), inputs.response_mask)
    return advantages, advantages


@register_estimator("rloo", reads_policy=False, options={"length_weighted_baseline": False}, needs=("groups",))
def rloo(inputs: EstimatorInputs, *, length_weighted_baseline: bool, **_: object) -> tuple[Tensor, Tensor]:
    """RLOO, leave-one-out baseline (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740).

        a_i = s_i - mean_{j ≠ i in g} s_j = s_i · n/(n-1) - mean_g · n/(n-1)
        groups of one: a_i = s_i

    With `length_weighted_baseline` (OPO's length weighting, applied to the others' mean):
        a_i = s_i - Σ_{j ≠ i} |y_j| s_j / Σ_{j ≠ i} |y_j|,   |y_j| = Σ_t response_mask[j, t]
        baseline 0 where Σ_{j ≠ i} |y_j| = 0 (a group of one, or only empty other responses)
    With equal lengths this is the unweighted a_i.

    Shapes: rewards, mask `[B, T]`, group_ids `[B]` -> advantages = returns `[B, T]`.
    """
    scores = _scores(inputs)
    groups = _Groups(inputs.group_ids, scores.dtype)
    if length_weighted_baseline:
        lengths = _lengths(inputs, scores.dtype)
        others_weighted = groups.sum(lengths * scores)[groups.index] - lengths * scores
        others_length = groups.sum(lengths)[groups.index] - lengths
        baseline = torch.where(others_length > 0, others_weighted / others_length, 0.0)
        per_response = scores - baseline
    else:
        n = groups.size[groups.index]
        mean = (groups.sum(scores) / groups.size)[groups.index]
        factor = n / (n - 1).clamp(min=1)
        per_response = torch.where(n > 1, scores * factor - mean * factor, scores)
    advantages = _broadcast(per_response, inputs.response_mask)
    return advantages, advantages


@register_estimator(
    "rloo_vectorized", reads_policy=False, options={"length_weighted_baseline": False}, needs=("groups",)
)
def rloo_vectorized(inputs: EstimatorInputs, *, length_weighted_baseline: bool, **_: object) -> tuple[Tensor, Tensor]:
    """`rloo`, except that a group of one gets advantage 0 rather than its score: verl 0.9.1's two
    RLOO forms disagree there, and each name gives its own form's numbers."""
    advantages = rloo(inputs, length_weighted_baseline=length_weighted_baseline)[0]
    groups = _Groups(inputs.group_ids, advantages.dtype)
    advantages = advantages * (groups.size[groups.index] > 1).unsqueeze(-1)
    return advantages, advantages


@register_estimator("opo", reads_policy=False, needs=("groups",))
def opo(inputs: EstimatorInputs, **_: object) -> tuple[Tensor, Tensor]:
    """OPO, length-weighted group baseline (Hao et al. 2025, https://arxiv.org/abs/2505.23585).

        a_i = s_i - Σ_{j in g} |y_j| s_j / Σ_{j in g} |y_j|,   |y_j| = Σ_t response_mask[j, t]
        groups of one (or of empty responses only): baseline 0; no division by a std

    Exact on-policy training (one mini-batch, one epoch) is the paper's setting.
    Shapes: rewards, mask `[B, T]`, group_ids `[B]` -> advantages = returns `[B, T]`.
    """
    scores = _scores(inputs)
    groups = _Groups(inputs.group_ids, scores.dtype)
    baseline = _length_weighted_mean(scores, _lengths(inputs, scores.dtype), groups)
    advantages = _broadcast(scores - baseline[groups.index], inputs.response_mask)
    return advantages, advantages


def _lengths(inputs: EstimatorInputs, dtype: torch.dtype) -> Tensor:
    """|y_i| = Σ_t response_mask[i, t], `[B]`."""
    return inputs.response_mask.sum(dim=-1).to(dtype)


def _length_weighted_mean(scores: Tensor, lengths: Tensor, groups: _Groups) -> Tensor:
    """OPO's baseline `[G]`: Σ_g |y_j| s_j / Σ_g |y_j|; 0 for groups of one or of empty responses only."""
    total_length = groups.sum(lengths)
    return torch.where((groups.size > 1) & (total_length > 0), groups.sum(lengths * scores) / total_length, 0.0)


@register_estimator(
    "reinforce_plus_plus_baseline", reads_policy=False, options={"length_weighted_baseline": False}, needs=("groups",)
)
def reinforce_plus_plus_baseline(
    inputs: EstimatorInputs, *, length_weighted_baseline: bool, **_: object
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, https://arxiv.org/abs/2501.03262).

        x_i = s_i - mean_g  (groups of one: x_i = s_i)
        advantages = whiten(x_i · m) over the mask, batch-wide, · m

    With `length_weighted_baseline`, mean_g is OPO's length-weighted group mean (see `opo`):
        x_i = s_i - Σ_{j in g} |y_j| s_j / Σ_{j in g} |y_j|   (0 for groups of one or of empty responses only)
    then the same whitening. With equal lengths this is the unweighted x_i.

    The token-level whitening statistics equal length-weighted statistics over responses, so
    they are computed on `[B]` (weights |y_i| = Σ_t m[i, t]).
    Shapes: rewards, mask `[B, T]`, group_ids `[B]` -> advantages = returns `[B, T]`.
    """
    scores = _scores(inputs)
    groups = _Groups(inputs.group_ids, scores.dtype)
    lengths = _lengths(inputs, scores.dtype)
    baseline = _length_weighted_mean(scores, lengths, groups) if length_weighted_baseline else groups.mean(scores)
    advantages = _broadcast(masked_whiten_(scores - baseline[groups.index], lengths), inputs.response_mask)
    return advantages, advantages


@register_estimator("gpg", reads_policy=False, needs=("groups",))
def gpg(inputs: EstimatorInputs, **_: object) -> tuple[Tensor, Tensor]:
    """GPG, group policy gradient (Chu et al. 2025, https://arxiv.org/abs/2504.02546).

        a_i = α (s_i - mean_g),   α = B / max(1, #{i : s_i ≠ 0})   (groups of one: mean 0)

    Shapes: rewards, mask `[B, T]`, group_ids `[B]` -> advantages = returns `[B, T]`.
    """
    scores = _scores(inputs)
    groups = _Groups(inputs.group_ids, scores.dtype)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    advantages = _broadcast(alpha * (scores - groups.mean(scores)[groups.index]), inputs.response_mask)
    return advantages, advantages


@register_estimator("grpo_passk", reads_policy=False, needs=("groups",))
def grpo_passk(inputs: EstimatorInputs, *, norm_adv_by_std: bool, **_: object) -> tuple[Tensor, Tensor]:
    """Pass@k advantage (Chen et al. 2025, https://arxiv.org/abs/2503.19595).

    Only the best response of each group learns:
        a_best = (s_max - s_second) [/ (std_g + 1e-6) if norm_adv_by_std],  a_other = 0
    Every group needs at least two responses.
    Shapes: rewards, mask `[B, T]`, group_ids `[B]` -> advantages = returns `[B, T]`.
    """
    scores = _scores(inputs)
    groups = _Groups(inputs.group_ids, scores.dtype)
    torch._assert_async((groups.size >= 2).all(), "grpo_passk needs at least two responses per group")
    best = groups.max(scores)
    is_best = scores == best[groups.index]
    runner_up = groups.max(torch.where(is_best, torch.finfo(scores.dtype).min, scores))
    second = torch.where(groups.sum(is_best.to(scores.dtype)) > 1, best, runner_up)
    gap = best - second
    if norm_adv_by_std:
        gap = gap / (groups.std(scores) + _GRPO_EPS)
    # One winner per group (the first best row); ties give a gap of 0 anyway.
    rows = torch.arange(scores.shape[0], device=scores.device)
    winner = torch.full((groups.num,), scores.shape[0], dtype=rows.dtype, device=rows.device)
    winner.scatter_reduce_(0, groups.index, torch.where(is_best, rows, scores.shape[0]), reduce="amin")
    per_response = torch.zeros_like(scores)
    per_response[winner] = gap
    advantages = _broadcast(per_response, inputs.response_mask)
    return advantages, advantages


# ----------------------------------------------------------------------------------------------
# optimal token baseline


@register_estimator("optimal_token_baseline", needs=("groups", "sum_pi_squared"))
def optimal_token_baseline(inputs: EstimatorInputs, *, handle_zero_tail: bool, **_: object) -> tuple[Tensor, Tensor]:
    """Optimal Token Baseline, a per-position group baseline weighted by path variance (Li et al.
    2026, "The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL", PMLR 306,
    https://raw.githubusercontent.com/mlresearch/v306/main/assets/li26hy/li26hy.pdf).

        G_t = Σ_{j ≥ t} r_j m_j                              (returns)
        w_t = 1 - 2 π_t + Σ_v π_v²  (· ρ_t² with rollout_is_weights ρ), π_t = exp(old_log_probs)
        W_t = Σ_{j ≤ t} w_j m_j
        B_t = Σ_{i in g} G_t W_t m_t / (Σ_{i in g} W_t m_t + 1e-8)   per group and position t
        A_t = (G_t - B_t) m_t

    Groups of one: B = 0. With `handle_zero_tail`, the group's unique longest response gets
    B_t = 0 for t ≥ the second-longest length (no other response estimates the baseline there).
    Shapes: rewards, mask, old_log_probs, sum_pi_squared `[B, T]` -> advantages, returns `[B, T]`.
    """
    return _otb(inputs, handle_zero_tail=handle_zero_tail, compact=False, name="optimal_token_baseline")


@register_estimator("tir_optimal_token_baseline", needs=("groups", "sum_pi_squared"))
def tir_optimal_token_baseline(
    inputs: EstimatorInputs, *, handle_zero_tail: bool, **_: object
) -> tuple[Tensor, Tensor]:
    """Optimal Token Baseline for tool-integrated (multi-turn) responses.

    As `optimal_token_baseline`, but the position t that pairs tokens across a group counts valid
    tokens only: each response is compacted (observation holes removed), the baseline computed
    per compacted position, and scattered back. Empty responses do not count towards a group's
    size. Same inputs and shapes.
    """
    return _otb(inputs, handle_zero_tail=handle_zero_tail, compact=True, name="tir_optimal_token_baseline")


def _otb(inputs: EstimatorInputs, *, handle_zero_tail: bool, compact: bool, name: str) -> tuple[Tensor, Tensor]:
    old_log_probs = _require(inputs, "old_log_probs", name, "log-probs of the sampled tokens before the update")
    sum_pi_squared = _require(inputs, "sum_pi_squared", name, "Σπ² per token; set calculate_sum_pi_squared")
    rewards = inputs.token_level_rewards
    mask = inputs.response_mask.to(rewards.dtype)
    batch, length = rewards.shape

    returns = _reverse_cumsum(rewards * mask)
    path_weight = torch.exp(old_log_probs).mul_(-2.0).add_(1.0).add_(sum_pi_squared)  # w_t
    if inputs.rollout_is_weights is not None:
        path_weight.mul_(inputs.rollout_is_weights.square())
    path_weight.mul_(mask).cumsum_(-1).mul_(mask)  # W_t m_t
    weighted_returns = returns * path_weight  # G_t W_t m_t

    groups = _Groups(inputs.group_ids, rewards.dtype)
    lengths = mask.sum(dim=-1)
    if compact:
        # Compacted position of each valid token (exact in float: T < 2^24); mask-0 tokens take
        # a neighbour's slot but add zeros there and are masked out of the result.
        position = torch.cumsum(mask, dim=-1).sub_(1.0).clamp_(min=0.0)
        index_dtype = torch.int32 if groups.num * length < 2**31 else torch.long  # int32 gathers faster
        slot = position.to(index_dtype).add_((groups.index * length).to(index_dtype).unsqueeze(-1)).view(-1)
        numerator = torch.zeros(groups.num * length, dtype=rewards.dtype, device=rewards.device)
        numerator.index_add_(0, slot, weighted_returns.view(-1))
        denominator = torch.zeros_like(numerator).index_add_(0, slot, path_weight.view(-1)).add_(_OTB_EPS)
        group_size = groups.sum((lengths > 0).to(rewards.dtype))  # empty responses do not count
        per_group = numerator.div_(denominator).view(groups.num, length)
        per_group.mul_((group_size > 1).to(per_group.dtype).unsqueeze(-1))
        baseline = per_group.view(-1).index_select(0, slot).view(batch, length)
    else:
        position = torch.arange(length, device=rewards.device, dtype=rewards.dtype).expand(batch, length)
        numerator = groups.sum(weighted_returns)
        denominator = groups.sum(path_weight).add_(_OTB_EPS)
        per_group = numerator.div_(denominator).mul_((groups.size > 1).to(rewards.dtype).unsqueeze(-1))
        baseline = per_group.index_select(0, groups.index)

    if handle_zero_tail:
        cutoff = _zero_tail_cutoff(lengths, groups, length)
        baseline.masked_fill_(position >= cutoff.unsqueeze(-1), 0.0)

    advantages = baseline.neg_().add_(returns).mul_(mask)
    return advantages, returns


def _zero_tail_cutoff(lengths: Tensor, groups: _Groups, length: int) -> Tensor:
    """`[B]` position from which a row's baseline is 0: the second-longest length of its group for
    the group's unique strictly-longest row, `length` (never) for every other row."""
    longest = groups.max(lengths)[groups.index]
    is_longest = lengths == longest
    unique_longest = groups.sum(is_longest.to(lengths.dtype))[groups.index] == 1
    second = groups.max(torch.where(is_longest, -1.0, lengths))[groups.index]
    zero_tail = is_longest & unique_longest & (second >= 0) & (longest > second)
    return torch.where(zero_tail, second, float(length))
