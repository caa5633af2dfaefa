"""One check of a colocated ZeRO-3 actor and rollout engine on one device, printed as one table.

    python scripts/gpu_check.py             # Qwen2.5-0.5B's shape, one GPU, < 8 minutes
    python scripts/gpu_check.py --lora 32   # the LoRA case, merged and adapter pushes
    python scripts/gpu_check.py --smoke     # a tiny shape, the same code, seconds on CPU (with --lora too)

Model: Qwen2.5-0.5B's shape with random weights (nothing is downloaded) and the character tokenizer
of ``scripts/make_tiny_model.py``; embedding rows beyond the tokenizer's vocabulary are padding, as in
Qwen's own checkpoints, and like those all but impossible (``silence_vocab_padding``). Inputs are built
in memory (random prompt ids, random advantages): no Trainer, data files or rewards. The actor runs
ds_configs/zero3.json with its optimizer, DeepSpeed's FusedAdam, as every shipped recipe does. FusedAdam
is compiled on first use, which needs the CUDA toolkit (nvcc, ``CUDA_HOME``); where it cannot be, the
recipes cannot start either, and the check says so and exits 2. ``--optimizer adamw`` measures with
torch's AdamW instead, and the header says that the recipes' optimizer was not measured.

Two rounds of: push the actor's weights into the rollout engine and generate
(``colocated_generation``), the actor's log-probs of the responses, a PPO update. Round one warms up
(compilation, allocator) and its update moves the weights, so round two's push carries weights the
rollout engine never loaded; round two is reported, its update timed over ``UPDATE_REPEATS`` calls.
Each generation offloads the actor's DeepSpeed states the phase releases (``offload_targets``) and
reloads them after; on a CPU too (``offload_on_cpu``), where only ``--lora`` has states to move (the
full case's offload config keeps them in host memory). On CUDA the table says how much of them was
still on the device while generating and how much was back after the reload.

The LoRA case (``--lora RANK``; review gpu_path_3 G1, G2): adapters of that rank with alpha = rank on
every linear layer (``target_modules=all-linear``), the frozen base in the check's dtype on the same
ZeRO-3 setup, a smaller batch (``QWEN25_05B_LORA``). One actor, two transformers rollouts: the two
rounds above with merged pushes (``lora.merge=true``, ``W + s·B·A`` cast to the dtype: G2's rounding
shows in the prob diff), then two with adapter pushes into a PEFT copy (``lora.merge=false``). Each
update adds the KL loss to the actor with its adapters off (``AdapterOffReference``), as a LoRA run's
reference is. Rows of each mode carry its name; the table goes to ``$OUT/gpu_check_lora.json``.

MFU = 6 * N * tokens / seconds / peak bf16 dense FLOP/s, the 6N convention: N counts every parameter
once (the tied LM head included), tokens are the batch's valid prompt + response tokens; the
recomputation of gradient checkpointing and the attention scores are not counted. The peak comes
from the device name (``PEAK_BF16_FLOPS``) or the environment variable ``PEAK_TFLOPS``.

Rollout: vLLM with sleep mode when ``vllm`` imports and CUDA is present, else transformers
``generate``; the header says which and why. The table also goes to ``$OUT/gpu_check.json``
(default ``outputs/gpu_check``). Exit codes: 0 done (or no CUDA device without ``--smoke``); 2 with
one line on stderr: a package of ``REQUIRED`` missing (``WHEELS=dir bash scripts/gpu_check.sh`` installs
them from a folder that ``bench/gpu_wheels.sh`` builds), or FusedAdam not compiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# What the check imports beyond torch, with pip names (traced with sys.modules after a --smoke run; the
# packages these pull in come with them from pip). accelerate: transformers' DeepSpeed integration imports it.
REQUIRED = {
    "numpy": "numpy",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "huggingface_hub": "huggingface_hub",
    "deepspeed": "deepspeed",
    "accelerate": "accelerate",
    "omegaconf": "omegaconf",
    "yaml": "pyyaml",
    "psutil": "psutil",
    "peft": "peft",  # the LoRA case (--lora)
}
# Dense bf16 FLOP/s by device-name substring, first match wins (SXM parts unless named).
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
UPDATE_REPEATS = 3
GIB = 2**30


@dataclass(frozen=True)
class CheckSize:
    """Model shape and batch of one check."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # rows of the (tied) embedding; those past the tokenizer's vocabulary are padding
    prompts: int
    prompt_length: int
    n: int  # responses per prompt
    max_tokens: int  # response length cap
    micro_batch: int  # sequences per actor forward (update and log-probs)
    dtype: str
    deepspeed_config: str
    gradient_checkpointing: bool


QWEN25_05B = CheckSize(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    prompts=64,
    prompt_length=128,
    n=4,
    max_tokens=512,  # random weights rarely emit EOS: responses run to the cap, steady throughput
    micro_batch=32,
    dtype="bfloat16",
    deepspeed_config="zero3",
    gradient_checkpointing=True,
)
# head_dim 64: the smallest vLLM's attention backends all take, should --smoke meet a GPU with vLLM.
# The vocabulary is padded past the tokenizer's, as the full shape's is.
SMOKE = CheckSize(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=256,
    prompts=4,
    prompt_length=8,
    n=2,
    max_tokens=8,
    micro_batch=4,
    dtype="float32",  # exact log-prob agreement; CPU runs use the offload config
    deepspeed_config="zero3_offload",
    gradient_checkpointing=True,
)
# The LoRA case (--lora) checks colocation and the pushes rather than throughput: a smaller batch of the same shape.
QWEN25_05B_LORA = dataclasses.replace(QWEN25_05B, prompts=16, max_tokens=128)
# zero3, whose states are on the "device": the CPU runs the offload and reload a GPU does (the offload config keeps
# them in host memory, with nothing to offload).
SMOKE_LORA = dataclasses.replace(SMOKE, deepspeed_config="zero3")


def missing_packages() -> list[str]:
    """Pip names of the ``REQUIRED`` modules that do not import; a module that is there but misses one of
    its own dependencies is named with that dependency."""
    missing = []
    for module, package in REQUIRED.items():
        try:
            importlib.import_module(module)
        except ImportError as err:
            lacking = (err.name or "").split(".")[0]
            missing.append(package if lacking in ("", module) else f"{package} (needs {lacking})")
    return missing


def choose_rollout(on_cuda: bool) -> tuple[str, str]:
    """(``actor_rollout_ref.rollout.name``, why) for this machine."""
    if not on_cuda:
        return "hf", "no CUDA device: transformers rollout"
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        why = "vllm not installed" if err.name == "vllm" else f"vllm does not import ({err})"
        return "hf", f"{why}: transformers rollout"
    return "vllm", "vllm rollout with sleep mode"


@torch.no_grad()
def silence_vocab_padding(model: torch.nn.Module, vocab_size: int) -> None:
    """Give the output rows past the tokenizer's ``vocab_size`` logits far below every token's (~40 at
    Qwen2.5-0.5B's shape), as a trained Qwen's padding rows have. The rollout engines never sample those
    ids and normalise over the tokens only, while the actor's softmax covers every row: with random
    padding rows holding almost all the probability, the two would differ by ~log(rows / vocab_size)
    nats instead of by rounding.

    How: hidden channel 0 carries a constant no layer writes to (every token's embedding sets it to 1;
    the rows of ``o_proj`` and ``down_proj`` that write it are zero), and the tied padding rows read it
    with weight -100."""
    embedding = model.get_input_embeddings().weight  # tied: also the output layer
    embedding[:vocab_size, 0] = 1.0
    embedding[vocab_size:, 0] = -100.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0].zero_()
        layer.mlp.down_proj.weight[0].zero_()


def save_random_model(size: CheckSize, out: Path) -> int:
    """A randomly initialised Qwen2 of ``size`` and the character tokenizer in ``out``; returns N."""
    from make_tiny_model import build_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 4096
    config = Qwen2Config(
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        vocab_size=size.vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=1e6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, size.dtype))
    if config.vocab_size > len(tokenizer):
        silence_vocab_padding(model, len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model.num_parameters()


def random_prompts(tokenizer_dir: Path, size: CheckSize) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-length prompts of random non-special tokens: ids and mask ``[prompts, prompt_length]``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    generator = torch.Generator().manual_seed(0)
    ids = ordinary[torch.randint(len(ordinary), (size.prompts, size.prompt_length), generator=generator)]
    return ids, torch.ones_like(ids)


def op_problem(builder: str) -> str | None:
    """Why DeepSpeed's op ``builder`` (``FusedAdamBuilder``: zero3's GPU optimizer; ``CPUAdamBuilder``: the
    offload configs') cannot load here (it is compiled on first use, which needs the CUDA toolkit for a
    GPU op), or None when it loads."""
    from deepspeed.accelerator import get_accelerator

    try:
        get_accelerator().create_op_builder(builder).load(verbose=False)
    except Exception as err:  # no toolkit, no ninja or a failed compile: each raises its own type
        return f"{type(err).__name__}: {next(iter(str(err).splitlines()), '')}"
    return None


def optimizer_problem(size: CheckSize, optimizer: str) -> str | None:
    """The one-line reason the recipes' optimizer cannot run here (exit 2), or None. Only zero3's
    FusedAdam needs a compiler toolchain the machine may lack; ``--optimizer adamw`` does not use it."""
    if optimizer != "recipe" or size.deepspeed_config != "zero3":
        return None
    problem = op_problem("FusedAdamBuilder")
    if problem is None:
        return None
    return (
        f"DeepSpeed's FusedAdam, the optimizer of ds_configs/{size.deepspeed_config}.json and of every shipped recipe, "
        f"does not build here ({problem}), so no recipe can start on this machine either: install the CUDA "
        f"toolkit of torch's CUDA {torch.version.cuda} (nvcc, CUDA_HOME), or pass --optimizer adamw to measure "
        "with torch's AdamW"
    )


def actor_deepspeed_config(size: CheckSize, optimizer: str, out: Path) -> tuple[str | Path, str]:
    """The actor's DeepSpeed config and a note for the header: ``size.deepspeed_config`` itself, or with
    ``optimizer == "adamw"`` a copy in ``out`` that uses torch's AdamW."""
    if optimizer == "recipe":
        return size.deepspeed_config, ""
    from dsrl.config import deepspeed_config_path

    ds = json.loads(deepspeed_config_path(size.deepspeed_config).read_text())
    ds["optimizer"]["params"]["torch_adam"] = True
    path = out / f"{size.deepspeed_config}_torch_adam.json"
    path.write_text(json.dumps(ds, indent=2))
    return path, " with torch AdamW (--optimizer adamw): the recipes' optimizer was NOT measured"


def run_config(size: CheckSize, model_dir: Path, rollout_name: str, deepspeed_config: str | Path, *extra: str):
    """The run config of ``size``; ``extra`` overrides come last and win."""
    from dsrl.config import load_and_validate

    # data.train_files must look like parquet to validation (its PAR1 framing); nothing reads it here, and the GPU
    # machine may lack pyarrow, so a placeholder with the framing and no rows stands in.
    placeholder = model_dir / "unused.parquet"
    placeholder.write_bytes(b"PAR1" + bytes(4) + b"PAR1")
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.dtype={size.dtype}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(size.gradient_checkpointing).lower()}",
        f"actor_rollout_ref.actor.deepspeed_config={deepspeed_config}",
        # Large enough that round one's update changes the bf16 weights that round two pushes.
        "actor_rollout_ref.actor.optim.lr=1e-4",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={size.prompts}",  # one optimizer step per update
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={size.micro_batch}",
        f"actor_rollout_ref.rollout.n={size.n}",
        f"actor_rollout_ref.rollout.name={rollout_name}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        f"data.train_files={placeholder}",
        f"data.train_batch_size={size.prompts}",
        f"data.max_prompt_length={size.prompt_length}",
        f"data.max_response_length={size.max_tokens}",
        "algorithm.adv_estimator=grpo",
        *extra,
    ]
    if rollout_name == "vllm":
        overrides.append("actor_rollout_ref.rollout.enable_sleep_mode=true")
    cfg, _ = load_and_validate(None, overrides, world_size=1)
    return cfg


class DeviceMemory:
    """torch's peak allocation, and the least free device memory seen at the ``sample`` points
    (the driver's count, which includes vLLM's own memory pool). ``None`` off CUDA."""

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self.min_free_gib: float | None = None

    def sample(self) -> None:
        if self.on_cuda:
            free = torch.cuda.mem_get_info()[0] / GIB
            self.min_free_gib = free if self.min_free_gib is None else min(self.min_free_gib, free)

    def peak_allocated_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / GIB if self.on_cuda else None


def peak_flops(device_name: str) -> float | None:
    if "PEAK_TFLOPS" in os.environ:
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def format_value(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def run(size: CheckSize, optimizer: str, out_dir: Path, started: float, lora_rank: int = 0) -> None:
    """The check at ``size``; ``started`` is the ``time.perf_counter()`` the wall time counts from; ``lora_rank``
    above 0: the LoRA case (the module's docstring)."""
    from deepspeed.accelerator import get_accelerator

    from dsrl.data.batch import Batch
    from dsrl.engines import ActorEngine, init_distributed
    from dsrl.engines.lora import iter_adapter_parameters, iter_merged_parameters, trainable_parameter_count
    from dsrl.engines.reference import AdapterOffReference
    from dsrl.engines.weight_sync import iter_full_parameters
    from dsrl.rollout import HFRollout, SamplingParams
    from dsrl.rollout.colocation import colocated_generation, offload_targets, offloaded_bytes
    from dsrl.trainer.metrics import rollout_logprob_metrics

    accelerator = get_accelerator()
    on_cuda = accelerator.device_name() == "cuda"
    if lora_rank:
        rollout_name, why = "hf", "LoRA: transformers rollouts (a plain copy, a PEFT copy)"
    else:
        rollout_name, why = choose_rollout(on_cuda)
    memory = DeviceMemory(on_cuda)
    sampling = SamplingParams(n=size.n, max_tokens=size.max_tokens, seed=1)
    advantage_generator = torch.Generator().manual_seed(0)

    def states_on_device_gib(actor) -> float | None:
        """GiB of the actor's offload targets (``offloaded_bytes``) on the CUDA device: ~0 while they are
        offloaded, all of them after the reload. None off CUDA, where device and host are one memory."""
        return offloaded_bytes(actor.engine, offload_targets(actor.engine)) / GIB if on_cuda else None

    def generation_round(rollout, push, actor, reference, prompt_ids, prompt_mask) -> tuple[Batch, dict]:
        """Push ``push(actor.module)``, generate, then the actor's log-probs (with a ``reference``, its
        log-probs too) and random per-row advantages; the phase's metrics and where the actor's states were."""
        metrics: dict[str, float | None] = {}
        with colocated_generation(
            rollout,
            weights=lambda: push(actor.module),
            trainer_engines={"actor": actor.engine},
            metrics=metrics,
            offload_on_cpu=True,  # a CPU runs the GPU's offload_states / reload_states calls too
        ):
            out = rollout.generate(prompt_ids, prompt_mask, sampling)
            memory.sample()  # awake: weights and KV cache allocated
            metrics["states_in_generation_gib"] = states_on_device_gib(actor)
        metrics["states_after_reload_gib"] = states_on_device_gib(actor)
        batch = Batch.of_responses(prompt_ids, prompt_mask, out, size.n)
        batch = batch.replace(**actor.compute_log_probs(batch, temperature=sampling.temperature))
        if reference is not None:
            batch = batch.replace(ref_log_probs=reference.compute_log_probs(batch, temperature=sampling.temperature))
        advantages = torch.randn(len(batch), 1, generator=advantage_generator) * batch.response_mask  # [B, T]
        return batch.replace(advantages=advantages), metrics

    def timed_update(actor, batch) -> tuple[float, dict[str, float]]:
        """Seconds and ``actor/*`` metrics of one update."""
        accelerator.synchronize()
        begin = time.perf_counter()
        metrics = actor.update(batch, temperature=sampling.temperature)
        accelerator.synchronize()
        seconds = time.perf_counter() - begin
        memory.sample()  # the caching allocator still holds the update's peak
        return seconds, metrics

    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        model_dir = Path(tmp)
        n_params = save_random_model(size, model_dir)
        prompt_ids, prompt_mask = random_prompts(model_dir, size)
        deepspeed_config, optimizer_note = actor_deepspeed_config(size, optimizer, model_dir)
        reference = None
        if lora_rank:
            lora = (
                f"actor_rollout_ref.model.lora_rank={lora_rank}",
                f"actor_rollout_ref.model.lora_alpha={lora_rank}",
                "actor_rollout_ref.model.target_modules=all-linear",
                "actor_rollout_ref.actor.use_kl_loss=true",  # the update goes through the adapter-off reference
            )
            cfg = run_config(size, model_dir, rollout_name, deepspeed_config, *lora)
            adapter_cfg = run_config(
                size, model_dir, rollout_name, deepspeed_config, *lora, "actor_rollout_ref.model.lora.merge=false"
            )
            init_distributed()
            actor = ActorEngine(cfg)
            reference = AdapterOffReference(cfg, actor)
            # The pushes ActorEngine.rollout_weights makes for lora.merge true and false, into the rollout of each.
            modes = {
                "merged": (HFRollout.from_config(cfg), iter_merged_parameters),
                "adapter": (HFRollout.from_config(adapter_cfg), iter_adapter_parameters),
            }
        else:
            cfg = run_config(size, model_dir, rollout_name, deepspeed_config)
            init_distributed()
            if rollout_name == "vllm":
                from dsrl.rollout.vllm import VLLMRollout

                rollout = VLLMRollout.from_config(cfg)  # before the actor: vLLM sizes itself on an empty device
                actor = ActorEngine(cfg)
            else:
                actor = ActorEngine(cfg)
                rollout = HFRollout.from_config(cfg)
            modes = {"": (rollout, iter_full_parameters)}
        memory.sample()

        # Per mode, round one warms up (compilation, allocator; a rollout's first push) and its update moves the
        # weights, so round two's push carries weights that rollout never held; round two is reported.
        rounds = {}
        for mode, (rollout, push) in modes.items():
            warmup_batch, _ = generation_round(rollout, push, actor, reference, prompt_ids, prompt_mask)
            timed_update(actor, warmup_batch)
            batch, phase = generation_round(rollout, push, actor, reference, prompt_ids, prompt_mask)
            updates = [timed_update(actor, batch) for _ in range(UPDATE_REPEATS)]
            rounds[mode] = batch, phase, rollout_logprob_metrics(batch), updates
        optimizer_name = type(actor.engine.basic_optimizer).__name__
        trained = trainable_parameter_count(actor.module)

    device_name = torch.cuda.get_device_name() if on_cuda else accelerator.device_name()
    peak = peak_flops(device_name)
    table: list[tuple[str, float | None, str]] = [("model parameters", n_params / 1e6, "M")]
    if lora_rank:
        table.append(("trained parameters", trained / 1e6, "M (the adapters)"))
    for mode, (batch, phase, agreement, updates) in rounds.items():
        suffix = f" ({mode} pushes)" if mode else ""
        update_tokens_per_s = batch.attention_mask.sum().item() * len(updates) / sum(s for s, _ in updates)
        rows: list[tuple[str, float | None, str]] = [("actor update throughput", update_tokens_per_s, "tokens/s")]
        if not lora_rank:  # 6N counts the weight gradients, which LoRA's frozen weights do not get
            mfu = None if peak is None else 100 * 6 * n_params * update_tokens_per_s / peak
            rows.append(("actor update MFU (6N)", mfu, "%"))
        rows += [
            ("trainer memory release", phase["timing_s/release_memory"], "s"),
            ("actor states offloaded", phase["perf/offloaded_gib/actor"], "GiB (offload_states, then reload_states)"),
            ("actor states on device in generation", phase["states_in_generation_gib"], "GiB (offloaded: ~0)"),
            ("actor states on device after reload", phase["states_after_reload_gib"], "GiB (reloaded: all)"),
            ("weight push", phase["timing_s/update_weights"], "s"),
            ("rollout wake", phase["timing_s/wake"], "s"),
            ("rollout sleep", phase["timing_s/sleep"], "s"),
            ("memory freed by sleep", phase.get("rollout/sleep_freed_gib"), "GiB"),
            ("generation throughput", batch.response_mask.sum().item() / phase["timing_s/gen"], "tokens/s"),
            ("prob diff mean", agreement["training/rollout_probs_diff_mean"], "|p_rollout - p_actor| (verl's metric)"),
            ("prob diff max", agreement["training/rollout_probs_diff_max"], "|p_rollout - p_actor| (verl's metric)"),
        ]
        if lora_rank:
            rows.append(("KL to the reference", updates[-1][1]["actor/kl_loss"], "the update's KL loss, adapters off"))
        table += [(name + suffix, value, unit) for name, value, unit in rows]
    table += [
        ("peak memory allocated", memory.peak_allocated_gib(), "GiB"),
        ("min free device memory", memory.min_free_gib, "GiB"),
        ("check wall time", time.perf_counter() - started, "s"),
    ]
    if rollout_name == "vllm":
        why += f" level {cfg.actor_rollout_ref.rollout.sleep_level}"
    lora_note = (
        f"; LoRA rank {lora_rank}, alpha {lora_rank}, all-linear, {trained / 1e6:.2f}M trained, merged pushes then "
        "adapter pushes, KL loss to the actor with its adapters off"
        if lora_rank
        else ""
    )
    header = (
        f"[gpu_check] {device_name}; {why}; actor {size.deepspeed_config} ({optimizer_name}){optimizer_note}"
        f"{lora_note}; {size.dtype}, {n_params / 1e6:.1f}M parameters (random weights); "
        f"{size.prompts} prompts x {size.prompt_length} tokens, n={size.n}, {size.max_tokens} new tokens"
    )
    print(header)
    width = max(len(name) for name, _, _ in table)
    for name, value, unit in table:
        print(f"{name:<{width}}  {format_value(value):>12}  {unit}")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "header": header,
        "device": device_name,
        "rollout": rollout_name,
        "metrics": [{"name": name, "value": value, "unit": unit} for name, value, unit in table],
    }
    stem = "gpu_check_lora" if lora_rank else "gpu_check"  # bench/gpu_measure.sh's step names
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shape and batch: the same code on CPU in seconds")
    parser.add_argument(
        "--optimizer",
        choices=("recipe", "adamw"),
        default="recipe",
        help=(
            "recipe: the DeepSpeed config's own (FusedAdam on GPU); adamw: torch's AdamW, where FusedAdam cannot build"
        ),
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="the LoRA case: adapters of this rank (alpha = rank) on every linear layer, merged and adapter pushes",
    )
    args = parser.parse_args(argv)
    if args.lora < 0:
        parser.error(f"--lora {args.lora}: a LoRA rank is > 0 (leave --lora out for full fine-tuning)")
    if not args.smoke and not torch.cuda.is_available():
        print("[gpu_check] no CUDA device; run with --smoke for the CPU smoke test")
        return 0
    missing = missing_packages()
    if missing:
        print(
            f"[gpu_check] missing {', '.join(missing)}: pip install it, or run WHEELS=<folder of wheels> "
            "bash scripts/gpu_check.sh to install it from there (bench/gpu_wheels.sh builds the folder)",
            file=sys.stderr,
        )
        return 2
    if args.lora:
        size = SMOKE_LORA if args.smoke else QWEN25_05B_LORA
    else:
        size = SMOKE if args.smoke else QWEN25_05B
    problem = optimizer_problem(size, args.optimizer)
    if problem:
        print(f"[gpu_check] {problem}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))  # dsrl from this checkout, installed or not
    run(size, args.optimizer, Path(os.environ.get("OUT", "outputs/gpu_check")), started, args.lora)
    return 0


if __name__ == "__main__":
    sys.exit(main())
