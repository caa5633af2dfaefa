"""Build a tiny Qwen3 chat model with a character tokenizer, warm-started on the arithmetic task.

    python scripts/make_tiny_model.py                  # writes outputs/tiny_model, where configs/cpu.yaml looks

Offline and deterministic (same ``--seed`` and ``--sft-steps`` give byte-identical files). Writes a
``transformers`` model directory that every dsrl tier loads like a hub checkpoint:

- Tokenizer: one token per printable ASCII character and newline, plus ``<|endoftext|>`` (bos and
  pad), ``<|im_start|>``, ``<|im_end|>`` (eos, ends an assistant turn) and ``<|unk|>``; a Qwen-style
  chat template (no default system prompt); left padding.
- Model: Qwen3 architecture, hidden 128, 4 layers, 2 query heads and 1 key/value head of
  ``head_dim`` 64 (the smallest head size vLLM's CPU attention accepts), MLP 384, tied
  embeddings, 256 positions: about 0.8M parameters.
- Warm start: supervised training on problems of the arithmetic train pool
  (``dsrl.data.arithmetic``), chat template applied, loss on the answer and the ``<|im_end|>``
  only, stopped as soon as greedy exact match on 200 held-out train-pool problems reaches 25%
  (checked every 5 steps) or after ``--sft-steps`` steps. Accuracy rises steeply (~5% to ~60%
  within 100 steps), so a fixed step count would land anywhere in that range depending on the
  seed and the CPU's floating-point kernels; stopping on accuracy gives a model that is clearly
  non-zero but far from perfect on every machine, which RL (GRPO, 8 samples per prompt) then
  improves. ``--sft-steps 0`` saves the random initialisation in seconds.

Prints the parameter count, the time taken and the greedy exact-match accuracy of the saved model.
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

from dsrl.data import arithmetic

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_POSITIONS = 256
SFT_BATCH_SIZE = 64
SFT_LR = 1e-3
SFT_WARMUP_STEPS = 20
SFT_TARGET_ACCURACY = 0.25
SFT_CHECK_EVERY = 5
SFT_PROBE_SIZE = 200
# Longest arithmetic answer (3 digits) + <|im_end|>, with room for a wrong longer answer.
EVAL_MAX_NEW_TOKENS = 8


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


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> torch.nn.Module:
    """A randomly initialised tiny Qwen3 (float32) whose special-token ids match ``tokenizer``."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
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


def supervised_warm_start(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, max_steps: int, seed: int
) -> tuple[int, float]:
    """AdamW on random train-pool problems (linear warm-up, then constant lr) until greedy accuracy
    on a held-out probe of the train pool reaches ``SFT_TARGET_ACCURACY``; returns ``(steps, last loss)``."""
    pool = arithmetic.problems("train", arithmetic.TRAIN_POOL_SIZE, seed)
    probe, pool = pool[:SFT_PROBE_SIZE], pool[SFT_PROBE_SIZE:]
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / SFT_WARMUP_STEPS))
    loss = torch.tensor(float("nan"))
    for step in range(1, max_steps + 1):
        model.train()
        loss = model(**sft_batch(tokenizer, rng.sample(pool, SFT_BATCH_SIZE))).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        model.eval()
        if step % SFT_CHECK_EVERY == 0 and greedy_accuracy(model, tokenizer, probe) >= SFT_TARGET_ACCURACY:
            return step, loss.item()
    return max_steps, loss.item()


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


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default="outputs/tiny_model", help="output directory (model + tokenizer); default: where configs/cpu.yaml looks"
    )
    parser.add_argument("--sft-steps", type=int, default=1000, help="most supervised warm-start steps (0: untrained)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and training-batch seed")
    args = parser.parse_args(argv)
    if args.sft_steps < 0:
        parser.error(f"--sft-steps {args.sft_steps}: must be >= 0")
    # One thread: several times faster on small CPUs, and reductions run in a fixed order (determinism).
    torch.set_num_threads(1)
    start = time.perf_counter()

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    steps, loss = supervised_warm_start(model, tokenizer, args.sft_steps, args.seed)
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    built_s = time.perf_counter() - start

    val = arithmetic.problems("test", arithmetic.DEFAULT_TEST_SIZE, arithmetic.DEFAULT_SEED)
    accuracy = greedy_accuracy(AutoModelForCausalLM.from_pretrained(out), tokenizer, val)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: Qwen3 {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; "
        f"{steps} SFT steps (last loss {loss:.3f}) in {built_s:.1f} s; "
        f"greedy exact match on the {len(val)} arithmetic validation problems: {accuracy:.1%}"
    )
    return accuracy


if __name__ == "__main__":
    main(sys.argv[1:])
