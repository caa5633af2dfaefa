"""The memory plan of a run (``dsrl-train ... --plan``): what each rank holds in each phase of a step, on the device
and on the host (``plan_memory``, printed by ``render``), and the check ``--validate-only`` applies
(``trainer.memory_plan_check``: ``plan_problems``, each fix it offers checked against the plan). It reads only the
resolved config, the roles' DeepSpeed JSON files and the models' ``config.json`` (the actor's, the reward model's and
the teacher's own): no weights, no torch. The phases, the terms and their formulas: docs/architecture.md, section
13."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsrl.config.deepspeed_json import read_ds_json
from dsrl.plan.inputs import Device, Pass, PlanInputs, ZeroSetup, inputs_from_config
from dsrl.plan.shape import GIB, ModelShape, read_shape
from dsrl.plan.terms import (
    PUSH_BUCKET_BYTES,
    KvBudget,
    Term,
    activations,
    gathered,
    log_prob_head,
    model_states,
    moved_to_host,
    reduce_bucket,
    reward_forward,
    rollout_terms,
    trained_states,
    update_gradients,
)

# ---- the plan ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One phase of a step: every term a rank holds during it."""

    name: str
    terms: list[Term]
    asleep: str  # what sleeps or was moved off the device in this phase

    @property
    def device(self) -> int:
        return sum(term.device for term in self.terms)

    @property
    def host(self) -> int:
        return sum(term.host for term in self.terms)


@dataclass(frozen=True)
class Plan:
    """Per-rank phases of a run on a device, and its rollout's KV budget."""

    inputs: PlanInputs
    device: Device
    phases: list[Phase]
    kv: KvBudget

    def need(self, phase: Phase) -> int:
        """What ``phase`` needs of the memory ``device`` counts: the device's share per rank on a GPU; on a CPU
        machine device and host terms of every rank together."""
        if self.device.kind == "cpu":
            return (phase.device + phase.host) * self.inputs.world_size
        return phase.device

    def over(self) -> list[Phase]:
        return [phase for phase in self.phases if self.need(phase) > self.device.bytes]


def plan_memory(inputs: PlanInputs, device: Device) -> Plan:
    """The per-rank, per-phase plan of ``inputs`` on ``device``."""
    s, b = inputs.shape, inputs.dtype_bytes
    actor, critic = trained_states(inputs)
    on_gpu = device.kind == "cuda"
    actor += reduce_bucket("actor", inputs.actor, s.parameters(), b, touched_only=not on_gpu)
    if critic:
        critic += reduce_bucket("critic", inputs.critic, s.parameters(lm_head=False), b, touched_only=not on_gpu)
    forward_only = {}  # the engines without an optimizer, each with its parameters
    if inputs.ref is not None:
        forward_only["ref"] = (inputs.ref, s.parameters())
    if inputs.reward_model is not None:
        forward_only["reward model"] = (inputs.reward_model, inputs.reward_shape.classifier_parameters())
    if inputs.teacher is not None:
        forward_only["teacher"] = (inputs.teacher, inputs.teacher_shape.parameters())
    frozen = [
        t for role, (zero, P) in forward_only.items() for t in model_states(role, zero, P, 0, b, inputs.world_size)
    ]
    rollout_awake, kv, rollout_asleep = rollout_terms(inputs, device)
    static = inputs.rollout == "vllm" and not inputs.sleep_mode
    resident = actor + critic + frozen
    engines = {"actor": gathered("actor", inputs.actor, s.parameters(), b)}
    engines |= {role: gathered(role, zero, P, b) for role, (zero, P) in forward_only.items()}
    if inputs.critic is not None:
        engines["critic"] = gathered("critic", inputs.critic, s.parameters(lm_head=False), b)
    # On a CPU every engine's gathered parameters stay from the step before; on a GPU they come back as each runs.
    live = {} if on_gpu else dict(engines)
    scores_in_generation = inputs.reward_model is not None and inputs.reward_in_generation
    if scores_in_generation:  # a round's scoring leaves them gathered through the next round's generation
        live["reward model"] = engines["reward model"]

    phases = []
    if on_gpu and not static:
        lora = inputs.actor_trained < s.parameters()
        critic_gen = moved_to_host(critic, inputs.critic) if critic else []
        # frozen engines move nothing (colocation.offload_targets): their parameters stay where their JSON puts them
        during_gen = moved_to_host(actor, inputs.actor, frozen=lora) + critic_gen + frozen
        asleep = "trained engines' device states moved to the host (ZeRO-3: all; ZeRO-1/2: all but the parameters" + (
            "; a LoRA actor keeps its parameters)" if lora else ")"
        )
    else:
        during_gen = resident
        asleep = "nothing moves (" + (
            "vLLM keeps its memory for good)" if static else "a CPU: device and host are one memory)"
        )
    push = [
        Term("weight push bucket", min(PUSH_BUCKET_BYTES, s.parameters() * b), 0, "full tensors gathered for the push")
    ]
    phases.append(
        Phase("rollout", during_gen + [t for terms in live.values() for t in terms] + rollout_awake + push, asleep)
    )

    rollout_note = ("vLLM awake (no sleep mode)" if static else
                    f"rollout asleep (level {inputs.sleep_level})" if inputs.rollout == "vllm" else
                    "HF rollout copy on the host" if on_gpu else "HF rollout copy resident")  # fmt: skip

    def running(role: str) -> list[Term]:
        live[role] = engines[role]
        return [t for terms in live.values() for t in terms]

    def layout_of(head: bool) -> tuple[str, int]:
        """The forwards' layout and sequence-parallel group: the actor's and the reference's, or the critic's."""
        return (
            (inputs.layout, inputs.sequence_parallel)
            if head
            else (inputs.critic_layout, inputs.critic_sequence_parallel)
        )

    def forward_phase(name: str, role: str, micro: Pass, head: bool, shape: ModelShape = s) -> Phase:
        """A no-grad forward of ``role``, a model of ``shape`` (the teacher's own; else the actor's)."""
        model = dataclasses.replace(inputs, shape=shape)
        terms = resident + rollout_asleep + running(role)
        layout, group = layout_of(head)
        terms += activations(model, micro, grad=False, checkpointing=False, layout=layout, group=group)
        if head:
            terms.append(log_prob_head(shape, micro, model, grad=False, layout=layout))
        return Phase(name, terms, rollout_note)

    def update_phase(
        name: str, role: str, zero: ZeroSetup, micro: Pass, trained: int, checkpointing: bool, head: bool
    ) -> Phase:
        terms = resident + rollout_asleep + running(role) + update_gradients(role, zero, trained, b, inputs.world_size)
        layout, group = layout_of(head)
        terms += activations(inputs, micro, grad=True, checkpointing=checkpointing, layout=layout, group=group)
        if head:
            terms.append(log_prob_head(s, micro, inputs, grad=True, layout=layout))
        return Phase(name, terms, rollout_note)

    if scores_in_generation:  # between two rounds' generate calls: vLLM awake, the HF rollout its weights
        awake = rollout_awake if inputs.rollout == "vllm" else rollout_awake[:1]
        terms = during_gen + awake + running("reward model") + reward_forward(inputs)
        phases.append(Phase("reward", terms, "dynamic sampling scores each round inside the generation; " + asleep))
    elif inputs.reward_model is not None:
        phases.append(Phase("reward", resident + rollout_asleep + running("reward model") + reward_forward(inputs),
                            rollout_note))  # fmt: skip
    if inputs.old_log_prob is not None:
        phases.append(forward_phase("old_log_prob", "actor", inputs.old_log_prob, True))
    if inputs.ref_pass is not None:  # with LoRA, the actor with its adapters off
        phases.append(forward_phase("ref", "ref" if inputs.ref is not None else "actor", inputs.ref_pass, True))
    if inputs.teacher is not None:  # as the reference's forward, at the teacher's size
        phases.append(forward_phase("teacher", "teacher", inputs.teacher_pass, True, inputs.teacher_shape))
    if inputs.critic is not None:
        backbone = s.parameters(lm_head=False)
        phases.append(forward_phase("values", "critic", inputs.critic_values, False))
        phases.append(update_phase("update_critic", "critic", inputs.critic, inputs.critic_update,
                                   backbone + s.hidden + 1, inputs.critic_checkpointing, False))  # fmt: skip
    phases.append(update_phase("update_actor", "actor", inputs.actor, inputs.update, inputs.actor_trained,
                               inputs.actor_checkpointing, True))  # fmt: skip
    return Plan(inputs, device, phases, kv)


def plan_for_config(cfg: Any, world_size: int, device: Device, model_config: str | None = None) -> Plan:
    """The plan of a validated, resolved config; ``model_config``: a config.json standing for the model's."""
    shape = read_shape(cfg.actor_rollout_ref.model.path, model_config)
    return plan_memory(inputs_from_config(cfg, world_size, shape, device), device)


# ---- the report and the check --------------------------------------------------------------------------------


def _gib(size: int) -> str:
    return f"{size / GIB:8.3f}"


def render(plan: Plan, header: str) -> str:
    """The plan as text: a header, then per phase its terms (device and host GiB per rank) and total."""
    i, dev = plan.inputs, plan.device
    lines = [
        f"memory plan: {header}",
        f"  {i.world_size} rank(s); device {dev.bytes / GIB:.1f} GiB ({dev.kind}, {dev.source}); model "
        f"{i.shape.parameters() / 1e6:,.1f} M parameters, {i.shape.layers} layers, hidden {i.shape.hidden}, vocab "
        f"{i.shape.vocab:,}; {i.dtype_bytes} B/param; actor {i.actor.describe()}"
        + (f"; ref {i.ref.describe()}" if i.ref else "")
        + (f"; critic {i.critic.describe()}" if i.critic else ""),
    ]
    frozen = (("reward model", i.reward_model, i.reward_shape, f"; reads {i.reward_length:,} tokens a sequence"),
              ("teacher", i.teacher, i.teacher_shape, "; the reference's micro-batches"))  # fmt: skip
    for name, zero, shape, extra in frozen:
        if zero is not None:
            params = shape.classifier_parameters() if name == "reward model" else shape.parameters()
            lines.append(
                f"  {name} {params / 1e6:,.1f} M parameters, {shape.layers} layers, hidden {shape.hidden}, vocab "
                f"{shape.vocab:,} (its config.json); {zero.describe()}{extra}"
            )
    if dev.kind == "cpu":
        lines.append(f"  CPU: device and host are one memory; a phase needs (device + host) x {i.world_size} rank(s)")
    for phase in plan.phases:
        lines.append(f"  phase {phase.name} ({phase.asleep})")
        lines.append(f"    {'term':36} {'device GiB':>10} {'host GiB':>10}  detail")
        for term in phase.terms:
            if term.device or term.host:
                lines.append(f"    {term.name:36} {_gib(term.device):>10} {_gib(term.host):>10}  {term.note}")
        verdict = (
            "fits"
            if plan.need(phase) <= dev.bytes
            else f"EXCEEDS the device by {(plan.need(phase) - dev.bytes) / GIB:.2f} GiB"
        )
        lines.append(f"    {'total per rank':36} {_gib(phase.device):>10} {_gib(phase.host):>10}  {verdict}")
    lines.append("  " + plan.kv.describe())
    return "\n".join(lines)


def _fits(inputs: PlanInputs, device: Device, phase_name: str) -> bool:
    plan = plan_memory(inputs, device)
    return all(plan.need(p) <= device.bytes for p in plan.phases if p.name == phase_name)


def _largest(low: int, high: int, fits: Any) -> int | None:
    """The largest value in ``[low, high]`` for which ``fits(value)`` holds (it holds for every smaller one too);
    None when not even ``low`` does."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _largest_micro_batch(inputs: PlanInputs, device: Device, phase: str, field: str) -> int | None:
    """The largest micro-batch (rows, or token budget) of ``field`` (a Pass of ``inputs``) with which ``phase``
    fits; None when not even the smallest does."""
    current: Pass = getattr(inputs, field)
    attr = "budget" if current.budget is not None else "rows"
    length = inputs.reward_length if field == "reward_pass" else inputs.prompt_length + inputs.response_length
    smallest = length if attr == "budget" else 1

    def fits(value: int) -> bool:
        return _fits(
            dataclasses.replace(inputs, **{field: dataclasses.replace(current, **{attr: value})}), device, phase
        )

    return _largest(smallest, getattr(current, attr), fits)


# The micro-batch keys of each phase: (count key, budget key, PlanInputs field).
_MICRO_KEYS = {
    "reward": ("reward_model.micro_batch_size_per_gpu", "reward_model.forward_max_token_len_per_gpu", "reward_pass"),
    "old_log_prob": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "old_log_prob"),
    "ref": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "ref_pass"),
    "teacher": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "teacher_pass"),
    "values": ("critic.forward_micro_batch_size_per_gpu", "critic.forward_max_token_len_per_gpu", "critic_values"),
    "update_critic": ("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu", "critic_update"),
    "update_actor": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "update"),
}  # fmt: skip
# Each role's DeepSpeed key, by its PlanInputs field; the frozen ones' offloaded setup is zero3_offload_inference.
_ROLE_KEYS = {"actor": "actor_rollout_ref.actor.deepspeed_config", "critic": "critic.deepspeed_config",
              "ref": "actor_rollout_ref.ref.deepspeed_config", "reward_model": "reward_model.deepspeed_config",
              "teacher": "distillation.teacher_models.teacher_model.deepspeed_config"}  # fmt: skip
_FROZEN_ROLES = ("ref", "reward_model", "teacher")


def fixes(plan: Plan, phase: Phase) -> list[str]:
    """What makes ``phase`` fit, each checked against the plan: the largest micro-batch or budget that fits (or
    prompts per generate call), gradient checkpointing, offloading the engines' states, a lower
    ``gpu_memory_utilization``."""
    i, device = plan.inputs, plan.device
    found = []
    if i.rollout == "vllm" and (phase.name == "rollout" or phase.name == "reward" and i.reward_in_generation):
        others = phase.device - sum(t.device for t in phase.terms if t.name.startswith("vLLM"))
        utilization = (device.bytes - others) / device.bytes
        if utilization > 0:
            found.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={int(utilization * 100) / 100} "
                         f"(leaves {kv_tokens_at(i, device, utilization):,} KV tokens)")  # fmt: skip
    if phase.name == "rollout" and i.rollout == "hf":
        prompts = _largest(
            1, i.hf_micro_batch, lambda k: _fits(dataclasses.replace(i, hf_micro_batch=k), device, "rollout")
        )
        if prompts is not None and prompts < min(i.hf_micro_batch, i.prompts_per_rank):
            found.append(f"actor_rollout_ref.rollout.micro_batch_size={prompts}")
    if phase.name in _MICRO_KEYS:
        count_key, budget_key, field = _MICRO_KEYS[phase.name]
        largest = _largest_micro_batch(i, device, phase.name, field)
        if largest is not None and largest < max(getattr(i, field).rows, getattr(i, field).budget or 0):
            found.append(f"{budget_key if getattr(i, field).budget is not None else count_key}={largest}")
    if phase.name == "update_actor" and not i.actor_checkpointing:
        # The config refuses gradient checkpointing beside shared prompt forwards: packed rows keep their saving.
        shared = i.layout == "shared_prompts"
        changed = dataclasses.replace(i, actor_checkpointing=True, layout="dedup" if shared else i.layout)
        if _fits(changed, device, phase.name):
            dedup = (
                " actor_rollout_ref.model.shared_prompt_forward=false actor_rollout_ref.model.use_remove_padding=true"
                " actor_rollout_ref.actor.use_prefix_grouper=true"
                if shared
                else ""
            )
            found.append(f"actor_rollout_ref.model.enable_gradient_checkpointing=true{dedup}")
    fused = dataclasses.replace(i, fused_head=True)
    if (
        phase.name in ("old_log_prob", "ref", "teacher", "update_actor")
        and not i.fused_head
        and _fits(fused, device, phase.name)
    ):
        found.append("actor_rollout_ref.actor.use_fused_kernels=true")
    critic_checkpointed = dataclasses.replace(i, critic_checkpointing=True)
    if phase.name == "update_critic" and not i.critic_checkpointing and _fits(critic_checkpointed, device, phase.name):
        found.append("critic.model.enable_gradient_checkpointing=true")
    for role, key in _ROLE_KEYS.items():
        zero = getattr(i, role)
        if zero is None or zero.offload_param:
            continue
        name = "zero3_offload_inference" if role in _FROZEN_ROLES else "zero3_offload"  # the shipped offload setups
        offloaded = dataclasses.replace(i, **{role: ZeroSetup.from_json(read_ds_json(name, key))})
        if _fits(offloaded, device, phase.name):
            found.append(f"{key}={name}")
    return found or ["a larger device, more ranks (ZeRO partitions shrink with the world size) or shorter sequences"]


def kv_tokens_at(inputs: PlanInputs, device: Device, utilization: float) -> int:
    """vLLM's KV tokens per engine at ``utilization``."""
    return rollout_terms(dataclasses.replace(inputs, gpu_memory_utilization=utilization), device)[1].tokens


def plan_problems(plan: Plan) -> list[str]:
    """One line per phase that does not fit, with its fixes (``trainer.memory_plan_check``'s report)."""
    lines = []
    for phase in plan.over():
        lines.append(
            f"trainer.memory_plan_check: phase {phase.name} needs {plan.need(phase) / GIB:.2f} GiB, more than the "
            f"{plan.device.bytes / GIB:.2f} GiB of the {plan.device.kind} device; fix: "
            f"{' or '.join(fixes(plan, phase))}"
        )
    return lines
