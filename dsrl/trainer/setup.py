"""The trainer's start-up and its close (``TrainerSetup``, the base of ``dsrl.trainer.loop.Trainer``): the run folder
taken, the checkpoint to resume chosen and checked, the user's files loaded, every role built and the resume
restored; at the end, however the run ends, what start-up took given back."""

from __future__ import annotations

import torch.distributed as dist

from dsrl.algorithms import AdaptiveKLController, FixedKLController
from dsrl.checkpoint import run_folder
from dsrl.checkpoint.resume import checkpoint_to_resume, check_settings, check_train_data, data_identity, restore
from dsrl.checkpoint.save import CheckpointError
from dsrl.config import ConfigError, import_user_modules, to_dict, to_yaml
from dsrl.data.datasets import PromptSampler, load_prompts, load_tokenizer
from dsrl.engines import ActorEngine, AdapterOffReference, CriticEngine, ReferenceEngine
from dsrl.rewards import RewardScorer, check_reward_rules
from dsrl.rollout import HFRollout
from dsrl.rollout.multi_turn import MultiTurnRollout
from dsrl.rollout.tools import ToolSet
from dsrl.runtime.distributed import gather_problems
from dsrl.runtime.seeding import seed_all
from dsrl.tracking import Tracker, flatten
from dsrl.tracking.console import logger, startup_summary
from dsrl.trainer.facts import lora_facts, run_tags, startup_facts
from dsrl.trainer.scoring import StepScorer
from dsrl.trainer.stops import FailureStreak, RolloutMismatch, SkipLimit


class TrainerSetup:
    """What ``Trainer.__init__`` builds before the loop, and ``close``, which gives it back."""

    def _take_run_folder(self) -> None:
        """Rank 0 locks the run folder for this run (``dsrl.checkpoint.run_folder``); every rank stops if it cannot. A
        validation-only run writes nothing there but its reward workers' log, and takes no lock."""
        self._locked = not self.cfg.trainer.val_only
        if not self._locked:
            return
        busy = [None]
        if self.rank == 0:
            try:
                run_folder.lock(self.checkpoint_root)
            except (run_folder.RunFolderBusy, OSError) as err:
                busy[0] = str(err)
        dist.broadcast_object_list(busy, src=0)
        if busy[0] is not None:
            self._locked = False
            raise run_folder.RunFolderBusy(busy[0])

    def _build(self) -> None:
        cfg = self.cfg
        model_cfg, actor_cfg, algo = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor, cfg.algorithm
        trained = ["actor"] + (["critic"] if algo.adv_estimator == "gae" else [])
        self.resume_from, resume_state = checkpoint_to_resume(cfg, self.checkpoint_root, trained)
        if self.resume_from is not None:
            check_settings(cfg, self.resume_from, resume_state, self.world_size)  # every rank holds the state
        problems: list[str] = []
        try:
            # The user's modules (their estimators and losses registered on this rank), tokenizer, prompts and reward
            # function: what fails here fails in seconds, before any model loads.
            problems = import_user_modules(algo.import_modules)
            if not problems:
                self.tokenizer = load_tokenizer(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
                if cfg.actor_rollout_ref.rollout.multi_turn.enable:  # before the prompts: their template lists the tools
                    log = self.checkpoint_root / f"tool_workers_rank{self.rank}.log"
                    self.tools = ToolSet.from_config(cfg, log_file=log)
                self.train_prompts, train_stats = self._load_prompts(cfg.data.train_files, cfg.data.train_max_samples)
                self.val_prompts, val_stats = (
                    self._load_prompts(cfg.data.val_files, cfg.data.val_max_samples) if cfg.data.val_files else (None, None)
                )
                self.sampler = PromptSampler(self.train_prompts, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
                check_reward_rules(
                    {"data.train_files": self.train_prompts, "data.val_files": self.val_prompts},
                    custom_path=cfg.custom_reward_function.path,
                    math_verify_sources=cfg.reward.math_verify_sources,
                )
                # The run's folder holds the workers' prints and tracebacks: a chatty reward function floods no console.
                log = self.checkpoint_root / f"reward_workers_rank{self.rank}.log"
                self.scorer = RewardScorer.from_config(cfg, log_file=log)
                self.scoring = StepScorer(cfg, self.scorer, self.tokenizer)
        except ConfigError as err:
            problems = err.violations
        except (ValueError, OSError) as err:
            problems = [" ".join(str(err).split())]
        problems = gather_problems(problems)
        if problems:
            raise ConfigError(problems)
        # What the checkpoints record of the training files: rank 0 writes the states and checks a resume's.
        self.train_data = data_identity(cfg.data.train_files) if self.rank == 0 else []
        if self.resume_from is not None:
            changed = [None]
            if self.rank == 0:
                try:
                    check_train_data(cfg, self.resume_from, resume_state, self.train_data)
                except CheckpointError as err:
                    changed[0] = str(err)
            dist.broadcast_object_list(changed, src=0)
            if changed[0] is not None:
                raise CheckpointError(changed[0])
        self.prompt_stats = {"train": train_stats, "val": val_stats}
        # As verl: the lr schedule spans total_training_steps when set, and the run stops at it or
        # at the end of total_epochs, whichever comes first.
        epoch_steps = cfg.trainer.total_epochs * self.sampler.batches_per_epoch
        schedule_steps = cfg.trainer.total_training_steps or epoch_steps
        self.total_steps = min(schedule_steps, epoch_steps)

        needs_ref = actor_cfg.use_kl_loss or algo.use_kl_in_reward
        uses_vllm = cfg.actor_rollout_ref.rollout.name == "vllm"
        if uses_vllm:
            from dsrl.rollout.vllm import VLLMRollout  # needs the vllm package

            # Before the DeepSpeed engines take device memory; with sleep mode it sleeps right away.
            self.rollout = VLLMRollout.from_config(cfg)
            # vLLM seeded the global generators with its engine seed; the trainer's draws stay per rank (each
            # generate call seeds the ranks of a tensor-parallel group alike: dsrl.rollout.base.seeded).
            seed_all(cfg.trainer.seed + self.rank)
        self.actor = ActorEngine(cfg, total_training_steps=schedule_steps)
        self.ref = None
        if needs_ref:  # a LoRA actor is its own reference, with the adapters off
            self.ref = AdapterOffReference(cfg, self.actor) if self.actor.lora else ReferenceEngine(cfg)
        self.critic = CriticEngine(cfg, total_training_steps=schedule_steps) if algo.adv_estimator == "gae" else None
        if not uses_vllm:
            self.rollout = HFRollout.from_config(cfg)
        if self.tools is not None:
            self.rollout = MultiTurnRollout.from_config(self.rollout, self.tokenizer, self.tools, cfg)
        # asked in this order after every step; the first to answer stops the run
        self.stops = [SkipLimit(cfg, self._trained_roles()), FailureStreak(cfg, self.scorer), RolloutMismatch(cfg)]

        if algo.kl_ctrl.type == "adaptive":
            self.kl_ctrl = AdaptiveKLController(algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon)
        else:
            self.kl_ctrl = FixedKLController(algo.kl_ctrl.kl_coef)

        self.global_step = 0
        if self.resume_from is not None:
            restore(self.resume_from, resume_state, roles=self._trained_roles(), sampler=self.sampler,
                    kl_ctrl=self.kl_ctrl, rank=self.rank, root=self.checkpoint_root, seed=cfg.trainer.seed)
            self.global_step = resume_state["global_step"]
        self.initial_step = self.global_step  # where this run started (a resumed run's checkpoint)
        self.tracker = Tracker(
            cfg.trainer.logger,
            project_name=cfg.trainer.project_name,
            experiment_name=cfg.trainer.experiment_name,
            total_steps=self.total_steps,
            rank=self.rank,
            run_id=resume_state["mlflow_run_id"] if resume_state else None,
            tags=run_tags(cfg, self.world_size),
            initial_step=self.global_step,
        )
        if self.resume_from is None:  # a resumed run has them (MLflow refuses to change a param)
            lora = {"lora": lora_facts(self.actor.module)} if self.actor.lora else {}  # the adapter as PEFT made it
            self.tracker.log_params(flatten({**to_dict(cfg), **lora}))
        self.tracker.log_text(to_yaml(cfg), "config/resolved.yaml")
        for name, role in (("actor", self.actor), ("reference", self.ref), ("critic", self.critic)):
            if hasattr(role, "ds_config"):  # an engine of its own
                self.tracker.log_dict(role.ds_config, f"config/deepspeed_{name}.json")
        self.last_checkpoint = self.resume_from
        self.model_dir = None
        if self.rank == 0:
            logger.info(startup_summary(startup_facts(self)))

    def close(self, status: str) -> None:
        """The end of the run, however it ends: the MLflow run ends as ``status`` (FINISHED, FAILED or KILLED),
        the reward workers stop, the run folder is given back. Idempotent."""
        if self.tracker is not None:
            self.tracker.finish(status)
        if self.scorer is not None:
            self.scorer.close()
        if self.tools is not None:
            self.tools.close()
        if self._locked:
            run_folder.release(self.checkpoint_root)
            self._locked = False


    def _load_prompts(self, files, max_samples: int) -> tuple[list, dict[str, int]]:
        data = self.cfg.data
        return load_prompts(
            files,
            self.tokenizer,
            prompt_key=data.prompt_key,
            max_prompt_length=data.max_prompt_length,
            filter_overlong_prompts=data.filter_overlong_prompts,
            truncation=data.truncation,
            max_samples=max_samples,
            chat_template_kwargs={
                **({"tools": self.tools.schemas} if self.tools is not None else {}), **data.apply_chat_template_kwargs
            },
        )
