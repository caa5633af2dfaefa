"""The routers of a mixture-of-experts policy: what a forward routed, for the router's auxiliary load-balancing loss
(``actor_rollout_ref.actor.router_aux_loss_coef``) and the ``actor/moe/*`` load metrics.

transformers 5's routers (Qwen3-MoE's ``Qwen3MoeTopKRouter``, Mixtral's, ...) are modules with ``top_k`` and
``num_experts`` whose forward returns ``(router logits, routing weights, chosen experts)``. While a ``RouterRecord``
records, a forward hook on each keeps its logits and choices, and a pre-hook on the model keeps the attention mask it
was called with: the loss is then the model's own ``load_balancing_loss_func`` over exactly what
``output_router_logits=True`` would hand it (every position the routers saw when the mask is not a 2-D padding mask,
as for packed rows). Recording stops before the backward, whose activation-checkpoint recomputes route again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class RouterRecord:
    """Hooks on ``model``'s routers (none for a dense model: ``routers`` is empty)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")]
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
