"""What every rollout engine offers the trainer.

A rollout engine holds its own copy of the policy, receives the actor's weights with
``update_weights`` and samples ``n`` responses per prompt with ``generate``. ``sleep`` /
``wake_up`` bracket generation so that colocated engines can hand device memory back to the
trainer (vLLM's sleep mode); engines that hold nothing worth releasing treat them as no-ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from dsrl.runtime.seeding import seed_all


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; mirrors ``actor_rollout_ref.rollout.*`` and its ``val_kwargs``."""

    n: int = 1  # responses per prompt; rows i*n .. i*n+n-1 of the output belong to prompt i
    temperature: float = 1.0  # logits are divided by it before sampling (ignored when greedy)
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = off
    top_k: int = -1  # keep the k most likely tokens; -1 = off
    max_tokens: int = 512  # response length cap (data.max_response_length)
    do_sample: bool = True  # False = greedy decoding (validation)
    seed: int | None = None  # per-call seed: the same seed and inputs give the same samples
    # One cap per prompt, each <= max_tokens (multi-turn: each conversation's room left); None = max_tokens for all.
    # vLLM stops each request at its own; HF generates up to max_tokens and the caller cuts.
    row_max_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"rollout.n={self.n}: must be at least 1")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(
                f"rollout.temperature={self.temperature}: sampling needs a temperature > 0; "
                "use do_sample=False for greedy decoding"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k={self.top_k}: must be -1 (off) or a positive count")
        if self.row_max_tokens is not None and (
            self.n != 1 or not all(0 < m <= self.max_tokens for m in self.row_max_tokens)
        ):
            raise ValueError(
                f"row_max_tokens={self.row_max_tokens}: needs n=1 and caps in 1..max_tokens={self.max_tokens}"
            )
        if not self.do_sample and self.n > 1:
            raise ValueError(
                f"rollout n={self.n} with do_sample=False: greedy decoding gives n identical responses; set n=1"
            )

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(cls, cfg, seed: int, *, validation: bool) -> SamplingParams:
        """How the run samples (``actor_rollout_ref.rollout.*``), or how validation does (its ``val_kwargs``: greedy
        by default, as verl), responses up to ``data.max_response_length`` tokens, with ``seed``."""
        rollout = cfg.actor_rollout_ref.rollout
        source = rollout.val_kwargs if validation else rollout
        return cls(
            n=source.n,
            temperature=source.temperature,
            top_p=source.top_p,
            top_k=source.top_k,
            max_tokens=cfg.data.max_response_length,
            do_sample=source.do_sample if validation else True,
            seed=seed,
        )


@dataclass
class RolloutOutput:
    """Responses to ``B`` prompts, ``n`` each: ``B * n`` rows, prompt i's at rows ``i*n .. i*n+n-1``."""

    response_ids: torch.Tensor  # [B*n, T] int64, T = max_tokens, right-padded with the pad id
    response_mask: torch.Tensor  # [B*n, T] int64, 1 on generated tokens up to and including EOS
    log_probs: torch.Tensor  # [B*n, T] float32, log-prob of each token under the sampling distribution, 0 on padding
    finish_reasons: list[str]  # [B*n] "stop" (ended with EOS) or "length" (hit max_tokens)
    # Multi-turn (dsrl.rollout.multi_turn): [B*n, T] int64, 1 on every response token, tool outputs too (response_mask
    # is 0 on those); and per row the conversation: messages, num_turns, num_tool_calls, stop. None for one turn.
    attention_mask: torch.Tensor | None = None
    conversations: list[dict] | None = None
    # Prompt tokens of this call's requests that the engine's prefix cache served (vLLM); 0 for engines without one.
    prefix_cached_tokens: int = 0
    # rollout.enable_rollout_routing_replay (a mixture of experts): [B*n, P, layers, k] and [B*n, T, layers, k]
    # int16, the experts each prompt and response token ran through; -1 where none did (a response's last token)
    prompt_routes: torch.Tensor | None = None
    response_routes: torch.Tensor | None = None


@dataclass(frozen=True)
class PartialRow:
    """One response to resume (partial rollout, ``generate_until``): its prompt's tokens without padding, the
    tokens generated so far (possibly none) and the cap of the whole response."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    max_tokens: int


@dataclass
class RowProgress:
    """What ``generate_until`` added to a ``PartialRow``: the new tokens, their log-probs under the sampling
    distribution (as ``RolloutOutput.log_probs``), and whether the response ended (EOS, or its cap reached)."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finished: bool = False


# generate_until's ``stop``: called after each chunk with every row's ``finished``; True ends the call (the
# unfinished rows are aborted, their progress kept). Called the same number of times on every rank when it
# holds a collective, so an engine calls it after every chunk even when it had nothing left to generate.
StopCheck = Callable[[list[bool]], bool]


def stop_and_pad_ids(tokenizer, generation_eos, model_path: str) -> tuple[list[int], int]:
    """The ids that end a response (the tokenizer's EOS and the generation config's ``eos_token_id``, an
    int or a list) and the id that pads one (the tokenizer's pad token, else the first EOS id)."""
    generation = generation_eos if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    eos_token_ids = sorted(i for i in {tokenizer.eos_token_id, *generation} if i is not None)
    if not eos_token_ids:
        raise ValueError(f"{model_path}: neither the tokenizer nor the generation config names an EOS token")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
    return eos_token_ids, pad_token_id


def seeded(seed: int | None, device: torch.device):
    """A context in which this process's global generators -- python's ``random``, numpy's and torch's (CPU
    and ``device``) -- start from ``seed`` and are restored afterwards; a no-op context for ``None``.

    All three, because engines draw from any of them: vLLM's V2 model runner takes each unseeded request's
    seed from numpy's, and the ranks of a tensor-parallel group must draw alike."""
    if seed is None:
        return contextlib.nullcontext()
    devices = [] if device.type == "cpu" else [device.index if device.index is not None else 0]

    @contextlib.contextmanager
    def context():
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=devices, device_type=device.type):
                seed_all(seed)
                yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

    return context()


class RolloutEngine(Protocol):
    # True when the engine's device memory is reserved for good (vLLM without sleep mode): offloading the
    # training states around generation would free nothing it can use.
    static_memory: bool
    eos_token_ids: list[int]  # the ids that end a response (stop_and_pad_ids)
    pad_token_id: int  # the id that pads one (stop_and_pad_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors, named as in the policy's HF state dict, into the engine's model."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams) -> RolloutOutput:
        """Sample responses to left-padded prompts ``[B, P]``."""

    def generate_until(
        self, rows: Sequence[PartialRow], sampling: SamplingParams, *, chunk_tokens: int, stop: StopCheck
    ) -> list[RowProgress]:
        """Continue each row (``sampling.n`` must be 1: a row is one response) in chunks of at most
        ``chunk_tokens`` tokens, asking ``stop`` after each; ``sampling.seed`` makes it repeatable."""

    def sleep(self) -> None:
        """Release device memory until ``wake_up``."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire what ``sleep`` released (``tags``: e.g. ``["weights"]``, ``["kv_cache"]``)."""
