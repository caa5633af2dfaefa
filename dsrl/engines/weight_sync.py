"""Stream the actor's full parameters out of its (ZeRO-partitioned) engine, a bucket at a time.

Under ZeRO-3 every parameter is split over the ranks; ``deepspeed.zero.GatheredParameters``
all-gathers a bucket of them (a collective: every rank must iterate the whole generator in step),
the full tensors are cloned, the gather is released, and the clones are yielded. At most one
bucket (``bucket_bytes``) of full tensors exists at a time, never the whole model. Stage 0-2
engines keep full parameters on every rank; their tensors are cloned without gathering.

Names are those of ``module.named_parameters()``: for a transformers causal LM, the names of its
HF state dict; a tied LM head appears once, as the input embedding (the receiving model's own
tying updates the head). transformers 5 converts some weights as it loads them (a mixture-of-experts
layer's experts, one tensor per expert and projection on disk, become two fused 3-D parameters);
``checkpoint_format`` hands the stream back under the names and shapes of the model's checkpoints, what
vLLM's loaders and ``from_pretrained`` read, and ``CheckpointTargets`` writes such a stream into a
transformers model's own parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import deepspeed
import torch

try:
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:  # transformers 4 converts nothing: parameters are named and shaped as stored

    def revert_weight_conversion(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict:
        return state_dict


DEFAULT_BUCKET_BYTES = 256 * 2**20


def _full_numel(param: torch.nn.Parameter) -> int:
    return param.ds_numel if hasattr(param, "ds_id") else param.numel()


def _gather_bucket(bucket: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    params = [p for _, p in bucket]
    partitioned = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=partitioned):
        return [(name, p.data.detach().clone()) for name, p in bucket]


def iter_gathered(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for each of ``named_parameters``, gathered a bucket at a time.

    Tensors keep the engine's dtype and device (CPU under parameter offload). A parameter larger
    than ``bucket_bytes`` forms a bucket of its own. Collective under ZeRO-3.
    """
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, param in named_parameters:
        nbytes = _full_numel(param) * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield from _gather_bucket(bucket)
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield from _gather_bucket(bucket)


def iter_full_parameters(
    module: torch.nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter of ``module`` (an engine's ``.module``). Collective
    under ZeRO-3."""
    yield from iter_gathered(module.named_parameters(), bucket_bytes=bucket_bytes)


def _by_module(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """``named`` in runs of one module's parameters (a weight conversion joins or splits one module's)."""
    group: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if group and name.rpartition(".")[0] != next(iter(group)).rpartition(".")[0]:
            yield group
            group = {}
        group[name] = tensor
    if group:
        yield group


def checkpoint_format(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (full tensors of ``model``'s parameters, in ``named_parameters`` order) under the names and shapes
    of ``model``'s checkpoints: transformers' ``revert_weight_conversion``, a module's parameters at a time. The
    identity for a model transformers loads as stored (every dense decoder dsrl runs)."""
    for group in _by_module(named):
        yield from revert_weight_conversion(model, group).items()


class CheckpointTargets:
    """Where each tensor of ``model``'s checkpoint format (``checkpoint_format``) lives in ``model``'s own
    parameters: a parameter itself or a strided view of one (an expert's projection in a fused expert tensor), found
    by running the conversion on the parameters' element indices, a module at a time. ``names``: these parameters
    only, under their own names (a PEFT copy's adapters, which are pushed as named)."""

    def __init__(self, model: torch.nn.Module, names: set[str] | None = None):
        params = {name: p for name, p in model.named_parameters() if names is None or name in names}
        self.targets: dict[str, torch.Tensor] = {}  # a parameter, or a view of one
        if names is not None or getattr(model, "_weight_conversions", None) == []:  # []: loaded, nothing converted
            self.targets = dict(params)
            return
        for group in _by_module(params.items()):
            offsets, start = [], 0
            for param in group.values():
                offsets.append(start)
                start += param.numel()
            indices = {  # float64 holds every index exactly below 2**53
                name: torch.arange(offset, offset + p.numel(), dtype=torch.float64).view(p.shape)
                for (name, p), offset in zip(group.items(), offsets, strict=True)
            }
            for name, index in revert_weight_conversion(model, indices).items():
                owners = (torch.searchsorted(torch.tensor(offsets), index.reshape(-1).long(), right=True) - 1).unique()
                param, offset = list(group.values())[owners[0]], offsets[owners[0]]
                view = _strided_view(param, index - offset) if len(owners) == 1 else None
                if view is None:
                    raise ValueError(
                        f"{type(model).__name__}: its checkpoint tensor {name} is not a slice of one of its parameters "
                        "(transformers converts it on load in a way the transformers rollout cannot write back); fix: "
                        "actor_rollout_ref.rollout.name=vllm"
                    )
                self.targets[name] = view

    def names(self) -> set[str]:
        return set(self.targets)

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy the checkpoint tensor ``name`` into the parameter (or the part of one) it lives in."""
        target = self.targets[name]
        if tensor.shape != target.shape:
            raise ValueError(
                f"update_weights: {name} has shape {tuple(tensor.shape)}, the model's {tuple(target.shape)}"
            )
        target.copy_(tensor)


def _strided_view(param: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
    """The view of ``param`` (contiguous) whose elements are at the flat positions ``index`` (float64, any shape),
    or None when no strided view has them."""
    if not param.is_contiguous():
        return None
    index = index.long()
    corner = (0,) * index.dim()
    origin = int(index[corner])
    strides = [
        int(index[corner[:d] + (1,) + corner[d + 1 :]]) - origin if size > 1 else 1
        for d, size in enumerate(index.shape)
    ]
    if min(strides) < 0:
        return None
    expected = torch.full(index.shape, origin, dtype=torch.long)
    for d, (size, stride) in enumerate(zip(index.shape, strides, strict=True)):
        expected += (torch.arange(size) * stride).view([size if j == d else 1 for j in range(index.dim())])
    if not torch.equal(expected, index):
        return None
    return param.as_strided(index.shape, strides, param.storage_offset() + origin)
