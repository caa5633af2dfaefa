"""Rollout with transformers ``generate``: a plain (unpartitioned) copy of the policy on each rank.

The CPU default. Each rank samples its own prompts with ``synced_gpus=False`` (generation is
rank-local; the copy is not a ZeRO-3 module, so no rank waits for another), left-padded prompts,
KV cache on. A batch is generated in calls of as many prompts as ``kv_cache_max_gb`` holds the KV cache
of -- n rows of prompt + response tokens each, at the model's KV bytes per token -- and at most
``micro_batch_size``: a prompt count alone would run out of memory with a large model or long responses.
With LoRA the copy takes the merged weights, or is itself a PEFT model whose adapters each push replaces.

Memory. On a device the copy lives there only while generating: ``sleep`` moves it to CPU memory and
``wake_up(["weights"])`` brings it back, so training has the device to itself. On a CPU both do nothing.

Sampling distribution and log-probs: the logits are divided by the temperature, then top-k and
top-p filter them (in that order); each token's log-prob is its log-softmax under that processed
distribution (what vLLM calls ``processed_logprobs``). Greedy decoding (``do_sample=False``)
reports the log-softmax of the raw logits. Rows of the output layer beyond the tokenizer's vocabulary
(Qwen pads its vocabulary) get logits -inf first: no token, never sampled. The warpers are applied by
dsrl's own logits-processor list, the last entry of which records the chosen tokens' log-probs one step
later, so no ``[B, T, V]`` score history is kept.

Determinism: with ``sampling.seed`` set, each ``generate`` call runs inside ``torch.random.fork_rng``
seeded with it (call ``k`` of a batch with ``seed + k * CHUNK_SEED_STRIDE``): the same seed, weights and
prompts give the same samples, and the caller's global RNG streams are left untouched.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dsrl.algorithms import logprobs_from_logits
from dsrl.config import pushes_lora_adapters
from dsrl.data.batch import left_pad
from dsrl.engines.forward import kv_cache
from dsrl.engines.lora import add_adapters
from dsrl.engines.routers import RouteRecorder
from dsrl.engines.weight_sync import CheckpointTargets
from dsrl.plan.shape import kv_bytes_per_token
from dsrl.rollout.base import (
    PartialRow,
    RolloutOutput,
    RowProgress,
    SamplingParams,
    StopCheck,
    seeded,
    stop_and_pad_ids,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


CHUNK_SEED_STRIDE = 1_000_003  # seeds of successive generate calls of one batch


class _MaskPaddedVocab(LogitsProcessor):
    """Logits of ids >= ``vocab_size`` (output-layer padding, no token) become -inf."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.index_fill(
            -1, torch.arange(self.vocab_size, scores.shape[-1], device=scores.device), float("-inf")
        )


class _ChosenTokenLogProbs(LogitsProcessor):
    """Last logits processor: keeps the processed scores of one step to read the chosen token's
    log-prob at the next step (the chosen token is then the last column of ``input_ids``)."""

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.log_probs: list[torch.Tensor] = []  # one [B*n] tensor per generated token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.record(input_ids[:, -1])
        self.previous = scores
        return scores

    def record(self, chosen: torch.Tensor) -> None:
        self.log_probs.append(logprobs_from_logits(self.previous, chosen))


def _own_memory(model: torch.nn.Module) -> None:
    """Copy ``model``'s tensors out of the checkpoint's memory-mapped files. transformers leaves the parameters it
    did not convert as views of the mapped safetensors, which keeps the mapping, and every page it read to build
    the others (a mixture of experts' per-expert tensors, fused at load: 339 MiB of the 93 M wide MoE), resident
    for as long as the copy lives: memory the plan does not count and the run does not use."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()


class HFRollout:
    """``generate`` with a transformers model loaded from ``model_path`` (local dir or hub id).

    ``dtype``: ``bfloat16`` or ``float32`` (use the trainer's ``actor_rollout_ref.model.dtype`` so
    the rollout and trainer log-probs agree). EOS ids are the tokenizer's EOS plus the model's
    ``generation_config.eos_token_id``; responses are padded with the tokenizer's pad id (EOS
    when it has none). The model's own generation defaults (sampling settings, penalties) are
    dropped: only ``SamplingParams`` decide how to sample.
    """

    static_memory = False  # generation's memory grows with the batch: offloading training states helps it

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        trust_remote_code: bool = False,
        micro_batch_size: int = 64,
        kv_cache_max_gb: float | None = None,
        adapters: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        record_routes: bool = False,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"actor_rollout_ref.rollout.micro_batch_size={micro_batch_size}: must be >= 1")
        self.micro_batch_size = micro_batch_size
        self.kv_cache_max_bytes = None if kv_cache_max_gb is None else kv_cache_max_gb * 1e9
        self.device = torch.device(get_accelerator().current_device_name())
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
        self.model.eval().requires_grad_(False)
        if self.device.type == "cpu":  # on a device, moving the copy there does the same
            _own_memory(self.model)
        self.vocab_size = len(tokenizer)  # ids the rollout may sample
        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(
            tokenizer, self.model.generation_config.eos_token_id, model_path
        )
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id, bos_token_id=tokenizer.bos_token_id
        )
        if adapters is not None:  # a PEFT copy: pushes bring its adapters only
            self.model = adapters(self.model).eval().requires_grad_(False)
        adapter_names = None if adapters is None else {n for n, _ in self.model.named_parameters() if ".lora_" in n}
        self.pushed = CheckpointTargets(self.model, adapter_names)
        generator = self.model.get_base_model() if adapters is not None else self.model  # what generate calls
        self.routes = RouteRecorder(generator) if record_routes else None

    @classmethod
    def from_config(cls, cfg: Any) -> HFRollout:
        """Built from the run config (``actor_rollout_ref.{model,rollout}``): the actor's model and dtype; a PEFT
        copy with the actor's adapters when LoRA pushes adapters (``model.lora.merge=false``)."""
        model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
        return cls(
            model.path,
            dtype=model.dtype,
            trust_remote_code=model.trust_remote_code,
            micro_batch_size=rollout.micro_batch_size,
            kv_cache_max_gb=rollout.kv_cache_max_gb,
            adapters=partial(add_adapters, model_cfg=model) if pushes_lora_adapters(model) else None,
            record_routes=rollout.enable_rollout_routing_replay,
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model's parameters in place (names and shapes as in the model's checkpoint,
        ``dsrl.engines.weight_sync.checkpoint_format``; a tied LM head is updated through its embedding); a PEFT
        copy takes its adapters only, named as in ``named_parameters``. Consumes the whole iterator even when a name
        or a shape is wrong, since producing it is a collective on every rank, then raises."""
        targets = self.pushed.names()
        unknown, misshaped, seen = [], [], set()
        for name, tensor in named_tensors:
            if name not in targets:
                unknown.append(name)
                continue
            try:
                self.pushed.write(name, tensor)
            except ValueError as err:  # the shape: CheckpointTargets.write's one refusal
                misshaped.append(str(err))
            seen.add(name)
        missing = sorted(targets - seen)
        if unknown or missing or misshaped:
            raise ValueError(
                f"update_weights: unknown names {unknown[:5]}, parameters not received {missing[:5]}"
                + "".join(f"; {line}" for line in misshaped[:5])
            )

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes in every layer (``dsrl.plan.shape.kv_bytes_per_token``)."""
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return kv_bytes_per_token(config.num_hidden_layers, heads, head_dim, self.model.dtype.itemsize)

    def prompts_per_call(self, prompt_len: int, sampling: SamplingParams) -> int:
        """As many prompts as ``kv_cache_max_gb`` holds the cache of (n rows of ``prompt_len`` +
        ``max_tokens`` each), at most ``micro_batch_size``, at least one."""
        if self.kv_cache_max_bytes is None:
            return self.micro_batch_size
        per_prompt = sampling.n * (prompt_len + sampling.max_tokens) * self.kv_bytes_per_token()
        return max(1, min(self.micro_batch_size, int(self.kv_cache_max_bytes // per_prompt)))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams) -> RolloutOutput:
        """``sampling.n`` responses per left-padded prompt ``[B, P]``; see ``RolloutOutput``."""
        outputs = []
        size = self.prompts_per_call(prompt_ids.shape[1], sampling)
        for call, start in enumerate(range(0, len(prompt_ids), size)):
            chunk = slice(start, start + size)
            seed = None if sampling.seed is None else sampling.seed + call * CHUNK_SEED_STRIDE
            outputs.append(self._generate(prompt_ids[chunk], prompt_mask[chunk], sampling.replace(seed=seed)))
        if len(outputs) == 1:
            return outputs[0]
        return RolloutOutput(
            torch.cat([o.response_ids for o in outputs]),
            torch.cat([o.response_mask for o in outputs]),
            torch.cat([o.log_probs for o in outputs]),
            [reason for o in outputs for reason in o.finish_reasons],
            prompt_routes=None if self.routes is None else torch.cat([o.prompt_routes for o in outputs]),
            response_routes=None if self.routes is None else torch.cat([o.response_routes for o in outputs]),
        )

    @torch.no_grad()
    def generate_until(
        self, rows: Sequence[PartialRow], sampling: SamplingParams, *, chunk_tokens: int, stop: StopCheck
    ) -> list[RowProgress]:
        """Continue each row in chunks of ``chunk_tokens`` tokens until ``stop`` says enough (``RolloutEngine``).

        A chunk is one ``generate`` over the unfinished rows, each row's prompt and tokens so far as its prompt
        (left-padded; no cache is kept between chunks, so each chunk prefills again), seeded with ``sampling.seed``
        and the chunk's number. A row that ended in the chunk leaves the next one: the rows still running do not
        pay for those that stopped, which a single ``generate`` over the batch does."""
        if sampling.n != 1:
            raise ValueError(f"generate_until continues single responses: sampling.n={sampling.n}, must be 1")
        progress = [RowProgress(finished=len(row.tokens) >= row.max_tokens) for row in rows]
        for chunk in itertools.count():
            live = [i for i, p in enumerate(progress) if not p.finished]
            if live:
                seed = None if sampling.seed is None else sampling.seed + chunk * CHUNK_SEED_STRIDE
                self._continue(rows, progress, live, sampling.replace(seed=seed), chunk_tokens)
            if stop([p.finished for p in progress]):
                return progress
        raise AssertionError("unreachable")  # itertools.count never ends

    def _continue(
        self,
        rows: Sequence[PartialRow],
        progress: list[RowProgress],
        live: list[int],
        sampling: SamplingParams,
        chunk_tokens: int,
    ) -> None:
        """One chunk of ``generate_until``: at most ``chunk_tokens`` more tokens for each row of ``live``."""
        room = {i: rows[i].max_tokens - len(rows[i].tokens) - len(progress[i].tokens) for i in live}
        sampling = sampling.replace(max_tokens=min(chunk_tokens, max(room.values())))
        sequences = [(*rows[i].prompt, *rows[i].tokens, *progress[i].tokens) for i in live]
        size = self.prompts_per_call(max(map(len, sequences)), sampling)
        for call, start in enumerate(range(0, len(live), size)):
            ids, mask = left_pad(sequences[start : start + size], self.pad_token_id)
            seed = None if sampling.seed is None else sampling.seed + call
            out = self._generate(ids, mask, sampling.replace(seed=seed))
            for j, i in enumerate(live[start : start + size]):
                valid = int(out.response_mask[j].sum())  # up to and including an EOS
                length = min(valid, room[i])
                progress[i].tokens += out.response_ids[j, :length].tolist()
                progress[i].log_probs += out.log_probs[j, :length].tolist()
                progress[i].finished = (out.finish_reasons[j] == "stop" and length == valid) or length == room[i]

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams) -> RolloutOutput:
        processors: list[LogitsProcessor] = []
        if self.vocab_size < self.model.get_output_embeddings().weight.shape[0]:
            processors.append(_MaskPaddedVocab(self.vocab_size))
        if sampling.do_sample:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                processors.append(TopKLogitsWarper(top_k=sampling.top_k))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=sampling.top_p))
        recorder = _ChosenTokenLogProbs()
        # The warpers run as processors, in list order with the recorder last; the config asks for
        # none (temperature 1, top-k 0, top-p 1 when sampling), so generate adds none of its own.
        warper_off = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampling.do_sample else {}
        prompt_len = prompt_ids.shape[1]
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        with nullcontext([]) if self.routes is None else self.routes.recording() as routed:
            sequences = self._sample(prompt_ids, prompt_mask, sampling, processors, recorder, warper_off)
        tokens = sequences[:, prompt_len:]  # [B*n, L]
        recorder.record(tokens[:, -1])
        log_probs = torch.stack(recorder.log_probs, dim=1).float()  # [B*n, L]

        is_eos = torch.isin(tokens, torch.tensor(self.eos_token_ids, device=tokens.device))
        # Valid: every token up to and including the first EOS.
        mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0
        finish_reasons = ["stop" if stopped else "length" for stopped in is_eos.any(1).tolist()]

        T = sampling.max_tokens
        response_ids = torch.full((tokens.shape[0], T), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((tokens.shape[0], T), dtype=torch.long)
        out_log_probs = torch.zeros((tokens.shape[0], T), dtype=torch.float32)
        L = tokens.shape[1]
        response_ids[:, :L] = torch.where(mask, tokens, self.pad_token_id).cpu()
        response_mask[:, :L] = mask.long().cpu()
        out_log_probs[:, :L] = torch.where(mask, log_probs, 0.0).cpu()
        prompt_routes, response_routes = (None, None) if self.routes is None else self._routes(routed, prompt_len, T)
        return RolloutOutput(
            response_ids,
            response_mask,
            out_log_probs,
            finish_reasons,
            prompt_routes=prompt_routes,
            response_routes=response_routes,
        )

    def _sample(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: SamplingParams,
        processors: list[LogitsProcessor],
        recorder: _ChosenTokenLogProbs,
        warper_off: dict,
    ) -> torch.Tensor:
        """``generate``'s sequences ``[B*n, P + L]``: the prompts (each repeated n times), then the samples."""
        shared = {}
        if sampling.n > 1 and prompt_ids.shape[1] > 1:
            # Each prompt's KV cache is computed once for its n samples (vLLM's prefix cache does the same):
            # all but the last prompt token, repeated n times; generate runs on from the last token.
            prefill = self.model(
                input_ids=prompt_ids[:, :-1],
                attention_mask=prompt_mask[:, :-1],
                position_ids=(prompt_mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                logits_to_keep=1,
            )
            name, cache = kv_cache(prefill)
            cache.batch_repeat_interleave(sampling.n)
            prompt_ids, prompt_mask = (
                prompt_ids.repeat_interleave(sampling.n, 0),
                prompt_mask.repeat_interleave(sampling.n, 0),
            )
            shared = {name: cache}
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=sampling.do_sample,
            num_return_sequences=1 if shared else sampling.n,  # shared: the rows are already repeated
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            **warper_off,
        )
        with seeded(sampling.seed, self.device):
            return self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([*processors, recorder]),
                synced_gpus=False,
                **shared,
            )

    def _routes(self, calls: list[torch.Tensor], prompt_len: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded forwards' experts (``RouteRecorder.calls``) in the batch's layout, int16: ``[B*n, P, layers,
        k]`` and ``[B*n, T, layers, k]``. The forwards ran the prompt (a shared prefill once per prompt, then its last
        token on every row) and each sampled token but the last, which no forward ran: -1 there, as past the
        generation's end."""
        rows = calls[-1].shape[0]
        calls = [call.repeat_interleave(rows // call.shape[0], 0) for call in calls]  # a shared prefill: n rows each
        ran = torch.cat(calls, dim=1).to(torch.int16)
        routes = ran.new_full((rows, prompt_len + T, *ran.shape[2:]), -1)
        routes[:, : ran.shape[1]] = ran
        return routes[:, :prompt_len], routes[:, prompt_len:]

    def sleep(self) -> None:
        """Move the copy to CPU memory (on a device; a no-op on a CPU)."""
        if self.device.type != "cpu":
            self.model.to("cpu")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring the copy back to the device when ``tags`` include the weights (``None``: everything)."""
        if tags is None or "weights" in tags:
            self.model.to(self.device)
