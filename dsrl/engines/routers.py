"""The routers of a mixture-of-experts policy: what a forward routed, for the router's auxiliary load-balancing loss
(``actor_rollout_ref.actor.router_aux_loss_coef``) and the ``actor/moe/*`` load metrics.

transformers 5's routers (Qwen3-MoE's ``Qwen3MoeTopKRouter``, Mixtral's, ...) are modules with ``top_k`` and
``num_experts`` whose forward returns ``(router logits, routing weights, chosen experts)``. While a ``RouterRecord``
records, a forward hook on each keeps its logits and choices, and a pre-hook on the model keeps the attention mask it
was called with: the loss is then the model's own ``load_balancing_loss_func`` over exactly what
``output_router_logits=True`` would hand it (every position the routers saw when the mask is not a 2-D padding mask,
as for packed rows). Recording stops before the backward, whose activation-checkpoint recomputes route again.

Routing replay (``actor_rollout_ref.actor.router_replay.mode``, verl's R2 and R3; ``RouteReplay``): a forward hook on
each router swaps its chosen experts for recorded ones and recomputes their weights from the router's current
logits (softmax over all experts, the chosen gathered, renormalised where the router does), so the experts a token
ran through at rollout (R3) or in the old-log-prob pass (R2) are the ones the trainer's forwards run, and the router
still gets its gradient. A token with nothing recorded keeps the router's own choice, which the hook writes into the
routes in place: an activation-checkpoint recompute in backward then runs the forward's experts again, where routing
anew could choose others (and torch would raise ``CheckpointError``), and after a forward the routes hold exactly
what it ran, which is how R2 records.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from dsrl.data.batch import Batch


class AgreementTally(Protocol):
    """Where replay counts the routers' agreement with the recorded experts (``dsrl.engines.forward.PassTally``)."""

    routes_agreed: int
    routes_compared: int


# Models whose routers weigh the chosen experts by the softmax over all experts, renormalised over the chosen where
# ``norm_topk_prob`` says (Mixtral always): what ``RouteReplay`` recomputes for the recorded experts.
REPLAYABLE = ("qwen3_moe", "qwen2_moe", "mixtral")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s routers in layer order: the modules with ``top_k`` and ``num_experts`` (none for a dense model)."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")]


class RouterRecord:
    """Hooks on ``model``'s routers (none for a dense model: ``routers`` is empty)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.experts = self.routers[0].num_experts if self.routers else 0
        self.top_k = self.routers[0].top_k if self.routers else 0
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's
        self.loss_func = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
        self.logits: list[torch.Tensor] = []
        self.chosen: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        self._on = False
        for router in self.routers:
            router.register_forward_hook(self._keep)
        if self.routers:
            model.register_forward_pre_hook(self._keep_mask, with_kwargs=True)

    def _keep(self, module, inputs, output) -> None:
        if self._on:
            self.logits.append(output[0])
            self.chosen.append(output[-1])

    def _keep_mask(self, module, args, kwargs) -> None:
        if self._on:
            mask = kwargs.get("attention_mask")
            self.mask = mask if mask is not None and mask.dim() == 2 else None

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the forwards run inside the block (each block's record replaces the last)."""
        self.logits, self.chosen, self.mask = [], [], None
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def aux_loss(self) -> torch.Tensor:
        """The recorded forward's load-balancing loss (Switch Transformer's, as the model's transformers module
        computes it for ``output_router_logits=True``)."""
        return self.loss_func(tuple(self.logits), self.experts, self.top_k, self.mask)

    def imbalance(self) -> torch.Tensor:
        """The recorded forward's routing imbalance: each layer's busiest expert's share of the choices over the
        mean share (1: even), averaged over the layers; positions the 2-D mask marks as padding left out."""
        ratios = []
        for chosen in self.chosen:
            weights = None if self.mask is None else self.mask.reshape(-1, 1).expand_as(chosen).reshape(-1).float()
            counts = torch.bincount(chosen.reshape(-1), weights=weights, minlength=self.experts).float()
            ratios.append(counts.max() / counts.mean().clamp(min=1e-12))
        return torch.stack(ratios).mean()


class RouteRecorder:
    """The experts each token of a generation ran through (R3's recording, in the transformers rollout): inside
    ``recording``, every forward of ``model`` adds its routers' choices, ``[b, t, layers, k]``, to ``calls``."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.calls: list[torch.Tensor] = []
        self._chosen: list[torch.Tensor] = []
        self._on = False
        for router in self.routers:
            router.register_forward_hook(self._keep)
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        model.register_forward_hook(self._end)

    def _start(self, module, args, kwargs) -> None:
        self._chosen = []

    def _keep(self, module, inputs, output) -> None:
        if self._on:
            self._chosen.append(output[-1])

    def _end(self, module, inputs, output) -> None:
        if self._on:
            chosen = torch.stack(self._chosen, dim=1)  # [b * t, layers, k]
            self.calls.append(chosen.view(output.logits.shape[0], -1, *chosen.shape[1:]).cpu())

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record the forwards run inside the block into a fresh ``calls``, which it yields."""
        self.calls, self._on = [], True
        try:
            yield self.calls
        finally:
            self._on = False


def route_replay_for(model: torch.nn.Module, mode: str) -> RouteReplay | None:
    """The routing replay of ``actor_rollout_ref.actor.router_replay.mode`` on ``model`` (None: disabled)."""
    return None if mode == "disabled" else RouteReplay(model, "actor_rollout_ref.actor.router_replay.mode")


class RouteReplay:
    """Routing replay on ``model``'s routers (see the module's docstring). ``install`` sets the routes of the next
    forward, by the position map of its inputs; they stay in force for its backward's recomputes, until the next
    ``install`` or ``release``. ``key``: the config key that asked for it, for the error when ``model`` cannot."""

    def __init__(self, model: torch.nn.Module, key: str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's
        self.routers = moe_routers(model)
        if not self.routers or base.config.model_type not in REPLAYABLE:
            raise ValueError(
                f"{key}: {base.config.name_or_path} is {base.config.model_type}, whose routers dsrl cannot replay "
                f"({'a dense model' if not self.routers else 'another routing function'}; it replays "
                f"{', '.join(REPLAYABLE)}); fix: set {key}=disabled"
            )
        self.shape = (len(self.routers), self.routers[0].top_k)  # (layers, k) of a token's routes
        self.routes: torch.Tensor | None = None  # [positions, layers, k] int64 on the device; -1: not recorded
        self.where: torch.Tensor | None = None  # [b, P + width]: each batch position's flat input position, or -1
        self.prompt_columns = 0
        self.tally: AgreementTally | None = None
        self._compared: set[int] = set()  # layers whose agreement this forward counted (not again in a recompute)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._replay, layer))

    def install(
        self, micro: Batch, where: torch.Tensor, positions: int, device: torch.device, tally: AgreementTally | None
    ) -> None:
        """The routes of the next forward, ``positions`` long (its inputs flattened), from ``micro``'s recorded
        routes (a ``Batch``; none: every token routes itself) placed by ``where`` (``[b, P + width]``, each batch
        position's flat input position or -1). ``tally`` (a ``PassTally``) counts the agreement of the routers' own
        choices with the recorded experts."""
        routes = torch.full((positions, *self.shape), -1, dtype=torch.long, device=device)
        at = where >= 0
        if micro.prompt_routes is not None and micro.response_routes is not None:
            width = where.shape[1] - micro.prompt_routes.shape[1]
            recorded = torch.cat([micro.prompt_routes, micro.response_routes[:, :width]], dim=1)
            routes[where[at].to(device)] = recorded[at.to(recorded.device)].to(device, torch.long)
        self.routes, self.where, self.tally, self._compared = routes, where, tally, set()
        self.prompt_columns = micro.prompt_ids.shape[1]

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last forward's routes in the batch's layout, int16 on the CPU: ``[b, P, layers, k]`` and
        ``[b, width, layers, k]``, -1 where the batch position was not in the forward."""
        assert self.routes is not None and self.where is not None, "install comes first"
        out = torch.full((*self.where.shape, *self.shape), -1, dtype=torch.int16)
        at = self.where >= 0
        out[at] = self.routes[self.where[at].to(self.routes.device)].to("cpu", torch.int16)
        return out[:, : self.prompt_columns], out[:, self.prompt_columns :]

    def release(self) -> None:
        """Routers route by themselves again."""
        self.routes = self.where = self.tally = None

    def _replay(self, layer: int, module: torch.nn.Module, inputs, output):
        if self.routes is None:
            return None
        logits, scores, own = output
        routes = self.routes[:, layer]  # a view: the routers' own choices are written into self.routes
        if routes.shape[0] != own.shape[0]:
            raise RuntimeError(f"routing replay: the forward routed {own.shape[0]} tokens, {routes.shape[0]} installed")
        recorded = routes[:, 0] >= 0
        if self.tally is not None and layer not in self._compared:
            self._compared.add(layer)
            same = (own[recorded][:, :, None] == routes[recorded][:, None, :]).any(-1)
            self.tally.routes_agreed += int(same.sum())
            self.tally.routes_compared += same.numel()
        chosen = torch.where(recorded[:, None], routes, own)  # not a view: autograd saves it, the routes change
        if not recorded.all():
            routes.copy_(chosen)
        weights = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
        if getattr(module, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen
