"""The training loop: one SPMD loop per rank that drives every model role in-process.

Each step (DESIGN §2) is a sequence of phase calls, each timed as ``timing_s/<phase>``:
gen (with update_weights) -> reward -> old_log_prob -> ref -> values -> adv -> update_critic ->
update_actor, then validation every ``trainer.test_freq`` steps. Tensor math lives in
``dsrl.algorithms`` and the engines; this file only orders the calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dsrl.algorithms import (
    AdaptiveKLController,
    EstimatorInputs,
    FixedKLController,
    apply_kl_penalty,
    compute_advantages,
    rollout_correction,
)
from dsrl.config import Config, to_dict
from dsrl.data.batch import Batch
from dsrl.data.datasets import PromptSampler, collate_prompts, load_prompts
from dsrl.distributed import all_gather_rows, all_reduce, global_mean
from dsrl.engines import ActorEngine, CriticEngine, ReferenceEngine, init_distributed
from dsrl.metrics import batch_metrics, rollout_correction_metrics, rollout_logprob_metrics
from dsrl.rewards import RewardScorer
from dsrl.rollout import HFRollout, SamplingParams, iter_full_parameters
from dsrl.rollout.colocation import colocated_generation
from dsrl.tracking import Tracker, flatten


class PhaseTimer:
    """Wall-clock seconds per phase of one step, as ``timing_s/<phase>``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{phase}"] = self.seconds.get(f"timing_s/{phase}", 0.0) + time.perf_counter() - start


class Trainer:
    def __init__(self, cfg: Config):
        init_distributed()
        self.cfg = cfg
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.trainer.seed + self.rank)
        model_cfg, actor_cfg = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor
        algo = cfg.algorithm

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
        self.train_prompts = self._load_prompts(cfg.data.train_files)
        self.val_prompts = self._load_prompts(cfg.data.val_files) if cfg.data.val_files else None
        self.sampler = PromptSampler(self.train_prompts, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)

        needs_ref = actor_cfg.use_kl_loss or algo.use_kl_in_reward
        if cfg.actor_rollout_ref.rollout.name == "vllm":
            from dsrl.rollout.vllm import VLLMRollout  # needs the vllm package

            # Before the DeepSpeed engines take device memory; with sleep mode it sleeps right away.
            self.rollout = VLLMRollout.from_config(cfg)
        self.actor = ActorEngine(cfg)
        self.ref = ReferenceEngine(cfg) if needs_ref else None
        self.critic = CriticEngine(cfg) if algo.adv_estimator == "gae" else None
        if cfg.actor_rollout_ref.rollout.name == "hf":
            self.rollout = HFRollout(model_cfg.path, dtype=model_cfg.dtype, trust_remote_code=model_cfg.trust_remote_code)
        self.scorer = RewardScorer(cfg.custom_reward_function.path, cfg.custom_reward_function.name)

        if algo.kl_ctrl.type == "adaptive":
            self.kl_ctrl = AdaptiveKLController(algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon)
        else:
            self.kl_ctrl = FixedKLController(algo.kl_ctrl.kl_coef)

        self.total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * self.sampler.batches_per_epoch
        self.tracker = Tracker(
            cfg.trainer.logger,
            project_name=cfg.trainer.project_name,
            experiment_name=cfg.trainer.experiment_name,
            total_steps=self.total_steps,
            rank=self.rank,
        )
        self.tracker.log_params(flatten(to_dict(cfg)))
        self.global_step = 0

    # ---- phases -------------------------------------------------------------------------------

    def _load_prompts(self, files):
        data = self.cfg.data
        records, _ = load_prompts(
            files,
            self.tokenizer,
            prompt_key=data.prompt_key,
            max_prompt_length=data.max_prompt_length,
            filter_overlong_prompts=data.filter_overlong_prompts,
            truncation=data.truncation,
        )
        return records

    def _prompt_batch(self, records, first_group_id: int) -> Batch:
        """Left-padded prompts of this rank; group ids are global row numbers, unique across ranks."""
        fields = collate_prompts(records, self.tokenizer.pad_token_id)
        group_ids = torch.arange(first_group_id, first_group_id + len(records))
        empty = torch.empty(len(records), 0, dtype=torch.long)
        return Batch(**fields, response_ids=empty, response_mask=empty, group_ids=group_ids)

    def _sampling(self, *, validation: bool) -> SamplingParams:
        rollout = self.cfg.actor_rollout_ref.rollout
        source = rollout.val_kwargs if validation else rollout
        return SamplingParams(
            n=source.n,
            temperature=source.temperature,
            top_p=source.top_p,
            top_k=source.top_k,
            max_tokens=self.cfg.data.max_response_length,
            do_sample=source.do_sample if validation else True,
            seed=self.cfg.trainer.seed + 7919 * self.global_step + self.rank,
        )

    def colocated(self, metrics: dict[str, float]):
        """The rollout engine awake with the actor's current weights, the DeepSpeed engines' device
        memory released around it (``dsrl.rollout.colocation``; a collective on every rank)."""
        engines = [role.engine for role in (self.actor, self.critic, self.ref) if role is not None]
        return colocated_generation(
            self.rollout,
            weights=lambda: iter_full_parameters(self.actor.module),
            trainer_engines=engines,
            metrics=metrics,
        )

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt; rows of one prompt are contiguous."""
        out = self.rollout.generate(prompts.prompt_ids, prompts.prompt_mask, sampling)
        repeat = torch.arange(len(prompts)).repeat_interleave(sampling.n)
        return prompts.select(repeat).replace(
            response_ids=out.response_ids,
            response_mask=out.response_mask,
            rollout_log_probs=out.log_probs,
        )

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-level scores [B, T]: each response's score at its last response token."""
        responses = self.tokenizer.batch_decode(
            [ids[mask.bool()] for ids, mask in zip(batch.response_ids, batch.response_mask)], skip_special_tokens=True
        )
        scores, _, counts = self.scorer.score_batch(batch.data_sources, responses, batch.ground_truths, batch.extra_infos)
        totals = all_reduce(torch.tensor([float(v) for v in counts.values()])).tolist()
        token_level_scores = torch.zeros_like(batch.response_mask, dtype=torch.float32)
        last = batch.response_mask.sum(-1).long() - 1
        token_level_scores[torch.arange(len(batch)), last] = torch.tensor(scores, dtype=torch.float32)
        return token_level_scores, dict(zip(counts, totals))

    def rewards_with_kl(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """In-reward KL: ``token_level_rewards = scores - beta * KL(old || ref)``, then the controller update."""
        beta = self.kl_ctrl.value
        rewards, current_kl = apply_kl_penalty(
            batch.token_level_scores,
            batch.old_log_probs,
            batch.ref_log_probs,
            batch.response_mask,
            kind=self.cfg.algorithm.kl_penalty,
            kl_coef=beta,
        )
        current_kl = global_mean(current_kl)
        self.kl_ctrl.update(current_kl, n_steps=self.cfg.data.train_batch_size)
        return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def advantages(self, batch: Batch, reward_baselines: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator over the whole global batch, so batch-wide whitening sees every rank's rows."""
        algo = self.cfg.algorithm
        fields = {
            "token_level_rewards": batch.token_level_rewards,
            "response_mask": batch.response_mask,
            "values": batch.values,
            "old_log_probs": batch.old_log_probs,
            "sum_pi_squared": batch.sum_pi_squared,
            "rollout_is_weights": batch.rollout_is_weights,
        }
        gathered = {name: all_gather_rows(value)[0] for name, value in fields.items()}
        group_ids, rows = all_gather_rows(batch.group_ids[:, None])
        baselines = all_gather_rows(None if reward_baselines is None else reward_baselines[:, None])[0]
        inputs = EstimatorInputs(
            **gathered, group_ids=group_ids[:, 0], reward_baselines=None if baselines is None else baselines[:, 0]
        )
        advantages, returns = compute_advantages(
            algo.adv_estimator, inputs, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std_in_grpo
        )
        T = batch.response_mask.shape[1]
        return advantages[rows, :T], returns[rows, :T]

    def rollout_correction(self, batch: Batch):
        """Importance ratios rollout -> actor on this batch (``algorithm.rollout_correction``)."""
        corr = self.cfg.algorithm.rollout_correction
        return rollout_correction(
            batch.old_log_probs,
            batch.rollout_log_probs,
            batch.response_mask,
            rollout_is=corr.rollout_is,
            rollout_is_threshold=corr.rollout_is_threshold,
            rollout_rs=corr.rollout_rs,
            rollout_rs_threshold=corr.rollout_rs_threshold,
            rollout_rs_threshold_lower=corr.rollout_rs_threshold_lower,
        )

    def validate(self) -> dict[str, float]:
        """Mean reward per data source on the validation files (``val/<data_source>/reward/mean``)."""
        shard = self.val_prompts[self.rank :: self.world_size]
        sampling = self._sampling(validation=True)
        chunk = self.cfg.data.val_batch_size or max(len(shard), 1)
        sums: dict[str, list[float]] = {}
        batches = []
        with self.colocated({}):
            for start in range(0, len(shard), chunk):
                batches.append(self.generate(self._prompt_batch(shard[start : start + chunk], first_group_id=start), sampling))
        for batch in batches:
            scores, _ = self.score(batch)
            for source, score in zip(batch.data_sources, scores.sum(-1).tolist()):
                total = sums.setdefault(source, [0.0, 0.0])
                total[0] += score
                total[1] += 1
        gathered: list[dict[str, list[float]]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, sums)
        merged: dict[str, list[float]] = {}
        for part in gathered:
            for source, (total, count) in part.items():
                merged.setdefault(source, [0.0, 0.0])
                merged[source][0] += total
                merged[source][1] += count
        metrics = {f"val/{source}/reward/mean": total / count for source, (total, count) in sorted(merged.items())}
        total, count = (sum(v[i] for v in merged.values()) for i in (0, 1))
        metrics["val/accuracy"] = total / max(count, 1)
        return metrics

    # ---- the step ----------------------------------------------------------------------------

    def step(self, prompts: Batch) -> dict[str, float]:
        cfg, algo = self.cfg, self.cfg.algorithm
        actor_cfg, rollout_cfg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        timer = PhaseTimer()
        metrics: dict[str, float] = {}
        with timer("step"):
            # timing_s/update_weights, /wake, /gen, /sleep (and sleep-mode memory on GPUs)
            with self.colocated(metrics):
                batch = self.generate(prompts, self._sampling(validation=False))
                reward_baselines = None
                if algo.adv_estimator == "remax":
                    greedy = self.generate(prompts, self._sampling(validation=True).replace(n=1, do_sample=False))
            with timer("reward"):
                scores, counts = self.score(batch)
                batch = batch.replace(token_level_scores=scores)
                metrics.update(counts)
                if algo.adv_estimator == "remax":
                    greedy_scores, _ = self.score(greedy)
                    reward_baselines = greedy_scores.sum(-1).repeat_interleave(rollout_cfg.n)
            with timer("old_log_prob"):
                batch = batch.replace(
                    **self.actor.compute_log_probs(
                        batch,
                        temperature=rollout_cfg.temperature,
                        with_entropy=True,
                        with_sum_pi_squared=actor_cfg.calculate_sum_pi_squared,
                    )
                )
                metrics.update(rollout_logprob_metrics(batch))
            if self.ref is not None:
                with timer("ref"):
                    batch = batch.replace(
                        ref_log_probs=self.ref.compute_log_probs(batch, temperature=rollout_cfg.temperature)
                    )
            if self.critic is not None:
                with timer("values"):
                    batch = batch.replace(values=self.critic.compute_values(batch))
            with timer("adv"):
                correction = self.rollout_correction(batch)
                metrics.update(rollout_correction_metrics(batch, correction))
                if algo.rollout_correction.rollout_is or algo.rollout_correction.rollout_rs:
                    batch = batch.replace(rollout_is_weights=correction.weights)
                if algo.use_kl_in_reward:
                    rewards, kl_metrics = self.rewards_with_kl(batch)
                    metrics.update(kl_metrics)
                else:
                    rewards = batch.token_level_scores
                batch = batch.replace(token_level_rewards=rewards)
                advantages, returns = self.advantages(batch, reward_baselines)
                batch = batch.replace(advantages=advantages, returns=returns)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics.update(self.critic.update(batch))
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    metrics.update(self.actor.update(batch, temperature=rollout_cfg.temperature))
        metrics.update(batch_metrics(batch, cfg.data.max_response_length))
        metrics.update(timer.seconds)
        tokens = batch.attention_mask.sum().item()
        metrics["perf/throughput"] = tokens / timer.seconds["timing_s/step"]
        return metrics

    def fit(self) -> dict[str, float]:
        """Train for ``total_steps`` steps; returns the validation metrics before and after."""
        cfg = self.cfg
        results: dict[str, float] = {}
        if self.val_prompts is not None and cfg.trainer.val_before_train:
            val = self.validate()
            results["before/val/accuracy"] = val["val/accuracy"]
            self.tracker.log_metrics(val, step=0)
        per_rank = cfg.data.train_batch_size // self.world_size
        val = {}
        for self.global_step in range(self.global_step, self.total_steps):
            records = self.sampler.next_batch()[self.rank * per_rank : (self.rank + 1) * per_rank]
            metrics = self.step(self._prompt_batch(records, first_group_id=self.rank * per_rank))
            step = self.global_step + 1
            last = step == self.total_steps
            if self.val_prompts is not None and cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last):
                val = self.validate()
                metrics.update(val)
            self.tracker.log_metrics(metrics, step=step)
        self.global_step = self.total_steps
        if val:
            results["after/val/accuracy"] = val["val/accuracy"]
        self.tracker.finish()
        return results


def train(cfg: Config) -> dict[str, float]:
    """Build every role and run the loop; prints validation accuracy before and after on rank 0."""
    trainer = Trainer(cfg)
    results = trainer.fit()
    if trainer.rank == 0 and results:
        before = results.get("before/val/accuracy", math.nan)
        after = results.get("after/val/accuracy", math.nan)
        print(f"[dsrl] validation accuracy: before {before:.3f}  after {after:.3f}", flush=True)
    return results
