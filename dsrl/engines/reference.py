"""The reference policy: a frozen copy of the initial actor under DeepSpeed, forward only; and the distillation
teacher, another frozen causal LM scored the same way.

Built from ``actor_rollout_ref.model.path`` with ``actor_rollout_ref.ref.deepspeed_config``
(default ``zero3_offload_inference``: ZeRO-3 with parameters offloaded to CPU, no optimizer). A LoRA run
needs no copy: its reference is the actor with the adapters off (``AdapterOffReference``). The teacher
(``teacher_engine``) is built from ``distillation.teacher_models.teacher_model``'s path and DeepSpeed setup and runs
the reference's micro-batches, packing and sequence-parallel groups; it never replays the actor's experts (its
routers are its own).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import deepspeed
import torch
from transformers import AutoModelForCausalLM

from dsrl.config.keys import value_at
from dsrl.data.batch import Batch
from dsrl.engines.deepspeed_setup import (
    DTYPES,
    build_ds_config,
    init_distributed,
    load_pretrained,
)
from dsrl.engines.forward import PassTally, compute_response_stats, fused_head_for
from dsrl.engines.packing import Packing, packing_for
from dsrl.engines.routers import RouteReplay, route_replay_for
from dsrl.engines.sequence_parallel import SequenceParallel, sequence_parallel_for


class ReferenceEngine:
    """``compute_log_probs(batch, temperature=...) -> ref_log_probs [B, T]``; never trains."""

    def __init__(self, cfg: Any, *, prefix: str = "actor_rollout_ref.ref", path: str | None = None, name: str = "ref"):
        """``prefix``: the config section of its DeepSpeed setup; ``path``: its checkpoint (default: the actor's);
        ``name``: its pass in the forward metrics."""
        init_distributed()
        self.cfg, self.name = cfg, name
        self.tallies: defaultdict[str, PassTally] = defaultdict(PassTally)  # the trainer takes them each step
        model_cfg, ref = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.ref
        self.ds_config = build_ds_config(
            value_at(cfg, prefix).deepspeed_config,
            key=f"{prefix}.deepspeed_config",
            micro_batch_size_per_gpu=ref.log_prob_micro_batch_size_per_gpu,
            gradient_accumulation_steps=1,
            dtype=model_cfg.dtype,
            prefix=prefix,
        )
        module = load_pretrained(
            self.ds_config,
            lambda: AutoModelForCausalLM.from_pretrained(
                path or model_cfg.path, dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code
            ),
        )
        dedup = cfg.actor_rollout_ref.actor.use_prefix_grouper
        self.packing = (
            packing_for(module, "actor_rollout_ref.model.use_remove_padding", dedup=dedup)
            if model_cfg.use_remove_padding
            else None
        )
        module.requires_grad_(False)
        self.sp = sequence_parallel_for(module, cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size)
        self.engine, *_ = deepspeed.initialize(model=module, config=self.ds_config)
        self.engine.eval()
        self.fused_head = fused_head_for(self.engine.module, cfg.actor_rollout_ref.actor.use_fused_kernels)
        self.replay = route_replay_for(module, cfg.actor_rollout_ref.actor.router_replay.mode) if path is None else None

    def compute_log_probs(self, batch: Batch, *, temperature: float) -> torch.Tensor:
        """``ref_log_probs`` ``[B, T]`` float32, 0 on padding (``reference_log_probs``). Collective."""
        return reference_log_probs(
            self.engine,
            batch,
            self.cfg,
            self.packing,
            self.fused_head,
            temperature=temperature,
            tally=self.tallies[self.name],
            sp=self.sp,
            replay=self.replay,
        )


def teacher_engine(cfg: Any) -> ReferenceEngine:
    """The distillation teacher (``distillation.teacher_models.teacher_model``): ``compute_log_probs`` gives its
    log-probs of the student's response tokens."""
    prefix = "distillation.teacher_models.teacher_model"
    return ReferenceEngine(cfg, prefix=prefix, path=value_at(cfg, prefix).model_path, name="teacher")


class AdapterOffReference:
    """The reference of a LoRA run: the actor's own network with its adapters off (verl's ``ref_in_actor``),
    so no second model is loaded. ``compute_log_probs`` as ``ReferenceEngine``'s."""

    def __init__(self, cfg: Any, actor: Any):
        self.cfg = cfg
        self.tallies: defaultdict[str, PassTally] = defaultdict(PassTally)
        self.actor = actor

    def compute_log_probs(self, batch: Batch, *, temperature: float) -> torch.Tensor:
        self.actor.engine.eval()
        with self.actor.module.disable_adapter():
            return reference_log_probs(
                self.actor.engine,
                batch,
                self.cfg,
                self.actor.packing,
                self.actor.fused_head,
                temperature=temperature,
                tally=self.tallies["ref"],
                sp=self.actor.sp,
                replay=self.actor.replay,
            )


def reference_log_probs(
    engine: Any,
    batch: Batch,
    cfg: Any,
    packing: Packing | None,
    fused_head: torch.nn.Module | None,
    *,
    temperature: float,
    tally: PassTally | None = None,
    sp: SequenceParallel | None = None,
    replay: RouteReplay | None = None,
) -> torch.Tensor:
    """``ref_log_probs`` ``[B, T]`` float32, 0 on padding, of ``engine``'s model. Micro-batches of
    ``ref.log_prob_micro_batch_size_per_gpu`` rows, or of ``ref.log_prob_max_token_len_per_gpu`` tokens with
    ``ref.log_prob_use_dynamic_bsz`` (both default to the actor's, as in verl); ``packing``, ``fused_head``,
    ``tally``, ``sp``: see ``policy_stats``; ``replay``: the forwards run the batch's recorded experts (R3: the
    rollout's, R2: the old-log-prob pass's), as the actor's do. Collective."""
    ref = cfg.actor_rollout_ref.ref
    stats = compute_response_stats(
        engine,
        batch,
        temperature=temperature,
        micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
        max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
        budget_key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        share_prompts=cfg.actor_rollout_ref.model.shared_prompt_forward,
        packing=packing,
        fused_head=fused_head,
        tally=tally,
        sp=sp,
        replay=replay,
    )
    return stats["old_log_probs"]
