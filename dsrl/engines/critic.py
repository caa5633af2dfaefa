"""The critic: the policy's backbone plus a scalar value head, trained with verl's clipped value loss.

``values[b, t]`` is the head's output at the position preceding response token ``t`` (the
alignment of the log-probs), masked to 0 on response padding. The head is ``nn.Linear(hidden, 1)``
initialised like transformers' token-classification heads (``N(0, initializer_range)``, zero bias)
from ``trainer.seed``, so every rank builds the same one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from transformers import AutoModel

from dsrl.algorithms import masked_mean, value_loss
from dsrl.config.deepspeed_json import clip_grad
from dsrl.data.batch import Batch
from dsrl.engines.deepspeed_setup import (
    DTYPES,
    build_ds_config,
    init_distributed,
    initialize_trained,
    load_pretrained,
    lr_scheduler,
)
from dsrl.engines.forward import (
    PassTally,
    micro_batch_indices,
    model_inputs,
    pad_response,
    sequence_parallel_shard,
)
from dsrl.engines.packing import PackedInputs, pack, packing_for
from dsrl.engines.sequence_parallel import group_budget, sequence_parallel_for
from dsrl.engines.training import SkipCounter, mini_batch_geometry, run_ppo_updates
from dsrl.runtime.distributed import accelerator_device


class ValueModel(nn.Module):
    """A transformers base model (no LM head) followed by a scalar head."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head

    def forward(
        self,
        *,
        input_ids,
        attention_mask,
        position_ids,
        response_width: int = 0,
        packed: PackedInputs | None = None,
        at: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[b, P + T'] inputs -> float32 values [b, T'] at positions ``-T'-1 .. -2``; ``packed``: the inputs are its
        packed rows (no attention mask), and the values are gathered back to ``[b, T']``. ``at`` (a sequence-parallel
        shard's (row, column) positions): the values there ``[n]``, and a zero on all the hidden states."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        if at is not None:
            return self.value_head(hidden[at]).squeeze(-1).float(), hidden.sum() * 0
        response = hidden[:, -response_width - 1 : -1] if packed is None else packed.gather(hidden)
        return self.value_head(response).squeeze(-1).float()


class CriticEngine:
    """``compute_values(batch) -> values [B, T]`` and ``update(batch) -> critic/* metrics``.

    Reads ``critic.*`` (model path, DeepSpeed config, optimiser, batch geometry, loss),
    ``actor_rollout_ref.rollout.n`` (responses per prompt in a mini-batch),
    ``actor_rollout_ref.model.dtype`` and ``trainer.seed``; ``total_training_steps`` as for the actor.
    """

    def __init__(self, cfg: Any, *, total_training_steps: int | None = None):
        init_distributed()
        self.cfg = cfg
        self.tallies: defaultdict[str, PassTally] = defaultdict(PassTally)  # the trainer takes them each step
        critic, dtype = cfg.critic, cfg.actor_rollout_ref.model.dtype
        if critic.model.path is None:
            raise ValueError(
                "critic.model.path=None: the critic needs a model; set it (usually to actor_rollout_ref.model.path)"
            )
        self.rows_per_mini_batch, micro, accumulation = mini_batch_geometry(
            prefix="critic",
            mini_batch_size=critic.ppo_mini_batch_size,
            n=cfg.actor_rollout_ref.rollout.n,
            micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=critic.use_dynamic_bsz,
        )
        self.ds_config = build_ds_config(
            critic.deepspeed_config,
            key="critic.deepspeed_config",
            micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accumulation,
            dtype=dtype,
            optim=critic.optim,
            grad_clip=clip_grad(critic),
            prefix="critic",
        )
        backbone = load_pretrained(
            self.ds_config,
            lambda: AutoModel.from_pretrained(
                critic.model.path, dtype=DTYPES[dtype], trust_remote_code=critic.model.trust_remote_code
            ),
        )
        self.packing = (
            packing_for(backbone, "critic.model.use_remove_padding") if critic.model.use_remove_padding else None
        )
        self.sp = sequence_parallel_for(backbone, critic.ulysses_sequence_parallel_size)
        if critic.model.enable_gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Built outside zero.Init: deepspeed.initialize partitions it with the rest of the model.
        head = nn.Linear(backbone.config.hidden_size, 1)
        generator = torch.Generator().manual_seed(cfg.trainer.seed)
        with torch.no_grad():
            head.weight.normal_(0.0, getattr(backbone.config, "initializer_range", 0.02), generator=generator)
            head.bias.zero_()
        module = ValueModel(backbone, head.to(DTYPES[dtype]))
        self.engine = initialize_trained(module, self.ds_config)
        self.lr_scheduler = lr_scheduler(
            self.engine.basic_optimizer, critic.optim, total_training_steps=total_training_steps, prefix="critic"
        )
        self.skips = SkipCounter("critic")

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def _split(self, batch: Batch, prefix: str = "ppo_") -> list[torch.Tensor]:
        """Micro-batches of the update (``ppo_*`` keys) or of the no-grad pass (``forward_*``)."""
        critic = self.cfg.critic
        budget = group_budget(critic[f"{prefix}max_token_len_per_gpu"], self.sp)
        return micro_batch_indices(
            batch,
            micro_batch_size=critic[f"{prefix}micro_batch_size_per_gpu"],
            max_token_len=budget if critic.use_dynamic_bsz else None,
            key=f"critic.{prefix}max_token_len_per_gpu",
            packing=self.packing,
        )

    def _values(self, micro: Batch, tally: PassTally) -> torch.Tensor:
        """[b, T] float32 values of ``micro`` (on the device), zero-padded past its trimmed width; one packed
        forward with ``critic.model.use_remove_padding``, on this rank's shard of it with sequence parallelism
        (``dsrl.engines.forward.SequenceShard``). What the forward ran is added to ``tally``."""
        device = accelerator_device()
        if self.sp is not None:
            assert self.packing is not None, "sequence parallelism runs packed rows (validation requires them)"
            shard = sequence_parallel_shard(micro, self.sp, self.packing, tally)
            at = tuple(index.to(device) for index in shard.positions())
            values, anchor = self.engine(**{"attention_mask": None, **shard.inputs(device)}, at=at)
            values = shard.spread(self.sp, values, anchor)
        elif self.packing is not None:
            packed = pack(micro, pair_cost=self.packing.pair_cost)
            tally.add(packed.input_ids.numel(), packed.tokens)
            values = self.engine(
                input_ids=packed.input_ids.to(device),
                attention_mask=None,
                position_ids=packed.position_ids.to(device),
                response_width=packed.width,
                packed=packed,
            )
        else:
            inputs, width = model_inputs(micro, device)
            tally.add(inputs["input_ids"].numel(), int(inputs["attention_mask"].sum()))
            values = self.engine(**inputs, response_width=width)
        return pad_response(values, micro.response_ids.shape[1])

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """``values`` ``[B, T]`` float32, 0 on padding; micro-batches of ``critic.forward_*``. Collective."""
        self.engine.eval()

        def run(rows: Batch) -> torch.Tensor:
            out = torch.zeros(rows.response_ids.shape, dtype=torch.float32)
            with torch.no_grad():
                for idx in self._split(rows, "forward_"):
                    out[idx] = self._values(rows.select(idx), self.tallies["critic_values"]).cpu()
            return out

        out = run(batch) if self.sp is None else self.sp.each_member(batch, run)
        return (out * batch.response_mask.float().cpu()).to(batch.response_ids.device)

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO epochs of the clipped value loss on ``batch`` (needs ``values``, ``returns``).
        Returns ``critic/vf_loss, vf_clipfrac, vpred_mean, grad_norm, lr``, equal on all ranks."""
        critic = self.cfg.critic
        self.engine.train()
        return run_ppo_updates(
            self.engine,
            batch,
            rows_per_mini_batch=self.rows_per_mini_batch,
            epochs=critic.ppo_epochs,
            shuffle=critic.shuffle,
            seed=self.cfg.trainer.seed,
            split=self._split,
            loss_fn=lambda micro, rows, num_tokens, num_seqs: self._loss(micro, num_tokens, num_seqs),
            skips=self.skips,
            lr_scheduler=self.lr_scheduler,
            sp=self.sp,
        )

    def _loss(self, micro: Batch, num_tokens: float, num_seqs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        critic = self.cfg.critic
        micro = micro.to(accelerator_device())
        mask = micro.response_mask.float()
        vpreds = self._values(micro, self.tallies["critic_update"])
        loss, clipfrac = value_loss(
            vpreds,
            micro.values,
            micro.returns,
            mask,
            cliprange_value=critic.cliprange_value,
            loss_agg_mode=critic.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        # clipfrac and vpred_mean are means over this micro-batch's tokens: weight by its share.
        share = mask.sum() / num_tokens
        contributions = {
            "critic/vf_loss": loss,
            "critic/vf_clipfrac": clipfrac * share,
            "critic/vpred_mean": masked_mean(vpreds, mask) * share,
        }
        return loss, {name: torch.as_tensor(value).detach() for name, value in contributions.items()}
