"""The memory plan of the frozen models beside the reference: the reward model (``reward_model.*``, phase ``reward``)
and the distillation teacher (``distillation.*``, phase ``teacher``), each read from its own config.json, its
parameters ZeRO-3 partitioned over the ranks (on the host when its JSON offloads them), its gathered layers and its
forward's activations in its own phase; the reward model with the hidden states its score head reads, the teacher
with the reference's log-prob head at its own size. Hand-computed on Qwen2.5-0.5B's shape; --plan's printed output."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dsrl import config as C
from dsrl.plan.inputs import Device, Pass, inputs_from_config
from dsrl.plan.plan import _fits, plan_memory, plan_problems, render
from dsrl.plan.shape import GIB, PlanError, read_shape
from dsrl.plan.terms import log_prob_head
from tests.conftest import QUICKSTART, run_train_without_torch, write_model_stub, write_parquet_stub

REPO = Path(__file__).resolve().parents[2]
QWEN_05B = REPO / "bench" / "model_shapes" / "Qwen2.5-0.5B-Instruct.json"
BASE = json.loads(QWEN_05B.read_text())
H200 = Device("cuda", 141 * GIB, "test")
TEACHER = "distillation.teacher_models.teacher_model.model_path"
P, R = 512, 1024  # configs/grpo.yaml's prompt and response lengths


def reward_model_config(config: dict) -> dict:
    """``config`` as a one-label sequence-classification checkpoint's config.json, as the reward model's rules ask."""
    return {**config, "architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}


@pytest.fixture
def grpo(tmp_path):
    """``grpo(*overrides, world_size=8)``: the plan's inputs of configs/grpo.yaml with vLLM on H200s and Qwen2.5-0.5B
    as the actor; a reward model of the actor's shape at ``tmp_path/rm``, a teacher of twice its hidden and MLP sizes
    at ``tmp_path/teacher`` (model stubs: the plan reads their config.json alone); ``grpo.on_device``: a ZeRO-3
    inference JSON that keeps the parameters on the device."""
    write_parquet_stub(tmp_path / "train.parquet")
    ds = json.loads((REPO / "ds_configs" / "zero3_offload_inference.json").read_text())
    del ds["zero_optimization"]["offload_param"]
    (tmp_path / "zero3_inference.json").write_text(json.dumps(ds))
    rm = write_model_stub(tmp_path / "rm")
    (rm / "config.json").write_text(json.dumps(reward_model_config(BASE)))
    teacher = write_model_stub(tmp_path / "teacher")
    wide = {**BASE, "hidden_size": 2 * BASE["hidden_size"], "intermediate_size": 2 * BASE["intermediate_size"]}
    (teacher / "config.json").write_text(json.dumps(wide))

    def make(*overrides, world_size=8):
        files = [f"data.train_files={tmp_path / 'train.parquet'}", "data.val_files=null"]
        cfg, _ = C.load_and_validate(["grpo"], [*files, "actor_rollout_ref.rollout.name=vllm", *overrides], world_size)
        return inputs_from_config(cfg, world_size, read_shape("", str(QWEN_05B)), H200)

    make.rm = ["reward_model.enable=true", f"reward_model.model.path={rm}"]
    make.teacher = ["distillation.enabled=true", f"{TEACHER}={teacher}"]
    make.on_device = str(tmp_path / "zero3_inference.json")
    return make


def terms_of(plan, phase: str) -> dict:
    (found,) = [p for p in plan.phases if p.name == phase]
    return {term.name: (term.device, term.host) for term in found.terms}


# ---------------------------------------------------------------- the reward model


def test_the_reward_model_holds_its_offloaded_partition_in_every_phase_and_its_forward_in_phase_reward(grpo):
    inputs = grpo(*grpo.rm)
    plan = plan_memory(inputs, H200)
    assert [p.name for p in plan.phases] == ["rollout", "reward", "old_log_prob", "ref", "update_actor"]
    params = 494_032_768 + 896  # Qwen2.5-0.5B's backbone (tied embeddings: no separate LM head) + score 896 -> 1
    assert inputs.reward_shape.classifier_parameters() == params
    for phase in plan.phases:  # zero3_offload_inference: 1/8 of the bf16 parameters, pinned on the host
        assert terms_of(plan, phase.name)["reward model parameters"] == (0, 2 * params // 8), phase.name
    reward = terms_of(plan, "reward")
    tokens = 8 * (P + R)  # reward_model.micro_batch_size_per_gpu rows of prompt + response (max_length null)
    assert reward["activations (no grad)"] == (tokens * inputs.reward_shape.forward_working_bytes(2), 0)
    assert reward["score head"] == (tokens * 896 * 2, 0)  # the last hidden states, bf16; no [b, T, V] logits
    assert "log-prob head" not in reward
    assert reward["reward model gathered parameters"] == (2 * params, 0)  # the whole model: under max live + prefetch
    assert "reward model gathered parameters" not in terms_of(plan, "rollout")  # emptied before a generation


def test_the_reward_models_json_length_and_token_budget_set_its_terms(grpo):
    on_device = plan_memory(grpo(*grpo.rm, f"reward_model.deepspeed_config={grpo.on_device}"), H200)
    params = 494_032_768 + 896
    assert terms_of(on_device, "rollout")["reward model parameters"] == (2 * params // 8, 0)  # partitioned, kept
    four = plan_memory(grpo(*grpo.rm, f"reward_model.deepspeed_config={grpo.on_device}", world_size=4), H200)
    assert terms_of(four, "reward")["reward model parameters"] == (2 * params // 4, 0)
    shorter = grpo(*grpo.rm, "reward_model.max_length=1024")
    assert terms_of(plan_memory(shorter, H200), "reward")["score head"] == (8 * 1024 * 896 * 2, 0)
    budget = grpo(*grpo.rm, "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=4096")
    assert budget.reward_pass == Pass(rows=1024 * 5 // 8, budget=4096)  # every row of the rank, 4,096 tokens each
    assert terms_of(plan_memory(budget, H200), "reward")["score head"] == (2 * (P + R) * 896 * 2, 0)  # 2 rows fit


def test_dynamic_sampling_scores_each_round_beside_the_awake_rollout_engine(grpo):
    fg = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"]
    inputs = grpo(*grpo.rm, *fg, "data.gen_batch_size=1536", "reward_model.micro_batch_size_per_gpu=2000")
    assert inputs.reward_pass == Pass(rows=1536 * 5 // 8)  # a round's rows, not the step's
    plan = plan_memory(inputs, H200)
    assert [p.name for p in plan.phases][:2] == ["rollout", "reward"]
    reward, rollout = terms_of(plan, "reward"), terms_of(plan, "rollout")
    assert reward["vLLM KV cache"] == rollout["vLLM KV cache"] and "weight push bucket" not in reward
    assert reward["actor Adam moments"][0] == 0  # the trained engines stay on the host through every round
    # the next round generates beside the gathered layers the last one's scoring left
    assert rollout["reward model gathered parameters"] == reward["reward model gathered parameters"]


def test_a_reward_phase_over_the_device_is_told_the_micro_batch_that_fits(grpo):
    inputs = grpo(
        *grpo.rm, f"reward_model.deepspeed_config={grpo.on_device}", "reward_model.micro_batch_size_per_gpu=640"
    )
    device = Device("cuda", 24 * GIB, "test")
    plan = plan_memory(inputs, device)
    (line,) = [line for line in plan_problems(plan) if "phase reward " in line]
    key = "reward_model.micro_batch_size_per_gpu="
    rows = int(line.split(key)[1].split()[0])
    assert 1 <= rows < 640
    assert _fits(dataclasses.replace(inputs, reward_pass=Pass(rows=rows)), device, "reward")
    assert not _fits(dataclasses.replace(inputs, reward_pass=Pass(rows=rows + 1)), device, "reward")


# ---------------------------------------------------------------- the teacher


def test_a_teacher_twice_the_actors_width_runs_after_the_reference_with_bigger_terms(grpo):
    inputs = grpo(*grpo.teacher)
    plan = plan_memory(inputs, H200)
    assert [p.name for p in plan.phases] == ["rollout", "old_log_prob", "ref", "teacher", "update_actor"]
    teacher_params = inputs.teacher_shape.parameters()
    assert inputs.teacher_shape.hidden == 2 * 896 and teacher_params > 2 * inputs.shape.parameters()
    assert inputs.teacher_pass == inputs.ref_pass  # actor_rollout_ref.ref.log_prob_*: 80 rows
    ref, teacher = terms_of(plan, "ref"), terms_of(plan, "teacher")
    assert teacher["teacher parameters"] == (0, 2 * teacher_params // 8)  # zero3_offload_inference
    assert ref["teacher parameters"] == teacher["teacher parameters"]  # resident in every phase
    assert "teacher gathered parameters" not in ref  # gathered from its own forward on
    assert teacher["teacher gathered parameters"][0] > teacher["ref gathered parameters"][0]
    assert teacher["activations (no grad)"][0] > ref["activations (no grad)"][0]
    head = log_prob_head(inputs.teacher_shape, inputs.ref_pass, inputs, grad=False, layout=inputs.layout)
    assert teacher["log-prob head"] == (head.device, 0)
    assert teacher["log-prob head"] == ref["log-prob head"]  # the same vocabulary and rows: the same logits


def test_the_teacher_phase_is_told_the_references_keys_and_the_fused_head(grpo):
    inputs = grpo(*grpo.teacher, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=160")
    device = Device("cuda", 48 * GIB, "test")
    (line,) = [line for line in plan_problems(plan_memory(inputs, device)) if "phase teacher " in line]
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=" in line
    assert "actor_rollout_ref.actor.use_fused_kernels=true" in line


def test_a_teacher_that_is_the_actors_model_takes_its_shape_from_model_config(grpo):
    """A hub id not downloaded here: --model-config stands for the actor's model, and so for a teacher that is it."""
    inputs = grpo("distillation.enabled=true", f"{TEACHER}=Qwen/Qwen2.5-0.5B-Instruct")
    assert inputs.teacher_shape == inputs.shape


def test_a_hub_reward_model_without_its_config_here_is_refused_with_its_key(grpo, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(PlanError) as refused:
        grpo("reward_model.enable=true", "reward_model.model.path=nobody/no-such-rm")
    message = str(refused.value)
    assert message.startswith("reward_model.model.path: no config.json for nobody/no-such-rm here")
    assert "`hf download nobody/no-such-rm config.json` (--model-config gives the actor's shape alone)" in message


def test_the_header_names_each_model_with_its_own_shape(grpo):
    text = render(plan_memory(grpo(*grpo.rm, *grpo.teacher), H200), "test")
    lines = text.splitlines()
    assert lines[2] == (
        "  reward model 494.0 M parameters, 24 layers, hidden 896, vocab 151,936 (its config.json); "
        "ZeRO-3, params offloaded; reads 1,536 tokens a sequence"
    )
    assert (
        lines[3].startswith("  teacher ") and "hidden 1792" in lines[3] and "the reference's micro-batches" in lines[3]
    )


# ---------------------------------------------------------------- the tiny models and --plan


@pytest.fixture(scope="module")
def tiny_judges(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A sequence-classification copy of the tiny model (one label) and a teacher of twice its hidden and MLP sizes,
    saved with the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    out = tmp_path_factory.mktemp("judges")
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out / "rm")
    wide = AutoConfig.from_pretrained(tiny_model_dir)
    wide.hidden_size, wide.intermediate_size = 2 * wide.hidden_size, 2 * wide.intermediate_size
    AutoModelForCausalLM.from_config(wide).save_pretrained(out / "teacher")
    for name in ("rm", "teacher"):
        for file in tiny_model_dir.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens")) or file.name == "chat_template.jinja":
                shutil.copy(file, out / name / file.name)
    return out / "rm", out / "teacher"


def test_the_tiny_reward_model_has_as_many_parameters_as_its_shape_says(tiny_judges):
    from transformers import AutoModelForSequenceClassification

    rm_dir, _ = tiny_judges
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    assert read_shape(str(rm_dir)).classifier_parameters() == sum(p.numel() for p in model.parameters())


def test_plan_prints_the_reward_and_teacher_phases_of_the_quickstart(tiny_model_dir, tiny_judges, tmp_path):
    rm_dir, teacher_dir = tiny_judges
    train = write_parquet_stub(tmp_path / "train.parquet")
    args = [*QUICKSTART, f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}",
            "data.val_files=null", "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
            "distillation.enabled=true", f"{TEACHER}={teacher_dir}", "--plan", "--world-size", "2"]  # fmt: skip
    result = run_train_without_torch(args, DS_ACCELERATOR="cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    phases = [line.split()[1] for line in lines if line.startswith("  phase ")]
    assert phases == ["rollout", "reward", "teacher", "update_actor"]  # GRPO on-policy: no old-log-prob pass, no KL
    assert sum(line.strip().startswith("total per rank") and line.endswith("fits") for line in lines) == 4
    assert lines[2].startswith("  reward model ") and "(its config.json); ZeRO-3, params offloaded" in lines[2]
    assert lines[3].startswith("  teacher ") and "hidden 256" in lines[3]
    for term in ("reward model parameters", "reward model gathered parameters", "score head", "teacher parameters",
                 "teacher gathered parameters"):  # fmt: skip
        assert any(line.startswith(f"    {term} ") for line in lines), term
