"""The actor: a DeepSpeed (ZeRO) causal LM that computes response log-probs and takes PPO steps.

Follows verl's dp_actor: logits are divided by the rollout temperature before the softmax; the
policy loss is ``policy_loss(loss_mode, ...)`` minus ``entropy_coeff * agg(entropy)`` plus
``kl_loss_coef * agg(kl_penalty(log_probs, ref_log_probs, kl_loss_type))``; with a single
mini-batch and a single epoch the update is exactly on-policy and the ratio is taken against the
detached current log-probs (as verl does). All aggregations use the mini-batch's global token and
sequence counts (see ``training.py`` for how that survives DeepSpeed's gradient scaling).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dsrl.algorithms import (
    agg_loss,
    combined_loss,
    distillation_loss,
    kl_penalty,
    policy_loss,
    policy_loss_params,
)
from dsrl.config import lora_enabled, policy_loss_param_values
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
    compute_response_stats,
    fused_head_for,
    micro_batch_indices,
    pad_response,
    policy_stats,
)
from dsrl.engines.grad_variance import MicroBatchGradNorms
from dsrl.engines.lora import add_adapters, iter_adapter_parameters, iter_merged_parameters
from dsrl.engines.packing import packing_for
from dsrl.engines.routers import RouterRecord, route_replay_for
from dsrl.engines.sequence_parallel import group_budget, sequence_parallel_for
from dsrl.engines.training import SkipCounter, mini_batch_geometry, run_ppo_updates
from dsrl.engines.weight_sync import checkpoint_format, iter_full_parameters
from dsrl.runtime.distributed import accelerator_device


class ActorEngine:
    """The policy under DeepSpeed; ``module`` is the (ZeRO-partitioned) transformers model, a ``PeftModel``
    with LoRA adapters when ``actor_rollout_ref.model.lora_rank`` > 0 (``dsrl.engines.lora``).

    ``cfg`` is the run config (``dsrl.config``); reads ``actor_rollout_ref.{model,actor,rollout}``
    and ``trainer.seed`` (the shuffling of mini-batches). ``total_training_steps`` (the run's) is
    needed by a cosine lr schedule or a warm-up ratio.
    """

    def __init__(self, cfg: Any, *, total_training_steps: int | None = None):
        init_distributed()
        self.cfg = cfg
        self.tallies: defaultdict[str, PassTally] = defaultdict(PassTally)  # the trainer takes them each step
        model_cfg, actor = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
        self.prefix = "actor_rollout_ref.actor"
        n = cfg.actor_rollout_ref.rollout.n
        self.rows_per_mini_batch, micro, accumulation = mini_batch_geometry(
            prefix=self.prefix,
            mini_batch_size=actor.ppo_mini_batch_size,
            n=n,
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz=actor.use_dynamic_bsz,
        )
        self.ds_config = build_ds_config(
            actor.deepspeed_config,
            key=f"{self.prefix}.deepspeed_config",
            micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accumulation,
            dtype=model_cfg.dtype,
            optim=actor.optim,
            grad_clip=clip_grad(actor),
            prefix=self.prefix,
        )
        module = load_pretrained(
            self.ds_config,
            lambda: AutoModelForCausalLM.from_pretrained(
                model_cfg.path, dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code
            ),
        )
        self.packing = (
            packing_for(module, "actor_rollout_ref.model.use_remove_padding", dedup=actor.use_prefix_grouper)
            if model_cfg.use_remove_padding
            else None
        )
        self.sp = sequence_parallel_for(module, actor.ulysses_sequence_parallel_size)  # before PEFT wraps it
        if model_cfg.enable_gradient_checkpointing:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora_enabled(model_cfg)
        if self.lora:
            module = add_adapters(module, model_cfg)
        self.engine = initialize_trained(module, self.ds_config)
        self.fused_head = fused_head_for(self.module, actor.use_fused_kernels)
        self.lr_scheduler = lr_scheduler(
            self.engine.basic_optimizer, actor.optim, total_training_steps=total_training_steps, prefix=self.prefix
        )
        self.skips = SkipCounter("actor")
        # actor/grad_var: every backward's gradient norm, from hooks on the trainable parameters
        self.grad_norms = MicroBatchGradNorms(self.module) if actor.measure_grad_variance else None
        # the chosen loss's own parameters (sapo's tau_pos, ...) from their config keys
        self.loss_params = policy_loss_param_values(cfg, policy_loss_params(actor.policy_loss.loss_mode))
        # before RouterRecord: its hooks then see the experts a forward ran
        self.replay = route_replay_for(self.module, actor.router_replay.mode)
        self.routers = RouterRecord(self.module)  # a mixture of experts': its aux loss and actor/moe/* metrics
        if actor.router_aux_loss_coef > 0 and (not self.routers.routers or self.routers.loss_func is None):
            raise ValueError(
                f"{self.prefix}.router_aux_loss_coef={actor.router_aux_loss_coef}: "
                f"{cfg.actor_rollout_ref.model.path} has no routers whose load-balancing loss transformers defines "
                "(a dense model, or a mixture of experts of another layout); fix: set it to 0"
            )

    @property
    def module(self) -> torch.nn.Module:
        """The transformers model inside the engine (parameters partitioned under ZeRO-3)."""
        return self.engine.module

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the rollout engine receives: the full parameters in the model's checkpoint format
        (``checkpoint_format``); with LoRA the merged ones (``actor_rollout_ref.model.lora.merge``) so, or the
        adapters alone. Collective under ZeRO-3."""
        if not self.lora:
            return checkpoint_format(self.module, iter_full_parameters(self.module))
        if self.cfg.actor_rollout_ref.model.lora.merge:
            return checkpoint_format(self.module.get_base_model(), iter_merged_parameters(self.module))
        return iter_adapter_parameters(self.module)

    def compute_log_probs(
        self, batch: Batch, *, temperature: float, with_entropy: bool = False, with_sum_pi_squared: bool = False
    ) -> dict[str, torch.Tensor]:
        """``old_log_probs`` (+ ``entropy``, ``sum_pi_squared``) ``[B, T]`` float32 of the current policy; with
        routing replay also ``prompt_routes`` and ``response_routes``, the experts these forwards ran (R2 records them
        here; R3 replays the rollout's, and a token it did not record gets the actor's own).

        Micro-batches of ``rollout.log_prob_micro_batch_size_per_gpu`` rows, or of
        ``rollout.log_prob_max_token_len_per_gpu`` tokens with ``rollout.log_prob_use_dynamic_bsz``.
        Collective: every rank calls it.
        """
        rollout = self.cfg.actor_rollout_ref.rollout
        self.engine.eval()
        return compute_response_stats(
            self.engine,
            batch,
            temperature=temperature,
            micro_batch_size=rollout.log_prob_micro_batch_size_per_gpu,
            max_token_len=rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None,
            budget_key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared,
            share_prompts=self.cfg.actor_rollout_ref.model.shared_prompt_forward,
            packing=self.packing,
            fused_head=self.fused_head,
            sp=self.sp,
            tally=self.tallies["old_log_prob"],
            replay=self.replay,
        )

    def _split(self, mini: Batch) -> list[torch.Tensor]:
        actor = self.cfg.actor_rollout_ref.actor
        budget = group_budget(actor.ppo_max_token_len_per_gpu, self.sp)
        return micro_batch_indices(
            mini,
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            max_token_len=budget if actor.use_dynamic_bsz else None,
            key=f"{self.prefix}.ppo_max_token_len_per_gpu",
            packing=self.packing,
        )

    def on_policy(self, rows: int) -> bool:
        """Whether an update over this rank's ``rows`` rows is exactly on-policy: one mini-batch, one epoch."""
        return -(-rows // self.rows_per_mini_batch) == 1 and self.cfg.actor_rollout_ref.actor.ppo_epochs == 1

    def update(
        self, batch: Batch, *, temperature: float, recorded: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float]:
        """PPO epochs over ``batch`` (needs ``advantages``; ``old_log_probs`` unless on-policy; ``ref_log_probs``
        with ``use_kl_loss``; ``teacher_log_probs`` with ``distillation.enabled``; ``rollout_is_weights`` optional).
        Returns verl's ``actor/*`` metrics (and ``distillation/*``), averaged over optimizer steps, identical on every
        rank. Collective.

        ``recorded``: filled with ``old_log_probs`` and ``entropy`` ``[B, T]`` float32 as the first forward
        pass over each row computed them. In an on-policy update the parameters do not change before the
        only optimizer step, so they are what a separate old-log-prob pass gives (up to the rounding of
        another micro-batch split), and the trainer skips that pass. Otherwise (bypass mode, which has no
        such pass) a row's values are the policy's after the optimizer steps that came before its mini-batch.
        """
        actor = self.cfg.actor_rollout_ref.actor
        if actor.use_kl_loss and batch.ref_log_probs is None:
            raise ValueError(
                f"{self.prefix}.use_kl_loss=True but the batch has no ref_log_probs; run the reference first"
            )
        if self.cfg.distillation.enabled and batch.teacher_log_probs is None:
            raise ValueError("distillation.enabled=True but the batch has no teacher_log_probs; run the teacher first")
        on_policy = self.on_policy(len(batch))
        seen = torch.zeros(len(batch), dtype=torch.bool)  # rows already recorded
        if recorded is not None:
            recorded.update({name: torch.zeros(batch.response_ids.shape) for name in ("old_log_probs", "entropy")})
        self.engine.train()
        try:
            metrics = run_ppo_updates(
                self.engine,
                batch,
                rows_per_mini_batch=self.rows_per_mini_batch,
                epochs=actor.ppo_epochs,
                shuffle=actor.shuffle,
                seed=self.cfg.trainer.seed,
                split=self._split,
                loss_fn=lambda micro, rows, num_tokens, num_seqs: self._loss(
                    micro,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    temperature=temperature,
                    on_policy=on_policy,
                    record=None if recorded is None else (recorded, rows, seen),
                ),
                skips=self.skips,
                lr_scheduler=self.lr_scheduler,
                grad_norms=self.grad_norms,
                loss_agg_mode=actor.loss_agg_mode,
                sp=self.sp,
            )
        finally:
            if self.replay is not None:
                self.replay.release()  # the routes stay in force until the last backward's recomputes are done
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = actor.kl_loss_coef
        if recorded is not None:
            mask = batch.response_mask.float().cpu()
            recorded.update({name: (value * mask).to(batch.response_ids.device) for name, value in recorded.items()})
        return metrics

    def _loss(
        self,
        micro: Batch,
        *,
        num_tokens: float,
        num_seqs: float,
        temperature: float,
        on_policy: bool,
        record: tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        actor = self.cfg.actor_rollout_ref.actor
        dev = accelerator_device()
        micro = micro.to(dev)
        T = micro.response_ids.shape[1]
        model = self.cfg.actor_rollout_ref.model
        # verl: the update's entropy only when it is in the loss or asked for; actor/entropy comes from
        # the old-log-prob pass, or from here when this pass stands in for it (``record``). With sequence
        # parallelism every rank of the group computes the same statistics (each is summed over the group), also
        # for another member's rows (``record``'s rows None), which it does not record.
        entropy_loss_on = actor.entropy_coeff != 0 or actor.calculate_entropy
        # a sequence-parallel rank's routers see its shard of the rows only: no aux loss (validation) nor load there
        moe = bool(self.routers.routers) and self.sp is None
        with self.routers.recording() if moe else nullcontext():
            stats, _ = policy_stats(
                self.engine,
                micro,
                dev,
                temperature=temperature,
                share_prompts=model.shared_prompt_forward,
                packing=self.packing,
                fused_head=self.fused_head,
                sp=self.sp,
                tally=self.tallies["actor_update"],
                replay=self.replay,
                with_entropy=entropy_loss_on or record is not None,
                entropy_grad=entropy_loss_on,
            )
        log_probs = pad_response(stats["log_probs"], T)
        if record is not None and record[1] is not None:  # rows None: another sequence-parallel member's
            recorded, rows, seen = record
            first = ~seen[rows]
            recorded["old_log_probs"][rows[first]] = log_probs.detach().float().cpu()[first]
            recorded["entropy"][rows[first]] = pad_response(stats["entropy"].detach().float().cpu(), T)[first]
            seen[rows] = True
        mask = micro.response_mask.float()
        normalisers = {"num_tokens": num_tokens, "num_seqs": num_seqs}
        clip_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
        clip_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
        # bypass_mode's old log-probs are the rollout engine's, on-policy too: its loss corrects against them
        bypass = actor.policy_loss.loss_mode == "bypass_mode"
        pg_loss, pg_metrics = policy_loss(
            actor.policy_loss.loss_mode,
            old_log_probs=log_probs.detach() if on_policy and not bypass else micro.old_log_probs,
            log_probs=log_probs,
            advantages=micro.advantages,
            response_mask=mask,
            loss_agg_mode=actor.loss_agg_mode,
            clip_ratio_low=clip_low,
            clip_ratio_high=clip_high,
            clip_ratio_c=actor.clip_ratio_c,
            rollout_is_weights=micro.rollout_is_weights,
            **normalisers,
            **self.loss_params,
        )
        # policy_loss's metrics are means over this micro-batch's tokens: weight them by its share.
        share = mask.sum() / num_tokens
        contributions = {name: value * share for name, value in pg_metrics.items()}
        contributions["actor/pg_loss"] = pg_loss
        loss = pg_loss
        if entropy_loss_on:
            entropy_loss = agg_loss(pad_response(stats["entropy"], T), mask, actor.loss_agg_mode, **normalisers)
            loss = loss - actor.entropy_coeff * entropy_loss
            contributions["actor/entropy_loss"] = entropy_loss
        if actor.use_kl_loss:
            kl = kl_penalty(log_probs, micro.ref_log_probs, actor.kl_loss_type)
            kl_loss = agg_loss(kl, mask, actor.loss_agg_mode, **normalisers)
            loss = loss + actor.kl_loss_coef * kl_loss
            contributions["actor/kl_loss"] = kl_loss
        distill = self.cfg.distillation
        if distill.enabled:  # as verl: after the task's loss and its entropy and KL terms, which it may replace
            dl = distill.distillation_loss
            distill_loss, distill_metrics = distillation_loss(
                log_probs,
                micro.teacher_log_probs,
                mask,
                loss_mode=dl.loss_mode,
                loss_max_clamp=dl.loss_max_clamp,
                use_policy_gradient=dl.use_policy_gradient,
                old_log_probs=log_probs.detach() if on_policy and not bypass else micro.old_log_probs,
                clip_ratio_low=dl.clip_ratio if dl.clip_ratio_low is None else dl.clip_ratio_low,
                clip_ratio_high=dl.clip_ratio if dl.clip_ratio_high is None else dl.clip_ratio_high,
                loss_agg_mode=actor.loss_agg_mode,
                rollout_is_weights=micro.rollout_is_weights,
                **normalisers,
            )
            loss = combined_loss(
                loss, distill_loss, use_task_rewards=dl.use_task_rewards, coef=dl.distillation_loss_coef
            )
            # the loss is normalised over the step already; the means are this micro-batch's, weighted by its share;
            # the extremes the trainer takes over the whole step (dsrl.trainer.metrics.distillation_metrics)
            for name, value in distill_metrics.items():
                if name == "distillation/loss":
                    contributions[name] = value
                elif name not in ("distillation/loss_min", "distillation/loss_max"):
                    contributions[name] = value * share
        if moe:  # token-weighted means over the step's micro-batches, as the metrics above
            with torch.set_grad_enabled(actor.router_aux_loss_coef > 0):
                aux_loss = self.routers.aux_loss()
            loss = loss + actor.router_aux_loss_coef * aux_loss * share
            contributions["actor/moe/aux_loss"] = aux_loss * share
            contributions["actor/moe/load_imbalance"] = self.routers.imbalance() * share
        return loss, {name: torch.as_tensor(value).detach() for name, value in contributions.items()}
