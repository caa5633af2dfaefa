"""The memory plan (dsrl.plan, dsrl-train --plan): its arithmetic on hand-computed cases, the shapes it reads
against real models' parameter counts, the refusal of --validate-only and trainer.memory_plan_check, the CLI."""

import dataclasses
import json
from pathlib import Path

import pytest

from dsrl import config as C
from dsrl.plan.inputs import Device, Pass, ZeroSetup, inputs_from_config, parse_size
from dsrl.plan.plan import _fits, plan_for_config, plan_memory, plan_problems
from dsrl.plan.shape import GIB, read_shape
from dsrl.plan.terms import log_prob_head, model_states, update_gradients
from tests.conftest import QUICKSTART, recipe, run_train_without_torch

REPO = Path(__file__).resolve().parents[2]
QWEN_05B = REPO / "bench" / "model_shapes" / "Qwen2.5-0.5B-Instruct.json"
QWEN3_8B = REPO / "bench" / "model_shapes" / "Qwen3-8B.json"
H200 = Device("cuda", 141 * GIB, "test")


def zero(stage, *, offload_param=False, offload_optimizer=False, grad_accum_dtype="fp32"):
    return ZeroSetup(stage, offload_param, offload_optimizer, False, 50_000_000, 50_000_000, 10**9, grad_accum_dtype)


def totals(terms):
    return {term.name.removeprefix("actor "): (term.device, term.host) for term in terms}


# ---------------------------------------------------------------- arithmetic


def test_zero3_bf16_states_of_a_7b_model_on_8_ranks_are_18_bytes_per_parameter_over_8():
    P = 7_000_000_000
    states = totals(model_states("actor", zero(3), P, P, 2, 8))
    assert states == {
        "parameters": (2 * P // 8, 0),  # 1.75 GB
        "gradients": (4 * P // 8, 0),  # the fp32 accumulation partition (grad_accum_dtype fp32)
        "fp32 master weights": (4 * P // 8, 0),
        "Adam moments": (8 * P // 8, 0),
    }
    assert sum(device for device, _ in states.values()) == 18 * P // 8  # 15.75 GB


def test_offload_moves_zero3_states_to_the_host_and_zero2_keeps_full_parameters_on_the_device():
    P = 7_000_000_000
    offloaded = totals(model_states("actor", zero(3, offload_param=True, offload_optimizer=True), P, P, 2, 8))
    assert all(device == 0 for device, _ in offloaded.values())
    assert sum(host for _, host in offloaded.values()) == 18 * P // 8
    stage2 = totals(model_states("actor", zero(2), P, P, 2, 8))
    assert stage2["parameters"] == (2 * P, 0)  # stages 0-2 replicate the weights
    assert "gradients" not in stage2  # the optimizer step frees them: only an update holds them
    stage2 |= totals(update_gradients("actor", zero(2), P, 2, 8))
    assert sum(device for device, _ in stage2.values()) == 2 * P + 18 * P // 8  # DeepSpeed's estimator's factors
    assert totals(update_gradients("actor", zero(3), P, 2, 8)) == {"fp32 gradient copy": (4 * P // 8, 0)}  # the step's
    half_offloaded = totals(model_states("actor", zero(2, offload_optimizer=True), P, P, 2, 8))
    assert half_offloaded["Adam moments"] == (0, 8 * P // 8) and half_offloaded["parameters"] == (2 * P, 0)


def test_a_float32_zero3_model_trains_its_partition_in_place_and_the_reference_has_parameters_only():
    P = 1_000_000
    fp32 = totals(model_states("actor", zero(3), P, P, 4, 2))
    assert "fp32 master weights" not in fp32 and fp32["parameters"] == (4 * P // 2, 0)
    assert totals(model_states("ref", zero(3, offload_param=True), P, 0, 2, 4)) == {"ref parameters": (0, 2 * P // 4)}


def test_shapes_give_the_published_parameter_counts():
    assert read_shape("", str(QWEN_05B)).parameters() == 494_032_768  # Qwen2.5-0.5B (tied embeddings)
    assert read_shape("", str(QWEN3_8B)).parameters() == 8_190_735_360  # Qwen3-8B
    assert read_shape("", str(QWEN3_8B)).kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2  # 144 KiB


def test_the_tiny_model_has_as_many_parameters_as_its_shape_says(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shape = read_shape(str(tiny_model_dir))
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    assert shape.parameters(lm_head=False) == sum(p.numel() for p in model.model.parameters())  # a critic's backbone


def test_the_log_prob_head_holds_three_logit_tensors_in_an_update_and_one_without_gradients(grpo_inputs):
    shape = read_shape("", str(QWEN_05B))
    inputs = grpo_inputs()
    assert (inputs.prompt_length, inputs.response_length) == (512, 1024)
    logits = 40 * 1025 * 151_936 * 2  # 40 rows x (1,024 + 1) positions x vocab, bf16: 12.5 GB
    chunks = 3 * 4 * 2**26
    assert log_prob_head(shape, Pass(rows=40), inputs, grad=True, layout="padded").device == 3 * logits + chunks
    assert log_prob_head(shape, Pass(rows=40), inputs, grad=False, layout="padded").device == logits + chunks
    fused = dataclasses.replace(inputs, fused_head=True)  # one chunk of 441 positions at a time
    chunk = 2**26 // 151_936 * 151_936
    weight = 151_936 * 896 * 2  # the second output-layer gradient that autograd sums the chunks' into
    head = log_prob_head(shape, Pass(rows=40), fused, grad=True, layout="padded")
    assert head.device == 2 * chunk * 2 + 3 * 4 * chunk + weight  # 1.25 GiB against 35.6 GiB unfused
    assert log_prob_head(shape, Pass(rows=40), fused, grad=False, layout="padded").device == chunk * 2 + 3 * 4 * chunk


def test_the_constants_restated_without_torch_match_the_engines():
    from dsrl.engines.forward import CHUNK_ELEMENTS
    from dsrl.engines.weight_sync import DEFAULT_BUCKET_BYTES
    from dsrl.plan.terms import LOGIT_CHUNK_ELEMENTS, PUSH_BUCKET_BYTES

    assert (LOGIT_CHUNK_ELEMENTS, PUSH_BUCKET_BYTES) == (CHUNK_ELEMENTS, DEFAULT_BUCKET_BYTES)


@pytest.mark.parametrize(
    "text, size", [("141GiB", 141 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5", int(1.5 * 2**30))]
)
def test_sizes_parse_with_binary_and_decimal_units(text, size):
    assert parse_size(text) == size


def test_a_mixture_of_experts_config_is_refused_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(QWEN_05B.read_text()), "num_experts": 64}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        read_shape(str(tmp_path))


# ---------------------------------------------------------------- plans of recipes


@pytest.fixture
def data_files(arithmetic_data):
    """The recipes' plans need data files that validate; the prompts themselves do not matter."""
    return [f"data.train_files={arithmetic_data / 'train.parquet'}", "data.val_files=null"]


@pytest.fixture
def grpo_inputs(data_files):
    """``grpo_inputs(*overrides)``: the plan's inputs of configs/grpo.yaml with vLLM on 8 H200s, Qwen2.5-0.5B."""

    def make(*overrides):
        cfg, _ = C.load_and_validate(["grpo"], [*data_files, "actor_rollout_ref.rollout.name=vllm", *overrides], 8)
        return inputs_from_config(cfg, 8, read_shape("", str(QWEN_05B)), H200)

    return make


def test_packed_rows_count_one_prompt_per_group_with_dedup_and_fill_a_token_budget(grpo_inputs):
    from dsrl.plan.terms import micro_batch_tokens

    padded = ("actor_rollout_ref.model.use_remove_padding=false",)
    packed = ("actor_rollout_ref.model.use_remove_padding=true",)  # configs/grpo.yaml's
    dedup = (*packed, "actor_rollout_ref.actor.use_prefix_grouper=true")
    inputs = {
        layout: grpo_inputs(*extra) for layout, extra in (("padded", padded), ("packed", packed), ("dedup", dedup))
    }
    assert {layout: i.layout for layout, i in inputs.items()} == {k: k for k in inputs}
    P, R, n = 512, 1024, inputs["dedup"].n  # configs/grpo.yaml: n = 5
    assert micro_batch_tokens(inputs["padded"], Pass(rows=10), "padded") == (10, 10 * (P + R))
    assert micro_batch_tokens(inputs["packed"], Pass(rows=10), "packed") == (10, 10 * (P + R))
    assert micro_batch_tokens(inputs["dedup"], Pass(rows=10), "dedup") == (10, -(-10 // n) * P + 10 * R)
    # A 16,384-token budget: 10 full-length rows padded or packed; with one prompt per group of 5, 14 rows
    # (3 prompts + 14 responses = 15,872 tokens; a 15th response would pass the budget).
    assert micro_batch_tokens(inputs["packed"], Pass(rows=64, budget=16_384), "packed") == (10, 10 * (P + R))
    assert micro_batch_tokens(inputs["dedup"], Pass(rows=64, budget=16_384), "dedup") == (14, 3 * P + 14 * R)
    # no more sequences than the rank has rows in the pass
    assert micro_batch_tokens(inputs["packed"], Pass(rows=3, budget=16_384), "packed") == (3, 3 * (P + R))
    assert micro_batch_tokens(inputs["dedup"], Pass(rows=3, budget=16_384), "dedup") == (3, P + 3 * R)
    shape = read_shape("", str(QWEN_05B))
    head = {k: log_prob_head(shape, Pass(rows=10), i, grad=False, layout=k).device for k, i in inputs.items()}
    assert head["packed"] < head["padded"]  # packed rows keep logits only where they predict a response token


def test_grpo_on_8_h200s_fits_with_the_phases_and_kv_budget_of_its_header(grpo_inputs):
    plan = plan_memory(grpo_inputs(), H200)
    assert [phase.name for phase in plan.phases] == ["rollout", "old_log_prob", "ref", "update_actor"]
    assert plan.over() == []
    rollout = {term.name: term for term in plan.phases[0].terms}
    assert rollout["actor Adam moments"].device == 0 and rollout["actor Adam moments"].host > 0  # moved for vLLM
    assert plan.kv.needed == 5 * (1024 // 8) * (512 + 1024)  # n x prompts per rank x (prompt + response)
    assert plan.kv.tokens > plan.kv.needed


def test_the_rollout_holds_a_round_of_dynamic_sampling(grpo_inputs):
    """With algorithm.filter_groups a round generates data.gen_batch_size prompts (null: train_batch_size)."""
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"]
    assert grpo_inputs(*on).prompts_per_rank == 1024 // 8
    assert grpo_inputs(*on, "data.gen_batch_size=3072").prompts_per_rank == 3072 // 8


def test_a_phase_over_the_device_is_refused_with_a_micro_batch_that_fits(grpo_inputs):
    inputs = grpo_inputs()
    device = Device("cuda", 24 * GIB, "test")
    plan = plan_memory(inputs, device)
    assert "update_actor" in [phase.name for phase in plan.over()]
    line = next(line for line in plan_problems(plan) if "phase update_actor" in line)
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="
    assert line.startswith("trainer.memory_plan_check: phase update_actor needs ") and key in line
    micro = int(line.split(key)[1].split()[0])
    assert 1 <= micro < 40
    assert _fits(dataclasses.replace(inputs, update=Pass(rows=micro)), device, "update_actor")
    assert not _fits(dataclasses.replace(inputs, update=Pass(rows=micro + 1)), device, "update_actor")


def test_vllm_beside_zero2_parameters_is_told_the_utilization_that_fits(grpo_inputs):
    inputs = dataclasses.replace(grpo_inputs("actor_rollout_ref.rollout.gpu_memory_utilization=0.999"), actor=zero(2))
    plan = plan_memory(inputs, H200)
    (line,) = [line for line in plan_problems(plan) if "phase rollout" in line]
    utilization = float(line.split("gpu_memory_utilization=")[1].split()[0])
    assert 0.9 < utilization < 0.999
    assert _fits(dataclasses.replace(inputs, gpu_memory_utilization=utilization), H200, "rollout")


def test_lora_has_no_reference_engine_but_a_reference_pass_and_adapter_sized_optimizer_states(data_files):
    cfg, _ = C.load_and_validate(["grpo_lora"], [*data_files, "actor_rollout_ref.rollout.name=vllm"], 8)
    plan = plan_for_config(cfg, 8, H200, str(QWEN_05B))
    assert plan.inputs.ref is None and "ref" in [p.name for p in plan.phases]  # the actor with its adapters off
    update = {term.name: term for term in plan.phases[-1].terms}
    shape = plan.inputs.shape
    assert update["actor Adam moments"].device == 8 * shape.lora_parameters(32, "all-linear") // 8
    assert "ref parameters" not in update
    # While vLLM generates, ZeRO-3 keeps the partition of a frozen base on the device (colocation.offload_targets)
    rollout = {term.name: term for term in plan.phases[0].terms}
    assert rollout["actor parameters"].device == 2 * shape.parameters() // 8 and rollout["actor parameters"].host == 0
    assert rollout["actor Adam moments"].device == 0 and rollout["actor Adam moments"].host > 0


# ---------------------------------------------------------------- the CLI and trainer.memory_plan_check


def test_plan_prints_every_phase_of_the_quickstart_per_rank_without_importing_torch(tiny_model_dir, arithmetic_data):
    files = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arithmetic_data / 'train.parquet'}",
             f"data.val_files={arithmetic_data / 'test.parquet'}"]  # fmt: skip
    result = run_train_without_torch([*QUICKSTART, *files, "--plan", "--world-size", "2"], DS_ACCELERATOR="cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("memory plan: ") and lines[0].endswith("at world size 2")
    assert "2 rank(s); device " in lines[1] and "(cpu, " in lines[1]
    phases = [line.split()[1] for line in lines if line.startswith("  phase ")]
    assert phases == ["rollout", "update_actor"]  # GRPO on-policy: the old-log-prob pass folds into the update
    assert sum(line.strip().startswith("total per rank") and line.endswith("fits") for line in lines) == 2
    assert lines[-1].startswith("  KV cache: ")


def test_validate_only_refuses_a_plan_over_the_device_unless_the_key_says_warn_or_ignore(arithmetic_data, tmp_path):
    args = [*recipe("grpo"), f"data.train_files={arithmetic_data / 'train.parquet'}", "data.val_files=null",
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",  # a hub id: its shape from --model-config
            "--validate-only", "--device-memory", "1GiB", "--model-config", str(QWEN_05B)]  # fmt: skip
    refused = run_train_without_torch(args, HF_HUB_CACHE=str(tmp_path))
    assert refused.returncode == 2 and refused.stdout == ""  # refused before the config is printed
    assert "phase(s) of the memory plan exceed the device" in refused.stderr
    assert "  trainer.memory_plan_check: phase update_actor needs " in refused.stderr
    assert "fix: " in refused.stderr
    warned = run_train_without_torch([*args, "trainer.memory_plan_check=warn"], HF_HUB_CACHE=str(tmp_path))
    assert warned.returncode == 0, warned.stderr
    assert "trainer.memory_plan_check: phase update_actor needs " in warned.stderr
    off = run_train_without_torch([*args, "trainer.memory_plan_check=ignore"], HF_HUB_CACHE=str(tmp_path))
    assert off.returncode == 0 and "memory_plan_check: phase" not in off.stderr
    fits = run_train_without_torch([*args[:-3], "141GiB", "--model-config", str(QWEN_05B)], HF_HUB_CACHE=str(tmp_path))
    assert fits.returncode == 0 and "# memory plan: every phase fits 141.0 GiB (cuda, --device-memory)" in fits.stdout


def test_memory_plan_check_accepts_error_warn_and_ignore_only():
    with pytest.raises(C.ConfigError) as err:
        C.load_and_validate([], ["trainer.memory_plan_check=strict"], 1)
    assert any(line.startswith("trainer.memory_plan_check=strict: must be one of error, warn, ignore; fix: ")
               for line in err.value.violations)  # fmt: skip


def test_a_hub_model_without_a_config_here_is_noted_by_validate_only_and_refused_by_plan(arithmetic_data, tmp_path):
    args = [*recipe("grpo"), f"data.train_files={arithmetic_data / 'train.parquet'}", "data.val_files=null",
            "actor_rollout_ref.model.path=nobody/no-such-model"]  # fmt: skip
    env = {"HF_HUB_CACHE": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    noted = run_train_without_torch([*args, "--validate-only"], **env)
    assert noted.returncode == 0, noted.stderr
    assert "# memory plan: not checked: no config.json for nobody/no-such-model" in noted.stdout
    planned = run_train_without_torch([*args, "--plan"], **env)
    assert planned.returncode == 2 and "--model-config" in planned.stderr


def test_without_a_gpu_or_a_device_size_validate_only_notes_it_and_plan_asks_for_one(arithmetic_data, tmp_path):
    """A machine without GPUs may be checking a config meant for them: it is not planned for its own memory unless
    DS_ACCELERATOR=cpu says the run is for the CPU."""
    args = [*recipe("grpo"), f"data.train_files={arithmetic_data / 'train.parquet'}", "data.val_files=null",
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "--model-config", str(QWEN_05B)]  # fmt: skip
    env = {"DS_ACCELERATOR": "", "PATH": str(tmp_path), "HF_HUB_CACHE": str(tmp_path)}  # no nvidia-smi on the PATH
    noted = run_train_without_torch([*args, "--validate-only", "--world-size", "2"], **env)
    assert noted.returncode == 0, noted.stderr
    assert "# memory plan: not checked: no GPU here (nvidia-smi) and DS_ACCELERATOR is not cpu; fix: " in noted.stdout
    planned = run_train_without_torch([*args, "--plan"], **env)
    assert planned.returncode == 2 and "pass --device-memory SIZE" in planned.stderr


def test_a_sequence_parallel_rank_plans_its_share_of_the_groups_micro_batch(grpo_inputs):
    """SP 2: a group's micro-batch holds twice the per-rank budget (verl's), each rank half its activations and
    head positions; a mask of the micro-batch's tokens squared only where a row holds several sequences."""
    from dsrl.plan.terms import activations

    dynamic = ("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1536")
    one, two = (grpo_inputs(*dynamic, f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}") for sp in (1, 2))
    assert (one.update.budget, two.update.budget, two.sequence_parallel) == (1536, 3072, 2)

    def device(inputs):
        terms = activations(
            inputs, inputs.update, grad=True, checkpointing=True, layout="packed", group=inputs.sequence_parallel
        )
        return {t.name: t.device for t in terms}

    single, double = device(one), device(two)  # 1 sequence of 1,536 tokens; 2 of them, each rank 1,536 tokens
    assert double["activations (checkpointed)"] == single["activations (checkpointed)"]
    assert double["sequence-parallel mask"] == 3072**2 and "sequence-parallel mask" not in single
    assert (
        log_prob_head(two.shape, two.update, two, grad=True, layout="packed").device
        == log_prob_head(one.shape, one.update, one, grad=True, layout="packed").device
    )  # 2 x 1,024 response positions over 2 ranks: 1,024 each, as one rank alone
    halved = dataclasses.replace(two, update=one.update)  # the group's budget holds one sequence: no mask
    assert "sequence-parallel mask" not in device(halved)


def test_a_sequence_parallel_critic_plans_its_share_of_the_groups_micro_batch(data_files):
    """critic.ulysses_sequence_parallel_size=2: the critic's group budget doubles (verl's), and its rank's
    activations in the values and update_critic phases are those of SP 1 at the per-rank budget."""
    from dsrl.plan.plan import plan_memory

    def critic_phases(sp: int) -> dict[str, dict[str, int]]:
        overrides = [
            *data_files,
            "critic.model.use_remove_padding=true",
            "critic.use_dynamic_bsz=true",
            "critic.ppo_max_token_len_per_gpu=1536",
            f"critic.ulysses_sequence_parallel_size={sp}",
        ]
        cfg, _ = C.load_and_validate(["ppo"], overrides, 8)
        inputs = inputs_from_config(cfg, 8, read_shape("", str(QWEN_05B)), H200)
        assert (inputs.critic_update.budget, inputs.critic_sequence_parallel) == (1536 * sp, sp)
        plan = plan_memory(inputs, H200)
        return {
            p.name: {t.name: t.device for t in p.terms} for p in plan.phases if p.name in ("values", "update_critic")
        }

    one, two = critic_phases(1), critic_phases(2)
    for phase in ("values", "update_critic"):
        activations = [name for name in one[phase] if name.startswith("activations")]
        assert activations and all(two[phase][name] == one[phase][name] for name in activations), phase
