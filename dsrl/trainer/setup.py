"""The trainer's start-up and its close (``TrainerSetup``, the base of ``dsrl.trainer.loop.Trainer``), one helper
per concern in the order ``Trainer.__init__`` calls them: the run folder taken, the checkpoint to resume chosen,
the user's files loaded (the problems of every rank reported together, before any model loads), the engines built,
the resume restored, the tracking started. ``close`` gives back what they took, however the run ends.
``problems_of_every_rank`` and ``load_run_prompts`` are shared with ``dsrl-eval``."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from dsrl.algorithms import AdaptiveKLController, FixedKLController
from dsrl.checkpoint import run_folder
from dsrl.checkpoint.resume import check_settings, check_train_data, checkpoint_to_resume, data_identity, restore
from dsrl.checkpoint.save import CheckpointError, load_in_flight
from dsrl.config import (
    ConfigError,
    import_user_modules,
    prompts_per_round,
    reward_model_scores_alone,
    to_dict,
    to_yaml,
)
from dsrl.config.rules.need import critic_used
from dsrl.data.datasets import PromptSampler, load_prompts, load_tokenizer
from dsrl.engines import (
    ActorEngine,
    AdapterOffReference,
    CriticEngine,
    ReferenceEngine,
    RewardModelEngine,
    teacher_engine,
)
from dsrl.rewards import RewardScorer, check_reward_rules
from dsrl.rewards.model_inputs import teacher_vocabulary_problem
from dsrl.rollout import HFRollout
from dsrl.rollout.multi_turn import Conversation, MultiTurnRollout
from dsrl.rollout.tools import ToolSet
from dsrl.runtime.distributed import gather_problems
from dsrl.runtime.seeding import seed_all
from dsrl.tracking import Tracker, flatten
from dsrl.trainer.facts import lora_facts, run_tags
from dsrl.trainer.partial_rollout import InFlight
from dsrl.trainer.scoring import StepScorer, reward_model_inputs
from dsrl.trainer.stops import FailureStreak, RolloutMismatch, SkipLimit


def problems_of_every_rank(load: Callable[[], list[str]]) -> list[str]:
    """Every rank's problems with the files ``load()`` loads, on every rank: the problems it returns, or those of the
    ``ConfigError``, ``ValueError`` or ``OSError`` it raises. Collective; the caller refuses the run when any."""
    problems: list[str] = []
    try:
        problems = load()
    except ConfigError as err:
        problems = err.violations
    except (ValueError, OSError) as err:
        problems = [" ".join(str(err).split())]
    return gather_problems(problems)


def load_run_prompts(
    cfg, files, max_samples: int, tokenizer, tools: ToolSet | None = None, *, keep_messages: bool = False
) -> tuple[list, dict[str, int]]:
    """The prompts of ``files`` as ``data.*`` asks (``dsrl.data.datasets.load_prompts``) and their counts; with
    multi-turn, their template lists the ``tools``. ``keep_messages``: the prompts also keep their chat messages,
    which batches carry as ``raw_prompts``, for a reward model with another chat template
    (``dsrl.rewards.model_inputs``)."""
    data = cfg.data
    return load_prompts(
        files,
        tokenizer,
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        filter_overlong_prompts=data.filter_overlong_prompts,
        truncation=data.truncation,
        max_samples=max_samples,
        keep_messages=keep_messages,
        chat_template_kwargs={
            **({"tools": tools.schemas} if tools is not None else {}),
            **data.apply_chat_template_kwargs,
        },
    )


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

    def _choose_checkpoint(self) -> dict | None:
        """Sets ``resume_from``, the checkpoint to resume (``dsrl.checkpoint.resume``), checked against this run's
        settings; returns its state (None to start fresh)."""
        trained = ["actor"] + (["critic"] if critic_used(self.cfg) else [])
        self.resume_from, resume_state = checkpoint_to_resume(self.cfg, self.checkpoint_root, trained)
        if self.resume_from is not None:
            check_settings(self.cfg, self.resume_from, resume_state, self.world_size)  # every rank holds the state
        return resume_state

    def _load_user_files(self) -> None:
        """The user's modules (their estimators and losses registered on this rank), tokenizer, tools, prompts and
        reward function: what fails here fails in seconds, before any model loads. A problem on any rank raises a
        ``ConfigError`` with every rank's on every rank."""

        def load() -> list[str]:
            problems = import_user_modules(self.cfg.algorithm.import_modules)
            if not problems:
                model = self.cfg.actor_rollout_ref.model
                self.tokenizer = load_tokenizer(model.path, trust_remote_code=model.trust_remote_code)
                self._setup_tools()  # before the prompts: their template lists the tools
                self._check_judges()  # before the prompts: a reward model with its own template needs their messages
                self._setup_data()
                self._setup_rewards()
            return problems

        problems = problems_of_every_rank(load)
        if problems:
            raise ConfigError(problems)

    def _setup_tools(self) -> None:
        """Multi-turn's tools (``dsrl.rollout.tools``), their workers logging to the run folder."""
        if self.cfg.actor_rollout_ref.rollout.multi_turn.enable:
            log = self.checkpoint_root / f"tool_workers_rank{self.rank}.log"
            self.tools = ToolSet.from_config(self.cfg, log_file=log)

    def _check_judges(self) -> None:
        """The tokenizers of the reward model and the teacher against the policy's (``dsrl.rewards.model_inputs``):
        the sequences the reward model reads, and a teacher that gives other ids to the same tokens refused."""
        cfg = self.cfg
        self.model_inputs = None
        if cfg.reward_model.enable:
            rm = cfg.reward_model
            rm_tokenizer = load_tokenizer(rm.model.path, trust_remote_code=rm.model.trust_remote_code)
            self.model_inputs = reward_model_inputs(cfg, self.tokenizer, rm_tokenizer)
        if cfg.distillation.enabled:
            path = cfg.distillation.teacher_models.teacher_model.model_path
            teacher = load_tokenizer(path, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
            problem = teacher_vocabulary_problem(self.tokenizer, teacher, path)
            if problem is not None:
                raise ValueError(problem)

    def _setup_data(self) -> None:
        """The training and validation prompts, the sampler of the training batches and the number of steps."""
        cfg, data = self.cfg, self.cfg.data
        keep = self.model_inputs is not None and not self.model_inputs.same_template  # re-tokenised from messages
        self.train_prompts, train_stats = load_run_prompts(
            cfg, data.train_files, data.train_max_samples, self.tokenizer, self.tools, keep_messages=keep
        )
        self.val_prompts, val_stats = (
            load_run_prompts(cfg, data.val_files, data.val_max_samples, self.tokenizer, self.tools, keep_messages=keep)
            if data.val_files
            else (None, None)
        )
        self.prompt_stats = {"train": train_stats, "val": val_stats}
        # Batches of a generation round (data.gen_batch_size with dynamic sampling), as verl's dataloader
        self.sampler = PromptSampler(
            self.train_prompts,
            prompts_per_round(data),
            shuffle=data.shuffle,
            seed=data.seed,
            key="data.train_batch_size" if data.gen_batch_size is None else "data.gen_batch_size",
        )
        # As verl: the lr schedule spans total_training_steps when set, and the run stops at it or
        # at the end of total_epochs (of batches of a round's prompts), whichever comes first.
        epoch_steps = cfg.trainer.total_epochs * self.sampler.batches_per_epoch
        self.schedule_steps = cfg.trainer.total_training_steps or epoch_steps
        self.total_steps = min(self.schedule_steps, epoch_steps)
        v1 = cfg.trainer.v1
        self.in_flight = None  # trainer.v1.trainer_mode=sync
        if v1.trainer_mode == "colocate_async":  # the warm-up batches in whole groups per rank
            extra = int(v1.colocate_async.num_warmup_batches * data.train_batch_size) // self.world_size
            self.in_flight = InFlight(
                batch_size=data.train_batch_size,
                pool_size=data.train_batch_size + extra * self.world_size,
                n=cfg.actor_rollout_ref.rollout.n,
                threshold=v1.sampler.max_off_policy_threshold,
                strategy=v1.sampler.max_off_policy_strategy,
            )

    def conversation_of(self, row: int) -> Conversation:
        """Multi-turn partial rollout: a new conversation of training prompt ``row``, with its tools' arguments."""
        record = self.sampler.take([row])[0]
        return Conversation(list(record.prompt_ids), record.extra_info.get("tools_kwargs") or {})

    def _setup_rewards(self) -> None:
        """The reward rules checked against the prompts' data sources (unless the reward model alone scores), and the
        scorer of the responses."""
        cfg = self.cfg
        if not reward_model_scores_alone(cfg):
            check_reward_rules(
                {"data.train_files": self.train_prompts, "data.val_files": self.val_prompts},
                custom_path=cfg.custom_reward_function.path,
                math_verify_sources=cfg.reward.math_verify_sources,
                sandbox_fusion_url=cfg.reward.sandbox_fusion.url,
            )
        # The run's folder holds the workers' prints and tracebacks: a chatty reward function floods no console.
        log = self.checkpoint_root / f"reward_workers_rank{self.rank}.log"
        self.scorer = RewardScorer.from_config(cfg, log_file=log)
        self.scoring = StepScorer(cfg, self.scorer, self.tokenizer, self.model_inputs)

    def _check_train_data(self, resume_state: dict | None) -> None:
        """What the checkpoints record of the training files: rank 0 writes the states and checks a resume's; every
        rank stops if they changed."""
        self.train_data = data_identity(self.cfg.data.train_files) if self.rank == 0 else []
        if self.resume_from is not None:
            changed = [None]
            if self.rank == 0:
                try:
                    check_train_data(self.cfg, self.resume_from, resume_state, self.train_data)
                except CheckpointError as err:
                    changed[0] = str(err)
            dist.broadcast_object_list(changed, src=0)
            if changed[0] is not None:
                raise CheckpointError(changed[0])

    def _setup_engines(self) -> None:
        """The actor, its reference, the critic, the teacher and the reward model, with the rollout engine
        (``_setup_rollout``) before them when it is vLLM's, so that it finds the device memory free, and after them
        otherwise."""
        cfg, algo, steps = self.cfg, self.cfg.algorithm, self.schedule_steps
        needs_ref = cfg.actor_rollout_ref.actor.use_kl_loss or algo.use_kl_in_reward
        uses_vllm = cfg.actor_rollout_ref.rollout.name == "vllm"
        if uses_vllm:
            self._setup_rollout()
        self.actor = ActorEngine(cfg, total_training_steps=steps)
        self.ref = None
        if needs_ref:  # a LoRA actor is its own reference, with the adapters off
            self.ref = AdapterOffReference(cfg, self.actor) if self.actor.lora else ReferenceEngine(cfg)
        self.critic = CriticEngine(cfg, total_training_steps=steps) if critic_used(cfg) else None
        self.teacher = teacher_engine(cfg) if cfg.distillation.enabled else None
        self.reward_model = RewardModelEngine(cfg) if cfg.reward_model.enable else None
        self.scoring.reward_model = self.reward_model
        if not uses_vllm:
            self._setup_rollout()

    def _setup_rollout(self) -> None:
        """The rollout engine of ``actor_rollout_ref.rollout.name``, with the tool loop around it for multi-turn."""
        cfg = self.cfg
        if cfg.actor_rollout_ref.rollout.name == "vllm":
            from dsrl.rollout.vllm import VLLMRollout  # needs the vllm package

            self.rollout = VLLMRollout.from_config(cfg)  # with sleep mode it sleeps right away
            # vLLM seeded the global generators with its engine seed; the trainer's draws stay per rank (each
            # generate call seeds the ranks of a tensor-parallel group alike: dsrl.rollout.base.seeded).
            seed_all(cfg.trainer.seed + self.rank)
        else:
            self.rollout = HFRollout.from_config(cfg)
        if self.tools is not None:
            self.rollout = MultiTurnRollout.from_config(self.rollout, self.tokenizer, self.tools, cfg)

    def _setup_stops(self) -> None:
        """The checks that stop a run that cannot go on (``dsrl.trainer.stops``), asked in this order after every
        step; the first to answer stops the run."""
        cfg = self.cfg
        self.stops = [SkipLimit(cfg, self._trained_roles()), FailureStreak(cfg, self.scorer), RolloutMismatch(cfg)]

    def _setup_kl_controller(self) -> None:
        kl_ctrl = self.cfg.algorithm.kl_ctrl
        if kl_ctrl.type == "adaptive":
            self.kl_ctrl = AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
        else:
            self.kl_ctrl = FixedKLController(kl_ctrl.kl_coef)

    def _restore(self, resume_state: dict | None) -> None:
        """The checkpoint to resume loaded into the engines, the sampler and the KL controller, its step the run's."""
        self.global_step = 0
        if self.resume_from is not None:
            restore(
                self.resume_from,
                resume_state,
                roles=self._trained_roles(),
                sampler=self.sampler,
                kl_ctrl=self.kl_ctrl,
                rank=self.rank,
                root=self.checkpoint_root,
                seed=self.cfg.trainer.seed,
                stall_s=self.cfg.actor_rollout_ref.nccl_timeout,
            )
            self.global_step = resume_state["global_step"]
            in_flight = load_in_flight(self.resume_from, self.rank)
            if self.in_flight is not None and in_flight is not None:  # else it starts empty (a sync checkpoint)
                try:
                    self.in_flight.load_state_dict(
                        in_flight,
                        records=len(self.train_prompts),
                        conversation_of=self.conversation_of if self.tools is not None else None,
                    )
                except ValueError as err:
                    raise CheckpointError(f"{self.resume_from}/in_flight/rank_{self.rank}.pt: {err}") from None
        self.initial_step = self.global_step  # where this run started (a resumed run's checkpoint)
        self.last_checkpoint = self.resume_from

    def _setup_tracking(self, resume_state: dict | None) -> None:
        """The tracking run (a resumed run's own, again), with the run's params, resolved config and DeepSpeed
        configs."""
        cfg = self.cfg
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
        roles = (self.actor, self.ref, self.critic, self.teacher, self.reward_model)
        for name, role in zip(("actor", "reference", "critic", "teacher", "reward_model"), roles, strict=True):
            if hasattr(role, "ds_config"):  # an engine of its own
                self.tracker.log_dict(role.ds_config, f"config/deepspeed_{name}.json")

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
