"""Build a tiny Qwen3 chat model with a character tokenizer, warm-started on the arithmetic task (or to call a tool).

    python scripts/make_tiny_model.py                     # writes outputs/tiny_model, where configs/cpu.yaml looks
    python scripts/make_tiny_model.py --task calculator   # outputs/tiny_tool_model (configs/calculator_cpu.yaml)
    python scripts/make_tiny_model.py --wide --sft-steps 0 --out outputs/wide_model   # 97M, untrained (measurements)
    python scripts/make_tiny_model.py --moe --out outputs/tiny_moe_model   # Qwen3-MoE, 8 experts, top 2
    python scripts/make_tiny_model.py --reward-model      # outputs/tiny_reward_model (configs/ppo_rm_cpu.yaml)

Offline and deterministic (same ``--seed`` and ``--sft-steps`` give byte-identical files). Writes a
``transformers`` model directory that every dsrl tier loads like a hub checkpoint:

- Tokenizer: one token per printable ASCII character and newline, plus ``<|endoftext|>`` (bos and
  pad), ``<|im_start|>``, ``<|im_end|>`` (eos, ends an assistant turn) and ``<|unk|>``; a Qwen-style
  chat template (no default system prompt; a ``tool`` message renders as in Qwen2.5's, as a user turn
  ``<tool_response>\\n...\\n</tool_response>``, but there is no tools list); left padding.
- Model: Qwen3 architecture, hidden 128, 4 layers, 2 query heads and 1 key/value head of
  ``head_dim`` 64 (the smallest head size vLLM's CPU attention accepts), MLP 384, tied
  embeddings, 256 positions: about 0.8M parameters. ``--moe``: Qwen3-MoE instead, every layer's MLP 8 experts
  of width 96 with top-2 routing (transformers 5 keeps a layer's experts as two fused 3-D tensors, checkpoints
  one tensor per expert and projection); with ``--wide``, hidden 512 and experts of width 896 (93M parameters,
  27M active).
- Warm start: supervised training on problems of the arithmetic train pool
  (``dsrl.data.arithmetic``), 128 a step, chat template applied, loss on the answer and the ``<|im_end|>``
  only, stopped as soon as greedy exact match on 200 held-out train-pool problems reaches 25%
  (checked every 5 steps once the batch loss is below 1.2) or after ``--sft-steps`` steps. Accuracy rises steeply (~5%
  to ~60% within 100 steps), so a fixed step count would land anywhere in that range depending on the
  seed and the CPU's floating-point kernels; stopping on accuracy gives a model that is clearly
  non-zero but far from perfect on every machine, which RL (GRPO, 8 samples per prompt) then
  improves. ``--sft-steps 0`` saves the random initialisation in seconds.
- ``--task calculator`` instead warm-starts on products of two 3-digit numbers (``dsrl.data.calculator``),
  traces built as the agent loop builds a rollout: 40% call the tool (the hermes call, the tool message
  with the product rendered by the chat template, an assistant turn copying it), 60% answer directly
  (the true product, which the tiny model cannot compute); loss on the assistant turns only. It stops
  when forced calls (first token ``<``), sampled at temperature 1 on 64 held-out train-pool problems,
  are well formed and copied back for 60% of them (``--tool-target`` sets another share; checked every 10
  steps once the batch loss is below 0.3; ~300 steps, 4-5 min on one core). At temperature 1 the model
  then makes a well-formed call for ~1/3 of the problems (a broken one for ~8% more), ~85% of them of the
  right product, and ~2/3 of its well-formed calls end in the right answer (accuracy ~22%): a start that RL
  with tools improves, and that GRPO without tools cannot (a direct product is almost always wrong). Greedy
  decoding calls for ~70% of the problems.
- ``--reward-model`` instead saves a reward model for the arithmetic warm start, trained as RLHF trains one on its
  policy's samples: the warm start (the same one, from the same seed) answers 2,700 train-pool problems (none of its
  probe's) 4 times each at temperature 1, and every distinct wrong answer (wrong under the rule RL validation uses)
  is paired against the true answer + ``<|im_end|>``; a ``Qwen3ForSequenceClassification`` with one label, the warm
  start's backbone and a new ``score`` head, learns with the Bradley-Terry loss ``-log sigmoid(r_chosen -
  r_rejected)``, 128 pairs a step (the warm start's optimizer), scored at the last token as dsrl's reward-model engine
  scores, until 85% of the pairs of 300 held-out problems rank right (checked every 25 steps) or ``--rm-steps``.
  Seed 0: 8,875 pairs, 400 steps, 87% ranked right (50% with the new head), ~4 min on 2 cores. It never sees the
  policy's later samples, and it cannot check a last digit (docs/data-and-rewards.md), so RL on its scores drifts to
  the wrong answers it overrates.

Prints the parameter count, the time taken and the greedy exact-match accuracy of the saved model; for
``--reward-model``, the pairs and the held-out share ranked right (returned); for
``--task calculator``, the call rate and accuracy, greedy and sampled, of a simulated agent loop (two
assistant turns, the calculator run in Python) on the calculator validation problems.
"""

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

from dsrl.data import arithmetic, calculator

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]
# Qwen2.5's rendering without its tools preamble (positions are scarce): a "tool" message is a user turn
# wrapping the output in <tool_response> tags, consecutive tool messages share one user turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_POSITIONS = 256
# 128 problems a step: half the steps of 64 to the accuracy target (150 against 365 for seed 0), each not twice as long.
SFT_BATCH_SIZE = 128
SFT_LR = 1e-3
SFT_WARMUP_STEPS = 20
SFT_TARGET_ACCURACY = 0.25
SFT_CHECK_EVERY = 5
SFT_PROBE_SIZE = 200
# The probe's greedy decoding costs about a training step; accuracy stays under 10% while the batch loss is above
# ~1.2 (seed 0: at most 5.5% at the 18 checks above it), so no check runs there. It draws no random numbers: the
# model built is the one checking every 5 steps would build, in 5 s less.
SFT_CHECK_BELOW_LOSS = 1.2
# Longest arithmetic answer (3 digits) + <|im_end|>, with room for a wrong longer answer.
EVAL_MAX_NEW_TOKENS = 8
# --task calculator: the share of warm-start traces that call the tool. Whether the first token of the assistant
# turn is "<" (of <tool_call>) or a digit does not depend on the problem, so the call probability at temperature 1
# towards this share (it is above it while the call format is still being learnt).
TOOL_CALL_SHARE = 0.4
# Stop when 60% of the probe's forced calls, sampled at temperature 1, are well formed and their result copied
# back. Copying is learnt suddenly (greedy: 0% to 80% between steps ~170 and ~200) and sampled calls follow ~100
# steps later, so a fixed step count would land anywhere between a model that never copies and a sharp one.
TOOL_TARGET_SUCCESS = 0.6
TOOL_CHECK_EVERY = 10
# The probe costs 3-7 training steps. Until copying is learnt the batch loss stays above 0.3 and no forced call
# succeeds (seed 0: 0.41-0.49 from step 80 to 150, 0.33 at 160, then 0.13-0.26; 0.0% at the 16 checks above 0.3),
# so no check runs there. Training draws from no torch generator and the probe reseeds the one it samples from: the
# model built is the one checking every 10 steps would build (the same files), in ~30 s less.
TOOL_CHECK_BELOW_LOSS = 0.3
TOOL_PROBE_SIZE = 64
TOOL_SFT_POOL_SIZE = 20000
TOOL_SFT_BATCH_SIZE = 64
# A call turn is 88 tokens (its JSON is 62 characters), an answer turn 6-7: room for a longer wrong turn.
TOOL_CALL_MAX_NEW_TOKENS = 112
TOOL_ANSWER_MAX_NEW_TOKENS = 12
# --reward-model: a Bradley-Terry reward model trained on the warm start's own samples, as RLHF trains one on its
# policy's. Problems of the train pool (none of the SFT probe's), each answered RM_SAMPLES_PER_PROBLEM times at
# temperature 1; every distinct wrong response is paired against the true answer (+ <|im_end|>).
RM_PROBLEMS = 3000
RM_PROBE_PROBLEMS = 300  # of RM_PROBLEMS, held out: the pairs the stopping rule and the report rank
RM_SAMPLES_PER_PROBLEM = 4
RM_BATCH_SIZE = 128  # pairs a step
# Held-out pairs ranked right, checked every RM_CHECK_EVERY steps (a check costs ~3 steps). Seed 0: 65% after 50
# steps, 79% after 250, 87% after 400, at ~0.4 s a step on 2 cores.
RM_TARGET_ACCURACY = 0.85
RM_CHECK_EVERY = 25
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_PRODUCT = re.compile(r"\s*(-?[0-9]+)\s*\*\s*(-?[0-9]+)\s*")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: a BPE model without merges splits text into single characters."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()  # concatenate characters back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )


# The tiny model's shape, and --wide's: the weights dominate memory and time (LoRA's and the pushes' measurements).
SHAPES = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
    },
    "wide": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },
}


# --moe: the experts of every layer, and the shapes they replace the dense MLP in.
EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1}
MOE_SHAPES = {
    "tiny": {**SHAPES["tiny"], "moe_intermediate_size": 96},
    "wide": {**SHAPES["wide"], "hidden_size": 512, "head_dim": 64, "moe_intermediate_size": 896},
}


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int, shape: str = "tiny", moe: bool = False
) -> torch.nn.Module:
    """A randomly initialised Qwen3 (float32) of one of ``SHAPES`` whose special-token ids match ``tokenizer``;
    ``moe``: a Qwen3-MoE of ``MOE_SHAPES`` with ``EXPERTS``."""
    config_class, sizes = (Qwen3MoeConfig, {**MOE_SHAPES[shape], **EXPERTS}) if moe else (Qwen3Config, SHAPES[shape])
    config = config_class(
        vocab_size=len(tokenizer),
        **sizes,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def prompt_ids(tokenizer: PreTrainedTokenizerFast, a: int, b: int) -> list[int]:
    """Token ids of the chat prompt of problem ``a+b`` (generation prompt included)."""
    messages = [{"role": "user", "content": arithmetic.question(a, b)}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_batch(tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer+eos sequences; ``labels`` are -100 except on answer and eos tokens."""
    sequences, targets = [], []
    for a, b in pairs:
        prompt = prompt_ids(tokenizer, a, b)
        answer = tokenizer(arithmetic.answer(a, b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(len(s) for s in sequences)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in sequences]),  # [B, L]
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]),
        "labels": torch.tensor([t + [-100] * (width - len(t)) for t in targets]),
    }


def train_until(model: torch.nn.Module, max_steps: int, step_loss, reached) -> tuple[int, float]:
    """AdamW (linear warm-up, then constant lr, gradients clipped at 1) on ``step_loss()`` each step until
    ``reached(step, loss)`` (asked in eval mode) or ``max_steps``; returns ``(steps, last loss)``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / SFT_WARMUP_STEPS))
    loss = torch.tensor(float("nan"))
    for step in range(1, max_steps + 1):
        model.train()
        loss = step_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        model.eval()
        if reached(step, loss):
            return step, loss.item()
    return max_steps, loss.item()


def supervised_warm_start(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, max_steps: int, seed: int
) -> tuple[int, float]:
    """``train_until`` on random train-pool problems until greedy accuracy on a held-out probe of the train pool
    reaches ``SFT_TARGET_ACCURACY``; returns ``(steps, last loss)``."""
    pool = arithmetic.problems("train", arithmetic.TRAIN_POOL_SIZE, seed)
    probe, pool = pool[:SFT_PROBE_SIZE], pool[SFT_PROBE_SIZE:]
    rng = random.Random(seed)
    return train_until(
        model,
        max_steps,
        lambda: model(**sft_batch(tokenizer, rng.sample(pool, SFT_BATCH_SIZE))).loss,
        lambda step, loss: (
            step % SFT_CHECK_EVERY == 0
            and loss.item() < SFT_CHECK_BELOW_LOSS
            and greedy_accuracy(model, tokenizer, probe) >= SFT_TARGET_ACCURACY
        ),
    )


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]]) -> float:
    """Greedy exact-match rate under ``dsrl.rewards.arithmetic`` (what RL validation measures)."""
    # Imported here: dsrl.rewards needs pebble, which scripts/gpu_check.py (it imports build_tokenizer) must not.
    from dsrl.rewards.arithmetic import compute_score

    encoded = tokenizer.pad({"input_ids": [prompt_ids(tokenizer, a, b) for a, b in pairs]}, return_tensors="pt")
    output = model.generate(
        **encoded,
        max_new_tokens=EVAL_MAX_NEW_TOKENS,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    responses = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = [compute_score(r, arithmetic.answer(a, b)) for r, (a, b) in zip(responses, pairs, strict=True)]
    return sum(scores) / len(scores)


@torch.no_grad()
def sampled_responses(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]], n: int, seed: int
) -> list[list[list[int]]]:
    """``n`` responses to each problem sampled at temperature 1 (no top-k or top-p), as token ids up to and
    including ``<|im_end|>`` (all ``EVAL_MAX_NEW_TOKENS`` where it never came): what the RL rollout samples."""
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    found: list[list[list[int]]] = [[] for _ in pairs]
    for start in range(0, len(pairs), 512):
        chunk = pairs[start : start + 512]
        encoded = tokenizer.pad({"input_ids": [prompt_ids(tokenizer, a, b) for a, b in chunk]}, return_tensors="pt")
        output = model.generate(
            **encoded,
            max_new_tokens=EVAL_MAX_NEW_TOKENS,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row, ids in enumerate(output[:, encoded["input_ids"].shape[1] :].tolist()):
            found[start + row // n].append(ids[: ids.index(eos) + 1] if eos in ids else ids)
    return found


def preference_pairs(
    tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]], samples: list[list[list[int]]]
) -> list[tuple[list[int], list[int]]]:
    """``(chosen, rejected)`` full sequences (chat prompt + response): the true answer against each distinct wrong
    sampled response of the same problem (wrong under ``dsrl.rewards.arithmetic``, what RL validation scores)."""
    from dsrl.rewards.arithmetic import compute_score  # pebble: see greedy_accuracy

    found = []
    for (a, b), responses in zip(pairs, samples, strict=True):
        prompt, truth = prompt_ids(tokenizer, a, b), arithmetic.answer(a, b)
        chosen = prompt + tokenizer(truth, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        wrong = {tuple(r) for r in responses if not compute_score(tokenizer.decode(r, skip_special_tokens=True), truth)}
        found += [(chosen, prompt + list(r)) for r in sorted(wrong)]
    return found


def sequence_scores(scorer: torch.nn.Module, sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Scores ``[B]`` at each sequence's last token, left-padded as dsrl's reward-model engine reads them."""
    from dsrl.engines.reward_model import last_token_inputs  # deepspeed: see reward_model_training

    return scorer(**last_token_inputs(sequences, pad_token_id))


@torch.no_grad()
def ranked_right(scorer: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], pad_token_id: int) -> float:
    """The share of ``pairs`` whose chosen sequence scores above the rejected one."""
    chosen = sequence_scores(scorer, [c for c, _ in pairs], pad_token_id)
    rejected = sequence_scores(scorer, [r for _, r in pairs], pad_token_id)
    return (chosen > rejected).float().mean().item()


def reward_model_training(
    policy: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, max_steps: int, seed: int
) -> tuple[torch.nn.Module, int, float, float, str]:
    """A ``Qwen3ForSequenceClassification`` (one label) on ``policy``'s backbone, its score head drawn from
    ``seed``, trained with the Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)`` on ``policy``'s own samples
    (``preference_pairs``) until ``RM_TARGET_ACCURACY`` of the held-out pairs rank right, or ``max_steps``;
    returns ``(model, steps, last loss, the held-out pairs' share ranked right, a line on its pairs)``."""
    # Imported here: dsrl.engines needs deepspeed, which scripts/gpu_check.py (it imports build_tokenizer) must not.
    from dsrl.engines.reward_model import LastTokenScore

    pool = arithmetic.problems("train", arithmetic.TRAIN_POOL_SIZE, seed)[SFT_PROBE_SIZE:][:RM_PROBLEMS]
    samples = sampled_responses(policy, tokenizer, pool, RM_SAMPLES_PER_PROBLEM, seed)
    probe = preference_pairs(tokenizer, pool[:RM_PROBE_PROBLEMS], samples[:RM_PROBE_PROBLEMS])
    train = preference_pairs(tokenizer, pool[RM_PROBE_PROBLEMS:], samples[RM_PROBE_PROBLEMS:])
    torch.manual_seed(seed)
    backbone = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    model = AutoModelForSequenceClassification.from_config(Qwen3Config(**backbone, num_labels=1), dtype=torch.float32)
    missing = set(model.load_state_dict(policy.state_dict(), strict=False).missing_keys)
    assert missing == {"score.weight"}, missing  # the backbone is the policy's; only the head is new
    scorer, pad, rng = LastTokenScore(model), tokenizer.pad_token_id, random.Random(seed)
    before = ranked_right(scorer, probe, pad)  # the new head's ranking

    def step_loss() -> torch.Tensor:
        batch = rng.sample(train, RM_BATCH_SIZE)
        chosen, rejected = (sequence_scores(scorer, list(side), pad) for side in zip(*batch, strict=True))
        return -torch.nn.functional.logsigmoid(chosen - rejected).mean()

    steps, loss = train_until(
        model,
        max_steps,
        step_loss,
        lambda step, loss: step % RM_CHECK_EVERY == 0 and ranked_right(scorer, probe, pad) >= RM_TARGET_ACCURACY,
    )
    accuracy = ranked_right(scorer, probe, pad)
    pairs = (
        f"{len(train)} training pairs from {len(pool) - RM_PROBE_PROBLEMS} problems x {RM_SAMPLES_PER_PROBLEM} "
        f"samples; of {len(probe)} held-out pairs {accuracy:.1%} ranked right ({before:.1%} before training)"
    )
    return model, steps, loss, accuracy, pairs


def tool_call_text(expression: str) -> str:
    """A hermes tool call of the built-in calculator, as Qwen2.5/Qwen3 write one."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


def chat_ids(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, generation prompt included."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def text_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tool_turn_ids(tokenizer: PreTrainedTokenizerFast, content: str) -> list[int]:
    """The tokens between a call turn's ``<|im_end|>`` and the next assistant turn, as the agent loop
    (``dsrl.rollout.multi_turn``) appends them and as the chat template renders the whole conversation: the
    newline that closes the turn, the tool message with ``content``, and the next assistant header."""
    return text_ids(tokenizer, "\n") + chat_ids(tokenizer, [{"role": "tool", "content": content}])


def tool_trace(tokenizer: PreTrainedTokenizerFast, a: int, b: int, call: bool) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one warm-start trace of problem ``a*b``, built as the agent loop builds a
    rollout: the prompt; an assistant turn ending on ``<|im_end|>``; with ``call``, that turn is the tool call,
    followed by the tool message with the product (``tool_turn_ids``) and an assistant turn with the product.
    Labels are -100 except on the assistant turns' tokens."""
    eos = [tokenizer.eos_token_id]
    prompt = chat_ids(tokenizer, [{"role": "user", "content": calculator.question(a, b)}])
    answer = text_ids(tokenizer, calculator.answer(a, b)) + eos
    if not call:
        return prompt + answer, [-100] * len(prompt) + answer
    turn = text_ids(tokenizer, tool_call_text(calculator.expression(a, b))) + eos
    tool = tool_turn_ids(tokenizer, calculator.answer(a, b))
    ids = prompt + turn + tool + answer
    return ids, [-100] * len(prompt) + turn + [-100] * len(tool) + answer


def tool_sft_batch(
    tokenizer: PreTrainedTokenizerFast, traces: list[tuple[list[int], list[int]]]
) -> dict[str, torch.Tensor]:
    """Right-padded traces with their attention mask and labels, ``[B, L]`` each."""
    width = max(len(ids) for ids, _ in traces)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in traces]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in traces]),
        "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in traces]),
    }


def parse_call(turn: str) -> str | None:
    """The expression of the turn's first calculator call, or None when the turn holds no well-formed call."""
    match = _TOOL_CALL.search(turn)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
        expression = call["arguments"]["expression"] if call["name"] == "calculator" else None
    except (ValueError, KeyError, TypeError):
        return None
    return expression if isinstance(expression, str) else None


def run_calculator(expression: str) -> str:
    """What the calculator returns for a product ``"a*b"``: ``str(a*b)``; an error text for anything else."""
    match = _PRODUCT.fullmatch(expression)
    return str(int(match.group(1)) * int(match.group(2))) if match else f"Error: cannot evaluate {expression!r}"


@torch.no_grad()
def generate_turns(
    model, tokenizer: PreTrainedTokenizerFast, contexts: list[list[int]], max_new_tokens: int, do_sample: bool
) -> list[list[int]]:
    """One assistant turn per context: the new tokens up to and including the first ``<|im_end|>``."""
    encoded = tokenizer.pad({"input_ids": contexts}, return_tensors="pt")
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    output = model.generate(
        **encoded,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )
    turns = []
    for row in output[:, encoded["input_ids"].shape[1] :].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        turns.append(row[:end])
    return turns


def tool_rollouts(
    model, tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[int, int]], do_sample: bool, first: str = ""
) -> list[dict]:
    """The agent loop, simulated for two assistant turns: generate a turn; when it holds a well-formed call, run
    the calculator, append its output as the loop does (``tool_turn_ids``) and generate a second turn.
    ``first`` is forced as the start of the first turn (``"<"`` forces a call). Per problem: ``attempted`` (the
    first turn has a ``<tool_call>``), ``called`` (it is a well-formed call), ``correct_call`` (of this problem's
    product), ``score`` (the ``dsrl.rewards.calculator`` score of the response decoded as the reward sees it) and
    ``length`` (prompt and response tokens)."""
    from dsrl.rewards.calculator import compute_score

    forced = text_ids(tokenizer, first)
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": calculator.question(a, b)}]) + forced for a, b in pairs]
    turns = [forced + t for t in generate_turns(model, tokenizer, prompts, TOOL_CALL_MAX_NEW_TOKENS, do_sample)]
    expressions = [parse_call(tokenizer.decode(t, skip_special_tokens=True)) for t in turns]
    tools = [tool_turn_ids(tokenizer, run_calculator(e)) if e else [] for e in expressions]
    second = [i for i, e in enumerate(expressions) if e is not None]
    answers = dict(
        zip(
            second,
            generate_turns(
                model,
                tokenizer,
                [prompts[i][: len(prompts[i]) - len(forced)] + turns[i] + tools[i] for i in second],
                TOOL_ANSWER_MAX_NEW_TOKENS,
                do_sample,
            )
            if second
            else [],
            strict=True,
        )
    )
    results = []
    for i, (a, b) in enumerate(pairs):
        response = turns[i] + tools[i] + answers.get(i, [])
        results.append(
            {
                "attempted": "<tool_call>" in tokenizer.decode(turns[i], skip_special_tokens=True),
                "called": expressions[i] is not None,
                "correct_call": expressions[i] == calculator.expression(a, b),
                "score": compute_score(tokenizer.decode(response, skip_special_tokens=True), calculator.answer(a, b)),
                "length": len(prompts[i]) - len(forced) + len(response),
            }
        )
    return results


def tool_warm_start(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, max_steps: int, seed: int, target: float
) -> tuple[int, float]:
    """``train_until`` on traces of random calculator train-pool problems, ``TOOL_CALL_SHARE`` of them with a call,
    until forced calls on a held-out probe (first token ``<``, sampled) score ``target``; returns
    ``(steps, last loss)``."""
    pool = calculator.problems("train", TOOL_SFT_POOL_SIZE, seed)
    probe, pool = pool[:TOOL_PROBE_SIZE], pool[TOOL_PROBE_SIZE:]
    rng = random.Random(seed)

    def step_loss() -> torch.Tensor:
        pairs = rng.sample(pool, TOOL_SFT_BATCH_SIZE)
        calls = [rng.random() < TOOL_CALL_SHARE for _ in pairs]
        # Calls (~190 tokens) and direct answers (~40) in separate forwards: padding the direct answers to the
        # calls' length would double the work. Weighted by labelled tokens: the mean over the whole batch.
        parts = [
            [tool_trace(tokenizer, a, b, call) for (a, b), c in zip(pairs, calls, strict=True) if c == call]
            for call in (True, False)
        ]
        batches = [tool_sft_batch(tokenizer, part) for part in parts if part]
        counts = [int((batch["labels"][:, 1:] != -100).sum()) for batch in batches]
        return sum(model(**batch).loss * count for batch, count in zip(batches, counts, strict=True)) / sum(counts)

    def reached(step: int, loss: torch.Tensor) -> bool:
        if step % TOOL_CHECK_EVERY or loss.item() >= TOOL_CHECK_BELOW_LOSS:
            return False
        greedy = sum(r["score"] for r in tool_rollouts(model, tokenizer, probe, False, "<")) / len(probe)
        torch.manual_seed(seed)
        sampled = sum(r["score"] for r in tool_rollouts(model, tokenizer, probe, True, "<")) / len(probe)
        print(
            f"step {step}: loss {loss.item():.3f}, forced calls scoring: greedy {greedy:.1%}, sampled {sampled:.1%}",
            flush=True,
        )
        return sampled >= target

    return train_until(model, max_steps, step_loss, reached)


def tool_report(model, tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[float, str]:
    """Greedy accuracy on the calculator validation problems, and a line with, greedy and sampled at temperature 1:
    the shares of problems with a well-formed call and with a broken one, the share of well-formed calls of the
    problem's product, the accuracy (overall, and after a well-formed call) and the longest trace."""
    val = calculator.problems("test", calculator.DEFAULT_TEST_SIZE, calculator.DEFAULT_SEED)
    lines, accuracy = [], {}
    for name, do_sample in (("greedy", False), ("sampled (T=1)", True)):
        torch.manual_seed(seed)
        results = tool_rollouts(model, tokenizer, val, do_sample)
        calls = [r for r in results if r["called"]]
        broken = sum(r["attempted"] and not r["called"] for r in results)
        accuracy[name] = sum(r["score"] for r in results) / len(results)
        after_call = sum(r["score"] for r in calls) / max(1, len(calls))
        lines.append(
            f"{name}: well-formed calls {len(calls) / len(results):.1%}, broken calls {broken / len(results):.1%}, "
            f"right product {sum(r['correct_call'] for r in calls) / max(1, len(calls)):.1%} of the well-formed, "
            f"accuracy {accuracy[name]:.1%} (after a well-formed call {after_call:.1%}), "
            f"longest trace {max(r['length'] for r in results)} tokens"
        )
    return accuracy["greedy"], f"the {len(val)} calculator validation problems, " + "; ".join(lines)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--task",
        choices=["arithmetic", "calculator"],
        default="arithmetic",
        help="warm-start task: arithmetic (default), or calculator (tool calls; dsrl.data.calculator)",
    )
    parser.add_argument(
        "--out",
        help="output directory (model + tokenizer); default: where configs/cpu.yaml (arithmetic) or "
        "configs/calculator_cpu.yaml (calculator) looks",
    )
    parser.add_argument("--sft-steps", type=int, default=1000, help="most supervised warm-start steps (0: untrained)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and training-batch seed")
    parser.add_argument(
        "--tool-target",
        type=float,
        help=f"--task calculator: stop once this share of the probe's forced calls succeed (default "
        f"{TOOL_TARGET_SUCCESS}, the model the docs measure; the tests' tool_model_dir builds with 0.4)",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="hidden 1024, 8 layers (97M parameters), untrained: for memory and speed measurements, with --sft-steps 0",
    )
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE: 8 experts per layer, top-2 routing")
    parser.add_argument(
        "--reward-model",
        action="store_true",
        help="after the arithmetic warm start, train a reward model on its samples (outputs/tiny_reward_model, where "
        "configs/ppo_rm_cpu.yaml looks)",
    )
    parser.add_argument("--rm-steps", type=int, default=1000, help="--reward-model: most Bradley-Terry steps")
    args = parser.parse_args(argv)
    if args.sft_steps < 0:
        parser.error(f"--sft-steps {args.sft_steps}: must be >= 0")
    if args.wide and (args.sft_steps or args.task != "arithmetic"):
        parser.error("--wide builds an untrained model: add --sft-steps 0 (and no --task)")
    if args.reward_model and (args.task != "arithmetic" or args.wide or args.moe):
        parser.error("--reward-model trains on the tiny dense model's arithmetic warm start: no --task, --wide, --moe")
    if args.tool_target is not None and (args.task != "calculator" or not 0 < args.tool_target <= 1):
        parser.error(f"--tool-target {args.tool_target}: a share in (0, 1], with --task calculator")
    # A fixed thread count keeps reductions in a fixed order, so a seed builds the same model on every run of a
    # machine. The arithmetic warm start takes two where there are (1.5x faster at its 128 problems a step on our
    # 2-core machine); the tool model keeps the one thread it was built with when the README's compare_tools
    # table was measured.
    torch.set_num_threads(1 if args.task == "calculator" else min(2, os.cpu_count() or 1))
    start = time.perf_counter()

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed, "wide" if args.wide else "tiny", moe=args.moe)
    if args.task == "calculator":
        target = TOOL_TARGET_SUCCESS if args.tool_target is None else args.tool_target
        steps, loss = tool_warm_start(model, tokenizer, args.sft_steps, args.seed, target)
    else:
        steps, loss = supervised_warm_start(model, tokenizer, args.sft_steps, args.seed)
    if args.reward_model:
        out = Path(args.out or "outputs/tiny_reward_model")
        policy = f"{steps} SFT steps (last loss {loss:.3f})"
        model, steps, loss, accuracy, pairs = reward_model_training(model, tokenizer, args.rm_steps, args.seed)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"{out}: Qwen3ForSequenceClassification {n_params / 1e6:.2f}M parameters on the backbone of {policy}; "
            f"{steps} Bradley-Terry steps (last loss {loss:.3f}) in {time.perf_counter() - start:.1f} s; {pairs}"
        )
        return accuracy
    out = Path(args.out or ("outputs/tiny_tool_model" if args.task == "calculator" else "outputs/tiny_model"))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    built_s = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    built = (
        f"{out}: {type(model.config).__name__.removesuffix('Config')} {n_params / 1e6:.2f}M parameters, "
        f"vocab {len(tokenizer)}; "
        f"{steps} SFT steps (last loss {loss:.3f}) in {built_s:.1f} s"
    )

    if args.task == "calculator":
        accuracy, report = tool_report(AutoModelForCausalLM.from_pretrained(out), tokenizer, args.seed)
        print(f"{built}; {report}")
        return accuracy
    val = arithmetic.problems("test", arithmetic.DEFAULT_TEST_SIZE, arithmetic.DEFAULT_SEED)
    accuracy = greedy_accuracy(AutoModelForCausalLM.from_pretrained(out), tokenizer, val)
    print(f"{built}; greedy exact match on the {len(val)} arithmetic validation problems: {accuracy:.1%}")
    return accuracy


if __name__ == "__main__":
    main(sys.argv[1:])
