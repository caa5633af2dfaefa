"""The training loop: one SPMD loop per rank that drives every model role in-process (start-up: ``dsrl.trainer.setup``).

Each step is one timed call per phase (``timing_s/<phase>``): gen (with update_weights) -> balance -> reward ->
old_log_prob -> ref -> teacher -> values -> adv (PF-PPO's redraw, the truncated responses masked out of the actor's
loss) -> update_critic -> update_actor. DAPO's dynamic sampling scores in gen (``dsrl.trainer.dynamic_sampling``); an
exactly on-policy step, and bypass mode, fold old_log_prob into update_actor (``Trainer.folds_old_log_prob``). After a
step:
the run-stopping checks (``dsrl.trainer.stops``), validation every ``trainer.test_freq`` steps, a checkpoint every
``trainer.save_freq`` (``dsrl.checkpoint.save``) or after a signal (``dsrl.runtime.signals``: every rank finishes the
step first). Tensor math lives in ``dsrl.algorithms`` and the engines; this file only orders the calls.
"""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsrl.algorithms import (
    EstimatorInputs,
    RolloutCorrection,
    agg_loss,
    apply_kl_penalty,
    compute_advantages,
    estimator_needs,
    estimator_options,
    reads_policy,
    rollout_correction,
    truncated_responses,
)
from dsrl.checkpoint.resume import trainer_state
from dsrl.checkpoint.save import (
    HF_DIR,
    adapter_dir,
    export_hf_model,
    save_checkpoint,
    state_config,
    step_dir,
)
from dsrl.config import LOGGED_SAMPLES, Config
from dsrl.data.batch import Batch
from dsrl.engines import init_distributed
from dsrl.engines.forward import PassTally
from dsrl.engines.training import global_counts
from dsrl.rewards import numeric_extras
from dsrl.rollout import SamplingParams
from dsrl.rollout.colocation import colocated_generation
from dsrl.runtime.distributed import all_gather_rows, all_reduce, global_mean
from dsrl.runtime.phases import PhaseTimer, in_phase
from dsrl.runtime.seeding import seed_all
from dsrl.runtime.signals import Interrupted, RunSignals, TrainingInterrupted
from dsrl.runtime.stalls import startup_watchdog
from dsrl.tracking.console import final_summary, logger, setup_logging, startup_summary
from dsrl.trainer.balance import balance_across_ranks, pf_ppo_resample
from dsrl.trainer.batches import prompt_batch, with_responses
from dsrl.trainer.dynamic_sampling import fill_batch, group_verdicts, judged_metrics, metric_values
from dsrl.trainer.facts import final_facts, startup_facts
from dsrl.trainer.metrics import (
    batch_metrics,
    distillation_metrics,
    forward_metrics,
    memory_metrics,
    multi_turn_metrics,
    reward_metrics,
    rollout_correction_metrics,
    rollout_logprob_metrics,
    throughput_metrics,
    variance_proxy_metrics,
)
from dsrl.trainer.partial_rollout import OFF_POLICY
from dsrl.trainer.preflight import Cluster
from dsrl.trainer.scoring import Scores
from dsrl.trainer.setup import TrainerSetup
from dsrl.trainer.stops import TrainingStopped
from dsrl.trainer.validation import (
    gather_rows,
    generation_row,
    row_metrics,
    score_chunks,
    shard_chunks,
    validation_score,
)

ROUND_SEED_STRIDE = 1_000_003  # seeds of a step's successive generation rounds (dynamic sampling, partial rollout)


class Trainer(TrainerSetup):
    def __init__(self, cfg: Config, cluster: Cluster | None = None):
        """Every role built and the checkpoint to resume restored (``dsrl.trainer.setup``). Before any model loads:
        the run folder is taken, the checkpoint checked, and the user's modules, tokenizer, prompts and reward
        function loaded; a problem with any of them on any rank is reported by rank 0 for all. ``cluster``: the
        ranks' hosts, from the preflight of a launched run (``dsrl.trainer.preflight``)."""
        init_distributed(cfg.actor_rollout_ref.nccl_timeout)
        self.cfg, self.cluster = cfg, cluster
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        setup_logging(self.rank)
        seed_all(cfg.trainer.seed + self.rank)  # python, numpy, torch and the accelerator
        self.checkpoint_root = Path(cfg.trainer.default_local_dir)
        self.scorer = self.tracker = self.tools = None
        self.model_dir = None  # the exported model, once fit has run
        with startup_watchdog():  # a minute without progress (an op build, its lock left behind): every rank says so
            self._take_run_folder()
            try:
                resume_state = self._choose_checkpoint()
                self._load_user_files()
                self._check_train_data(resume_state)
                self._setup_engines()
                self._setup_stops()
                self._setup_kl_controller()
                self._restore(resume_state)
                self._setup_tracking(resume_state)
                if self.rank == 0:
                    logger.info(startup_summary(startup_facts(self)))
            except BaseException as err:
                self.close("KILLED" if isinstance(err, Interrupted) else "FAILED")
                raise

    # ---- checkpoints --------------------------------------------------------------------------

    def _trained_roles(self) -> dict:
        """The engines a checkpoint holds, by the name of their folder in it."""
        return {name: role for name, role in (("actor", self.actor), ("critic", self.critic)) if role is not None}

    def save(self) -> Path:
        """``default_local_dir/global_step_<global_step>``, complete or not at all. Collective."""
        trainer = self.cfg.trainer
        roles = self._trained_roles()
        config = state_config(self.cfg, self.world_size)
        contents = list(self.cfg.actor_rollout_ref.actor.checkpoint.save_contents)
        state = trainer_state(
            sampler=self.sampler,
            kl_coef=self.kl_ctrl.value,
            roles=roles,
            mlflow_run_id=self.tracker.run_id,
            save_contents=contents,
            config=config,
            train_data=self.train_data,
        )
        keep = {"actor": trainer.max_actor_ckpt_to_keep, "critic": trainer.max_critic_ckpt_to_keep}
        return save_checkpoint(
            self.checkpoint_root,
            self.global_step,
            engines={name: role.engine for name, role in roles.items()},
            state=state,
            export_hf="hf_model" in contents,
            actor_module=self.actor.module,
            tokenizer=self.tokenizer,
            keep={name: keep[name] for name in roles},
            in_flight=None if self.in_flight is None else self.in_flight.state_dict(),
        )

    def export_final_model(self) -> Path:
        """The actor as a Hugging Face model (a LoRA actor's merged, its adapter in ``lora_adapter/`` inside): the
        last checkpoint's copy when it has one, else ``default_local_dir/huggingface``. Collective."""
        in_checkpoint = step_dir(self.checkpoint_root, self.global_step) / "actor" / HF_DIR
        if in_checkpoint.is_dir():
            return in_checkpoint
        return export_hf_model(self.actor.module, self.tokenizer, self.checkpoint_root / HF_DIR)

    # ---- phases -------------------------------------------------------------------------------

    def _first_group_id(self) -> int:
        return self.rank * (self.sampler.batch_size // self.world_size)

    def _next_records(self) -> list:
        """This rank's share of the sampler's next global batch, a generation round's prompts (the sampler advances
        on every rank)."""
        per_rank = self.sampler.batch_size // self.world_size
        return self.sampler.next_batch()[self.rank * per_rank : (self.rank + 1) * per_rank]

    def _prompt_batch(self, records, first_group_id: int) -> Batch:
        """Left-padded prompts of this rank; group ids are global row numbers, unique across ranks."""
        return prompt_batch(records, self.tokenizer.pad_token_id, first_group_id)

    def _sampling(self, *, validation: bool) -> SamplingParams:
        seed = self.cfg.trainer.seed + 7919 * self.global_step + self.rank
        return SamplingParams.from_config(self.cfg, seed, validation=validation)

    def colocated(self, metrics: dict[str, float]):
        """The rollout engine awake with the actor's current weights, the DeepSpeed engines' device
        memory released around it (``dsrl.rollout.colocation``; a collective on every rank)."""
        roles = {
            "actor": self.actor,
            "critic": self.critic,
            "ref": self.ref,
            "teacher": self.teacher,
            "reward_model": self.reward_model,
        }
        return colocated_generation(
            self.rollout,
            weights=self.actor.rollout_weights,
            trainer_engines={name: role.engine for name, role in roles.items() if hasattr(role, "engine")},
            metrics=metrics,
            offload_on_cpu=self.cfg.actor_rollout_ref.rollout.offload_states_on_cpu,
        )

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt; rows of one prompt are contiguous. With multi-turn, each
        row's ``extra_info`` gains its ``num_turns`` and ``num_tool_calls`` for the reward functions."""
        if self.tools is None:
            out = self.rollout.generate(prompts.prompt_ids, prompts.prompt_mask, sampling)
        else:
            tools_kwargs = [info.get("tools_kwargs") or {} for info in prompts.extra_infos] or [{}] * len(prompts)
            out = self.rollout.generate(prompts.prompt_ids, prompts.prompt_mask, sampling, tools_kwargs=tools_kwargs)
        return with_responses(prompts, out, sampling.n)

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """Token-level scores [B, T] (each response's score at its last response token), gdpo's reward
        components [B, K] (``algorithm.gdpo_reward_keys``; else None) and the reward metrics over all ranks
        (a collective): the failure counts, and ``reward/<name>/mean`` for each numeric extra a reward
        function returned (over the rows that returned it). A row without a component stops the run on
        every rank."""
        scores, components = self._score_with_components(batch)
        return scores.token_level, components, reward_metrics(scores.counts, numeric_extras(scores.extras))

    def _score_with_components(self, batch: Batch) -> tuple[Scores, torch.Tensor | None]:
        """``score`` without the metrics (a collective with gdpo only)."""
        scores = self.scoring.score(batch)
        components, problems = self.scoring.gdpo_components(batch, scores)
        if problems:
            raise TrainingStopped(f"step {self.global_step + 1}: " + "; ".join(problems))
        return scores, components

    def partial_rollout(self) -> tuple[Batch, dict[str, float]]:
        """``trainer.v1.trainer_mode=colocate_async`` (``dsrl.trainer.partial_rollout``): the pool topped up, its
        responses continued until ``data.train_batch_size`` groups are complete over all ranks, this rank's share of
        the oldest of them, and the off-policy metrics. Multi-turn conversations go on across steps, their tool
        calls run between chunks (``MultiTurnRollout.generate_until``). With dynamic sampling each complete group is
        judged as ``dsrl.trainer.dynamic_sampling`` judges a round's (scored, kept when its metric varies), the
        uninformative leave the pool, and generation goes on, the pool refilled when nothing is left to generate, for
        at most ``algorithm.filter_groups.max_num_gen_batches`` fillings. Collective; inside the colocated
        generation."""
        cfg, version, pool = self.cfg, self.global_step, self.in_flight
        fg, draw = cfg.algorithm.filter_groups, self.sampler.next_indices
        max_tokens = cfg.data.max_response_length
        pads = {"prompt_pad": self.tokenizer.pad_token_id, "response_pad": self.rollout.pad_token_id}

        def build(groups) -> Batch:
            return pool.batch_of(groups, self.sampler.take, max_tokens=max_tokens, **pads)

        def verdicts_of(groups) -> list[str]:
            batch = build(groups)
            scores, _ = self._score_with_components(batch)
            values, problem = metric_values(fg.metric, scores.token_level.sum(-1), scores.extras)
            if problem:
                raise TrainingStopped(f"step {version + 1}: {problem}")
            return group_verdicts(batch.group_ids.tolist(), values)

        metrics = pool.refill(version, draw)
        sampling, verdicts, fillings, chunks = self._sampling(validation=False), [], 1, 0
        for attempt in itertools.count():
            chunks += pool.generate(
                self.rollout,
                lambda rows: [record.prompt_ids for record in self.sampler.take(rows)],
                sampling.replace(seed=sampling.seed + ROUND_SEED_STRIDE * attempt),
                version=version,
                chunk_tokens=cfg.trainer.v1.colocate_async.chunk_tokens or max(1, max_tokens // 8),
                conversation_of=self.conversation_of if self.tools is not None else None,
            )
            if not fg.enable:
                break
            informative, going, judged = pool.judge(verdicts_of)
            verdicts += judged
            if informative >= cfg.data.train_batch_size:
                break
            if not going:  # every group judged: fill the pool again
                if 0 < fg.max_num_gen_batches <= fillings:
                    raise TrainingStopped(
                        f"step {version + 1}: algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}: "
                        f"{fillings} fillings of the pool gave {informative} groups whose metric varies, fewer than "
                        f"data.train_batch_size={cfg.data.train_batch_size}. Fix: raise max_num_gen_batches (0 = no "
                        "limit), trainer.v1.colocate_async.num_warmup_batches or actor_rollout_ref.rollout.n, or "
                        "change the data"
                    )
                fillings += 1
                admitted = pool.refill(version, draw)[f"{OFF_POLICY}/groups_admitted"]
                metrics[f"{OFF_POLICY}/groups_admitted"] += admitted
        batch, version_metrics = pool.take_batch(build, version)
        metrics.update(version_metrics)
        metrics[f"{OFF_POLICY}/chunks"] = chunks
        if fg.enable:
            metrics.update(judged_metrics(verdicts, fillings))
        return batch, metrics

    def dynamic_sampling(self, prompts: Batch, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]:
        """DAPO's dynamic sampling (``algorithm.filter_groups``, ``dsrl.trainer.dynamic_sampling``): rounds of
        ``data.gen_batch_size`` prompts generated and scored until ``data.train_batch_size`` groups whose metric
        varies are found; this rank's share of them, scored, and the metrics (the reward's over every scored row,
        and ``timing_s/gen_round_max``, this rank's longest round of generation). Collective; inside the colocated
        generation."""
        cfg, fg = self.cfg, self.cfg.algorithm.filter_groups
        reward_extras: dict[str, list] = {}
        reward_counts: dict[str, float] = {}
        round_seconds: list[float] = []

        def scored_round(round_prompts: Batch, k: int) -> tuple[Batch, list[float], str | None]:
            sampling = self._sampling(validation=False)
            start = time.perf_counter()
            batch = self.generate(round_prompts, sampling.replace(seed=sampling.seed + ROUND_SEED_STRIDE * k))
            round_seconds.append(time.perf_counter() - start)
            with timer("reward"):
                scores, components = self._score_with_components(batch)
            for name, values in scores.extras.items():
                reward_extras.setdefault(name, []).extend(values)
            for name, count in scores.counts.items():
                reward_counts[name] = reward_counts.get(name, 0) + count
            values, problem = metric_values(fg.metric, scores.token_level.sum(-1), scores.extras)
            return batch.replace(token_level_scores=scores.token_level, reward_components=components), values, problem

        def next_prompts(k: int) -> Batch:
            return self._prompt_batch(
                self._next_records(), first_group_id=k * self.sampler.batch_size + self._first_group_id()
            )

        try:
            batch, metrics = fill_batch(
                prompts,
                scored_round=scored_round,
                next_prompts=next_prompts,
                n_groups=cfg.data.train_batch_size,
                max_rounds=fg.max_num_gen_batches,
                log=logger.info if self.rank == 0 else lambda line: None,
            )
        except ValueError as err:
            raise TrainingStopped(f"step {self.global_step + 1}: {err}") from None
        metrics.update(reward_metrics(reward_counts, numeric_extras(reward_extras)))
        metrics["timing_s/gen_round_max"] = max(round_seconds)
        return batch, metrics

    def without_truncated(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """actor.mask_truncated_completions: ``batch`` with the response mask of every response cut at
        data.max_response_length zeroed, so they leave the actor's loss and its normalisers, and
        ``training/truncated_masked_ratio``, their share of the step's rows over all ranks (a collective)."""
        cut = truncated_responses(
            batch.response_ids,
            batch.response_attention,
            max_response_length=self.cfg.data.max_response_length,
            eos_token_ids=self.rollout.eos_token_ids,
        )  # [B]
        masked, rows = all_reduce(torch.tensor([cut.sum().item(), len(cut)], dtype=torch.float64)).tolist()
        ratio = {"training/truncated_masked_ratio": masked / rows}
        return batch.replace(response_mask=batch.response_mask * ~cut.unsqueeze(-1)), ratio

    def take_tallies(self) -> dict[str, PassTally]:
        """What each engine's forwards ran since the last call, by pass (``forward_metrics``)."""
        tallies: dict[str, PassTally] = {}
        for engine in (self.actor, self.ref, self.critic, self.teacher, self.reward_model):
            if engine is not None:
                tallies.update(engine.tallies)
                engine.tallies.clear()
        return tallies

    def log_samples(self, batch: Batch) -> None:
        """The first ``LOGGED_SAMPLES`` rollouts of rank 0's rows as an MLflow table (rank 0 only)."""
        if self.rank != 0:
            return
        sample = batch.select(torch.arange(min(LOGGED_SAMPLES, len(batch))))
        responses = self.scoring.response_texts(sample)
        table = [
            generation_row((self.scoring.prompt_text(sample, i), responses[i]), source, score, {})
            for i, (source, score) in enumerate(
                zip(sample.data_sources, sample.token_level_scores.sum(-1).tolist(), strict=True)
            )
        ]
        self.tracker.log_table(table, f"generations/train_step_{self.global_step + 1}.json")

    def policy_metrics(self, batch: Batch, correction: RolloutCorrection) -> dict[str, float]:
        """What the actor's log-probs before the update tell (collectives): verl's ``actor/entropy`` (the
        entropy aggregated as the loss is, over the whole step's batch), the rollout-vs-actor probability
        gaps and the rollout-correction ratios (``correction``, computed on ``batch``)."""
        num_tokens, num_seqs = global_counts(batch.response_mask)
        mode = self.cfg.actor_rollout_ref.actor.loss_agg_mode
        local = agg_loss(batch.entropy, batch.response_mask.float(), mode, num_tokens=num_tokens, num_seqs=num_seqs)
        return {
            "actor/entropy": float(all_reduce(local)),
            **rollout_logprob_metrics(batch, self.global_step),
            **rollout_correction_metrics(batch, correction),
        }

    def folds_old_log_prob(self, batch: Batch) -> bool:
        """Whether this step's old-log-prob pass folds into the actor's update: the update is exactly
        on-policy (its loss takes the ratio against the detached current log-probs, so it never reads
        ``old_log_probs``) and nothing before it reads them either (no KL in the reward, no rollout
        correction applied, no ``sum_pi_squared``, an estimator registered as not reading the policy).
        The update's forward passes then record the log-probs and entropy for the metrics: the same
        parameters, one forward instead of two."""
        algo, actor_cfg = self.cfg.algorithm, self.cfg.actor_rollout_ref.actor
        return (
            self.actor.on_policy(len(batch))
            and self.global_step + 1 >= self.cfg.trainer.critic_warmup  # the actor trains this step
            and not algo.use_kl_in_reward
            and not (algo.rollout_correction.rollout_is or algo.rollout_correction.rollout_rs)
            and not actor_cfg.calculate_sum_pi_squared
            and not reads_policy(algo.adv_estimator)
            # the update's forward sees no response tokens of a masked row, so could not record its log-probs
            and not actor_cfg.mask_truncated_completions
        )

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
        # verl's count: the rows of the step (prompts x responses), not the prompts.
        self.kl_ctrl.update(current_kl, n_steps=self.cfg.data.train_batch_size * self.cfg.actor_rollout_ref.rollout.n)
        return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator over the whole global batch, so batch-wide whitening sees every rank's rows; its own
        options (``estimator_options``) are the ``algorithm.*`` keys of the same names."""
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
        baselines = all_gather_rows(None if batch.reward_baselines is None else batch.reward_baselines[:, None])[0]
        components = all_gather_rows(batch.reward_components)[0]  # [world * B, K]
        inputs = EstimatorInputs(
            **gathered,
            group_ids=group_ids[:, 0],
            reward_baselines=None if baselines is None else baselines[:, 0],
            reward_components=None
            if components is None
            else dict(zip(algo.gdpo_reward_keys, components.unbind(-1), strict=True)),
        )
        options = {key: algo[key] for key in estimator_options(algo.adv_estimator) if key in algo}
        advantages, returns = compute_advantages(
            algo.adv_estimator,
            inputs,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
            **options,
        )
        T = batch.response_mask.shape[1]
        return advantages[rows, :T], returns[rows, :T]

    def pf_ppo_seed(self) -> int:
        """The seed of this step's PF-PPO draw: from ``trainer.seed`` and the step alone, so a resumed run
        draws the same rows."""
        return self.cfg.trainer.seed * 1_000_003 + self.global_step

    def rollout_correction(self, batch: Batch):
        """Importance ratios rollout -> actor on this batch (``algorithm.rollout_correction``)."""
        corr = self.cfg.algorithm.rollout_correction
        return rollout_correction(
            batch.old_log_probs,
            batch.rollout_log_probs,
            batch.response_mask,
            rollout_is=corr.rollout_is,
            rollout_is_threshold=corr.rollout_is_threshold,
            rollout_is_batch_normalize=corr.rollout_is_batch_normalize,
            rollout_rs=corr.rollout_rs,
            rollout_rs_threshold=corr.rollout_rs_threshold,
        )

    def validate(self) -> dict[str, float]:
        """verl's validation metrics on the validation files: ``val-core/<data_source>/<reward|acc>/mean@N``
        and the rest of ``dsrl.trainer.metrics.validation_metrics``, over the score and each numeric extra of
        the reward function (``pred`` extras vote for ``maj@k``), the same on every rank.

        Every rank makes the same calls whatever its share, then the rows meet in one gather
        (``dsrl.trainer.validation``, shared with ``dsrl-eval``). The reward failures of all ranks are counted as
        ``val-aux/reward/fail_<kind>``."""
        sampling = self._sampling(validation=True)
        chunks = shard_chunks(self.val_prompts, self.rank, self.world_size, self.cfg.data.val_batch_size)
        with self.colocated({}):
            batches = [
                (self.generate(self._prompt_batch(records, first_group_id=start), sampling), real * sampling.n)
                for records, start, real in chunks
            ]
        turns = {} if self.tools is None else multi_turn_metrics(self.rollout.take_stats())  # fillers' rows too
        logged = self.cfg.trainer.log_val_generations  # texts only for the rows of the table
        rows, failures = score_chunks(
            batches, self.scoring, rank=self.rank, world_size=self.world_size, texts_below=logged
        )
        rows, failures = gather_rows(rows, failures)
        if logged:
            table = [generation_row(row.texts, row.data_source, row.score, row.extras) for row in rows[:logged]]
            self.tracker.log_table(table, f"generations/val_step_{self.global_step}.json")
        metrics = row_metrics(rows)
        metrics.update({f"val-aux/{name}": count for name, count in failures.items()})
        metrics.update({f"val-aux/{name}": value for name, value in turns.items() if not name.startswith("timing_s/")})
        self.take_tallies()  # the reward model's forwards here are no step's (perf/micro_batches/reward_model)
        return metrics

    # ---- the step ----------------------------------------------------------------------------

    def step(self, prompts: Batch | None) -> dict[str, float]:
        """One training step on ``prompts`` (this rank's; None with partial rollout, which draws its own)."""
        cfg, algo = self.cfg, self.cfg.algorithm
        actor_cfg, rollout_cfg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        timer = PhaseTimer()
        metrics: dict[str, float] = {}
        greedy_baseline = "greedy_baseline" in estimator_needs(algo.adv_estimator)  # ReMax
        with timer("step"):
            # timing_s/update_weights, /wake, /gen, /sleep (and sleep-mode memory on GPUs)
            with in_phase("gen"), self.colocated(metrics):
                if self.in_flight is not None:  # dynamic sampling there too
                    batch, off_policy_metrics = self.partial_rollout()
                    metrics.update(off_policy_metrics)
                elif algo.filter_groups.enable:  # scored here, round by round; timing_s/gen includes the scoring
                    batch, sampling_metrics = self.dynamic_sampling(prompts, timer)
                    metrics.update(sampling_metrics)
                else:
                    batch = self.generate(prompts, self._sampling(validation=False))
                if greedy_baseline:
                    greedy = self.generate(prompts, self._sampling(validation=False).replace(n=1, do_sample=False))
            if self.tools is not None:  # every conversation generated this step, ReMax's greedy ones too
                metrics.update(multi_turn_metrics(self.rollout.take_stats()))
            with timer("reward"):
                if greedy_baseline:  # scored before the rows move, like the responses below
                    greedy_scores, _, _ = self.score(greedy)
                    batch = batch.replace(reward_baselines=greedy_scores.sum(-1).repeat_interleave(rollout_cfg.n))
            if cfg.trainer.balance_batch and self.world_size > 1:
                with timer("balance"):
                    batch, balance_metrics = balance_across_ranks(batch)
                    metrics.update(balance_metrics)
            if not algo.filter_groups.enable or self.in_flight is not None:  # judged in gen, scored here
                with timer("reward"):
                    scores, components, counts = self.score(batch)
                    batch = batch.replace(token_level_scores=scores, reward_components=components)
                    metrics.update(counts)
            bypass = algo.rollout_correction.bypass_mode  # verl's bypass mode: no old-log-prob pass
            if bypass:
                batch = batch.replace(old_log_probs=batch.rollout_log_probs)
            fold = bypass or self.folds_old_log_prob(batch)
            if not fold:
                with timer("old_log_prob"):
                    batch = batch.replace(
                        **self.actor.compute_log_probs(
                            batch,
                            temperature=rollout_cfg.temperature,
                            with_entropy=True,
                            with_sum_pi_squared=actor_cfg.calculate_sum_pi_squared,
                        )
                    )
                    correction = self.rollout_correction(batch)
                    metrics.update(self.policy_metrics(batch, correction))
            if self.ref is not None:
                with timer("ref"):
                    batch = batch.replace(
                        ref_log_probs=self.ref.compute_log_probs(batch, temperature=rollout_cfg.temperature)
                    )
            if self.teacher is not None:
                with timer("teacher"):
                    batch = batch.replace(
                        teacher_log_probs=self.teacher.compute_log_probs(batch, temperature=rollout_cfg.temperature)
                    )
            if self.critic is not None:
                with timer("values"):
                    batch = batch.replace(values=self.critic.compute_values(batch))
            with timer("adv"):
                if not bypass and (
                    algo.rollout_correction.rollout_is or algo.rollout_correction.rollout_rs
                ):  # never folded
                    batch = batch.replace(rollout_is_weights=correction.weights)
                if algo.use_kl_in_reward:
                    rewards, kl_metrics = self.rewards_with_kl(batch)
                    metrics.update(kl_metrics)
                else:
                    rewards = batch.token_level_scores
                batch = batch.replace(token_level_rewards=rewards)
                advantages, returns = self.advantages(batch)
                batch = batch.replace(advantages=advantages, returns=returns)
                if algo.use_pf_ppo:  # as verl, right after the advantages: both updates see the redrawn rows
                    pf = algo.pf_ppo
                    batch = pf_ppo_resample(batch, pf.reweight_method, pf.weight_pow, seed=self.pf_ppo_seed())
                # after the advantages (the group statistics still see the truncated responses, as TRL); the
                # actor alone trains without them, the critic and the metrics keep every row
                actor_batch = batch
                if actor_cfg.mask_truncated_completions:
                    actor_batch, masked_metrics = self.without_truncated(batch)
                    metrics.update(masked_metrics)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics.update(self.critic.update(batch))
            if self.global_step + 1 >= cfg.trainer.critic_warmup:  # verl: the actor trains from step critic_warmup
                with timer("update_actor"):
                    recorded = {} if fold else None
                    metrics.update(
                        self.actor.update(actor_batch, temperature=rollout_cfg.temperature, recorded=recorded)
                    )
                if fold:
                    batch = batch.replace(**recorded)
                    trained = batch.replace(response_mask=actor_batch.response_mask)  # the rows it recorded
                    metrics.update(self.policy_metrics(trained, self.rollout_correction(trained)))
        metrics.update(
            batch_metrics(
                batch, max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length
            )
        )
        metrics.update(variance_proxy_metrics(batch, metrics.get("actor/grad_norm")))
        if self.teacher is not None and batch.old_log_probs is not None:  # none when the actor did not train
            metrics.update(distillation_metrics(batch, cfg.distillation.distillation_loss.loss_mode))
        metrics.update(timer.seconds)
        prompt_tokens, response_tokens = all_reduce(
            torch.stack([batch.prompt_mask.sum(), batch.response_attention.sum()]).double()
        ).tolist()
        metrics.update(
            throughput_metrics(
                {k: v for k, v in metrics.items() if k.startswith("timing_s/")},  # the colocation's phases too
                num_prompt_tokens=int(prompt_tokens),
                num_response_tokens=int(response_tokens),
                world_size=self.world_size,
            )
        )
        metrics.update(forward_metrics(self.take_tallies()))
        metrics.update(memory_metrics())
        metrics["training/global_step"] = self.global_step + 1
        metrics["training/epoch"] = self.sampler.epoch
        freq = cfg.trainer.log_samples_freq
        if freq > 0 and (self.global_step + 1) % freq == 0:
            self.log_samples(batch)
        return metrics

    def fit(self, signals: RunSignals | None = None) -> dict[str, float]:
        """Train up to ``total_steps`` steps; returns ``validation_score`` ``before`` and ``after``
        training (when validated), and sets ``model_dir`` to the exported model (None with
        ``trainer.val_only``). ``signals``: the run's handlers (``dsrl-train`` installs them before the
        trainer loads); None installs them for the call. Raises ``TrainingInterrupted`` after a signal in
        the loop, ``Interrupted`` after one elsewhere.

        The tracking run ends FINISHED, KILLED (a signal) or FAILED (an exception); the reward workers stop
        and the run folder is given back however it ends."""
        own = signals is None
        if own:
            signals = RunSignals().install()
        signals.at_kill(lambda: self.close("KILLED"))
        status = "FAILED"
        try:
            results = self._fit(signals)
            status = "FINISHED"
        except Interrupted:
            status = "KILLED"
            raise
        finally:
            self.close(status)
            if own:
                signals.restore()
        return results

    def _fit(self, signals: RunSignals) -> dict[str, float]:
        signals.raise_swallowed()  # one received while the roles were built, should a library have caught it
        cfg = self.cfg
        results: dict[str, float] = {}
        if self.val_prompts is not None and (cfg.trainer.val_before_train or cfg.trainer.val_only):
            with in_phase("validate"):
                val = self.validate()
            results["before"] = validation_score(val)
            self.tracker.log_metrics(val, step=self.global_step)
            if cfg.trainer.val_only:
                return results
        val = {}
        with signals.deferred(self.rank):
            while self.global_step < self.total_steps:
                prompts = None if self.in_flight else self._prompt_batch(self._next_records(), self._first_group_id())
                metrics = self.step(prompts)
                self.global_step += 1
                step, last = self.global_step, self.global_step == self.total_steps
                for check in self.stops:  # dsrl.trainer.stops
                    stop = check.record(metrics, step)
                    if stop:
                        raise TrainingStopped(stop)
                if (
                    self.val_prompts is not None
                    and cfg.trainer.test_freq > 0
                    and (step % cfg.trainer.test_freq == 0 or last)
                ):
                    with in_phase("validate"):
                        val = self.validate()
                    metrics.update(val)
                self.tracker.log_metrics(metrics, step=step)
                with in_phase("stop-signal check"):  # the signal any rank received, the same answer on every rank
                    signum = int(all_reduce(torch.tensor(float(signals.signum)), "max"))
                if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or last) or signum:
                    start = time.perf_counter()
                    with in_phase("save"):
                        path = self.save()
                    self.last_checkpoint = path
                    if self.rank == 0:
                        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
                        seconds = time.perf_counter() - start
                        logger.info(f"checkpoint saved to {path} ({size:.1f} MiB in {seconds:.2f} s)")
                if signum:
                    raise TrainingInterrupted(signum, step, path)
        if val:
            results["after"] = validation_score(val)
        with in_phase("export"):
            self.model_dir = self.export_final_model()
        self.tracker.log_model_dir(
            self.model_dir, upload=cfg.trainer.log_model, adapter_dir=adapter_dir(self.model_dir)
        )
        return results


def train(cfg: Config, signals: RunSignals | None = None, cluster: Cluster | None = None) -> dict[str, float]:
    """Build every role and run the loop; rank 0 logs the start-up summary, then the final one
    (validation scores, where the model, checkpoints and MLflow run are) however the run ends."""
    start = time.perf_counter()
    trainer = Trainer(cfg, cluster)
    status = "failed"
    try:
        results = trainer.fit(signals)
        status = "finished"
    except Interrupted as err:
        status = f"stopped by {signal.Signals(err.signum).name}"
        raise
    finally:
        if trainer.rank == 0:
            logger.info(final_summary(final_facts(trainer, status=status, wall_time_s=time.perf_counter() - start)))
    return results
