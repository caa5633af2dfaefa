"""Stream the actor's full parameters out of its (ZeRO-partitioned) engine, a bucket at a time.

Under ZeRO-3 every parameter is split over the ranks; ``deepspeed.zero.GatheredParameters``
all-gathers a bucket of them (a collective: every rank must iterate the whole generator in step),
the full tensors are cloned, the gather is released, and the clones are yielded. At most one
bucket (``bucket_bytes``) of full tensors exists at a time, never the whole model. Stage 0-2
engines keep full parameters on every rank; their tensors are cloned without gathering.

Names are those of ``module.named_parameters()``: for a transformers causal LM, the names of its
HF state dict; a tied LM head appears once, as the input embedding (the receiving model's own
tying updates the head).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import deepspeed
import torch

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
