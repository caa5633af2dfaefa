"""Prompt datasets in verl's parquet schema: reading, chat template, length policy, sampling, padding.

Row schema (one row per prompt; other columns such as ``ability`` are ignored):

    data_source   str                        chooses the reward function
    prompt        list of {role, content}    chat messages (column name = data.prompt_key)
    reward_model  {ground_truth, style?}     ground_truth is passed to the reward function
    extra_info    dict | null                passed to the reward function as is

How the trainer uses it (B = data.train_batch_size prompts, W ranks)::

    records, stats = load_prompts(cfg.data.train_files, tokenizer, prompt_key=cfg.data.prompt_key,
                                  max_prompt_length=cfg.data.max_prompt_length,
                                  filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                                  truncation=cfg.data.truncation)
    sampler = PromptSampler(records, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    rows = sampler.next_batch()[rank * (B // W):(rank + 1) * (B // W)]   # same global batch on every rank
    prompts = collate_prompts(rows, tokenizer.pad_token_id)   # prompt_ids, prompt_mask [B/W, P] + row lists
    # repeat each row rollout.n times, generate, then Batch(**prompts_repeated, response_ids=..., ...)
    state = sampler.state_dict()  ->  checkpoint  ->  sampler.load_state_dict(state)

Malformed rows are errors, not skips: a ValueError names the file, the row, the rule and the fix,
because a silently shrinking dataset changes the experiment. Over-long prompts follow verl:
dropped and counted when ``data.filter_overlong_prompts`` is on, else handled per
``data.truncation`` (``error`` raises, ``left`` keeps the last tokens, ``right`` the first).

Files are read with pyarrow directly (no datasets cache), so every rank can read them at once.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, tokenized with the chat template and the generation prompt appended."""

    prompt_ids: tuple[int, ...]
    data_source: str
    ground_truth: Any
    extra_info: dict


def _row_error(file: str, row: int, rule: str, fix: str) -> ValueError:
    return ValueError(f"{file} row {row}: {rule}. Fix: {fix}")


def _messages(value: Any, file: str, row: int, prompt_key: str) -> list[dict]:
    fix = (
        f"make {prompt_key!r} a non-empty list of {{'role': str, 'content': str}} messages "
        "(scripts/prepare_data.py writes that), or set data.prompt_key to the column that holds them"
    )
    if not isinstance(value, list) or not value:
        raise _row_error(
            file, row, f"{prompt_key!r} is {type(value).__name__} {value!r:.80}, not a list of messages", fix
        )
    for message in value:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise _row_error(
                file, row, f"{prompt_key!r} holds a message {message!r:.80} without str 'role' and 'content'", fix
            )
    return value


def _read_rows(file: str, prompt_key: str) -> list[tuple[list[dict], str, Any, dict]]:
    """``(messages, data_source, ground_truth, extra_info)`` of every row of one parquet file."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {file!r} does not exist (create it with scripts/prepare_data.py)")
    table = pq.read_table(path)
    missing = [c for c in ("data_source", prompt_key, "reward_model") if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{file}: no column {missing} (columns: {table.column_names}). verl's schema needs data_source, "
            f"{prompt_key}, reward_model. Fix: write the file with scripts/prepare_data.py, or set data.prompt_key."
        )
    extra_infos = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else [None] * len(table)
    rows = []
    for row, (data_source, prompt, reward_model, extra_info) in enumerate(
        zip(
            table.column("data_source").to_pylist(),
            table.column(prompt_key).to_pylist(),
            table.column("reward_model").to_pylist(),
            extra_infos,
            strict=True,
        )
    ):
        if not isinstance(data_source, str) or not data_source:
            raise _row_error(
                file,
                row,
                f"data_source is {data_source!r}, not a non-empty string",
                "set data_source (it chooses the reward)",
            )
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise _row_error(
                file,
                row,
                f"reward_model is {reward_model!r:.80}, without reward_model.ground_truth",
                "give every row a reward_model.ground_truth",
            )
        if extra_info is not None and not isinstance(extra_info, dict):
            raise _row_error(
                file,
                row,
                f"extra_info is {type(extra_info).__name__}, not a dict or null",
                "store extra_info as a struct (dict) or leave it null",
            )
        rows.append(
            (_messages(prompt, file, row, prompt_key), data_source, reward_model["ground_truth"], extra_info or {})
        )
    return rows


def load_prompts(
    files: str | list[str],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int,
    filter_overlong_prompts: bool,
    truncation: str,
    max_samples: int = -1,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[PromptRecord], dict[str, int]]:
    """Read parquet prompt files (in order) and tokenize them with the tokenizer's chat template.

    Each prompt is ``apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)``
    tokenized without extra special tokens (the template writes them). Only the first
    ``max_samples`` rows of the files are read (-1: all). Returns ``(records, stats)`` with
    ``stats = {"rows": read, "kept": len(records), "filtered_overlong": dropped, "truncated": cut}``;
    dropped prompts are also logged as a warning.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation={truncation!r}: must be one of {list(TRUNCATION_MODES)}")
    if max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length={max_prompt_length}: must be >= 1")
    if tokenizer.chat_template is None:
        raise ValueError(
            "the tokenizer of actor_rollout_ref.model.path has no chat template; prompts are chat messages. "
            "Fix: use an instruct/chat model or a tokenizer directory with chat_template.jinja"
        )
    records, stats = [], {"rows": 0, "kept": 0, "filtered_overlong": 0, "truncated": 0}
    for file in [files] if isinstance(files, str) else list(files):
        if stats["rows"] == max_samples:
            break
        rows = _read_rows(file, prompt_key)
        if max_samples > 0:
            rows = rows[: max_samples - stats["rows"]]
        texts = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {}))
            for m, *_ in rows
        ]
        token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        stats["rows"] += len(rows)
        for row, (ids, (_, data_source, ground_truth, extra_info)) in enumerate(zip(token_ids, rows, strict=True)):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    stats["filtered_overlong"] += 1
                    continue
                if truncation == "error":
                    raise _row_error(
                        file,
                        row,
                        f"the prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length} "
                        "(data.truncation=error)",
                        "raise data.max_prompt_length, set data.filter_overlong_prompts=true, "
                        "or set data.truncation=left",
                    )
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                stats["truncated"] += 1
            records.append(PromptRecord(tuple(ids), data_source, ground_truth, extra_info))
    stats["kept"] = len(records)
    if stats["filtered_overlong"]:
        logger.warning(
            "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts=true)",
            stats["filtered_overlong"],
            stats["rows"],
            max_prompt_length,
        )
    if not records:
        raise ValueError(
            f"no prompts left in {files} ({stats['rows']} rows, {stats['filtered_overlong']} longer than "
            f"data.max_prompt_length={max_prompt_length}). Fix: raise data.max_prompt_length or check the files"
        )
    return records, stats


class PromptSampler:
    """Global batches of prompt records: one seeded permutation per epoch, resumable at ``(epoch, index)``.

    Epoch ``e`` visits the records in ``permutation(seed, e)`` order (identity when ``shuffle`` is
    off) in ``len(records) // batch_size`` full batches; the remainder is left out of that epoch,
    as in verl's ``drop_last``. ``index`` counts the batches already taken in ``epoch``; after the
    last batch of an epoch the next call starts epoch ``e + 1``. Every rank builds the same sampler
    and takes the same global batch, then its own slice.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, *, shuffle: bool, seed: int):
        if not 0 < batch_size <= len(records):
            raise ValueError(
                f"data.train_batch_size={batch_size}: must be between 1 and the {len(records)} prompts of the "
                "dataset. Fix: lower data.train_batch_size or add prompts"
            )
        self.records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order_epoch, self._order = -1, np.arange(0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.records) // self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.records)
            self._order = (
                np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
            )
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> list[PromptRecord]:
        """The next ``batch_size`` records; advances the position."""
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        start = self.index * self.batch_size
        batch = [self.records[i] for i in self._epoch_order()[start : start + self.batch_size]]
        self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position after the batches taken so far."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (same records, batch size, shuffle and seed)."""
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.batches_per_epoch:
            raise ValueError(
                f"sampler state {state}: index must be within 0..{self.batches_per_epoch} batches per epoch; "
                "the checkpoint was written with another dataset or data.train_batch_size"
            )
        self.epoch, self.index = epoch, index


def left_pad(
    sequences: list[tuple[int, ...]] | list[list[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token sequences to the longest: ``(ids, mask)``, both ``[B, P]`` int64, mask 1 on tokens.

    Left padding puts every prompt's last token in column ``P - 1``, where generation continues.
    """
    if not sequences:
        raise ValueError("left_pad: no sequences")
    lengths = torch.tensor([len(s) for s in sequences])
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # [B, P]
    ids = torch.full(mask.shape, pad_token_id, dtype=torch.long)
    # Row-major boolean indexing visits the kept positions in the order of the concatenated sequences.
    ids[mask] = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    return ids, mask.long()


def collate_prompts(records: list[PromptRecord], pad_token_id: int) -> dict[str, Any]:
    """The prompt fields of a ``Batch``: ``prompt_ids``/``prompt_mask`` ``[B, P]`` (left-padded) and per-row lists."""
    prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in records], pad_token_id)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "data_sources": [r.data_source for r in records],
        "ground_truths": [r.ground_truth for r in records],
        "extra_infos": [r.extra_info for r in records],
    }
