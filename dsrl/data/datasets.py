"""Prompt datasets in verl's parquet schema: reading, chat template, length policy, sampling, padding.

Row schema (one row per prompt; other columns such as ``ability`` are ignored):

    data_source   str                        chooses the reward function
    prompt        list of {role, content}    chat messages (column name = data.prompt_key); roles system, user,
                                             assistant or tool, content not empty
    reward_model  {ground_truth, style?}     ground_truth is passed to the reward function
    extra_info    dict | null                passed to the reward function as is

How the trainer uses it (B = ``prompts_per_round(cfg.data)`` prompts: data.train_batch_size, or data.gen_batch_size
with dynamic sampling; W ranks)::

    records, stats = load_prompts(cfg.data.train_files, tokenizer, prompt_key=cfg.data.prompt_key,
                                  max_prompt_length=cfg.data.max_prompt_length,
                                  filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                                  truncation=cfg.data.truncation)
    sampler = PromptSampler(records, prompts_per_round(cfg.data), shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    # records: a PromptStore (flat int32 tokens + offsets; records built per row asked for)
    rows = sampler.next_batch()[rank * (B // W):(rank + 1) * (B // W)]   # same global batch on every rank
    prompts = collate_prompts(rows, tokenizer.pad_token_id)   # prompt_ids, prompt_mask [B/W, P] + row lists
    # repeat each row rollout.n times, generate, then Batch(**prompts_repeated, response_ids=..., ...)
    state = sampler.state_dict()  ->  checkpoint  ->  sampler.load_state_dict(state)

Malformed rows are errors, not skips: a ValueError names the file, the row, the rule and the fix,
because a silently shrinking dataset changes the experiment; so is a prompt of 0 tokens (a tokenizer
without its vocabulary). Over-long prompts follow verl: dropped and counted when
``data.filter_overlong_prompts`` is on, else handled per ``data.truncation`` (``error`` raises, ``left``
keeps the last tokens, ``right`` the first), counted and reported as a warning.

Files are read with pyarrow directly (no datasets cache), so every rank can read them at once.
The prompts are held in a ``PromptStore``: all token ids in one int32 buffer with int64 offsets,
data sources as codes into a short list, ground truths and extra infos as Arrow arrays -- about
4 bytes per token, where tuples of Python ints took ~36 (7 GB per rank for 1M prompts of 200 tokens).
With ``keep_messages`` the store also keeps each prompt's chat messages as an Arrow array per file: a reward model
with another chat template re-renders them (``dsrl.rewards.model_inputs``); records and batches carry them as
``messages`` and ``raw_prompts``.
"""

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dsrl.config import parquet_paths
from dsrl.data.batch import left_pad

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")
CHAT_ROLES = ("system", "user", "assistant", "tool")
READ_BATCH_ROWS = 4096  # rows read, checked and tokenized at a time: bounds the transient Python objects


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, tokenized with the chat template and the generation prompt appended."""

    prompt_ids: tuple[int, ...]
    data_source: str
    ground_truth: Any
    extra_info: dict
    messages: list[dict] | None = None  # the chat messages of the file; None unless the store keeps them


@dataclass(frozen=True)
class _Columns:
    """The rows of a ``PromptStore``, shared by its slices. ``F`` files contributed rows."""

    token_ids: np.ndarray  # int32 [T]: every prompt's tokens, back to back
    offsets: np.ndarray  # int64 [N + 1]: prompt i is token_ids[offsets[i]:offsets[i + 1]]
    source_codes: np.ndarray  # uint8/uint16/int32 [N]: index into sources
    sources: tuple[str, ...]  # the distinct data sources, in order of first appearance
    file_starts: np.ndarray  # int64 [F + 1]: rows file_starts[f]:file_starts[f + 1] come from file f
    ground_truths: tuple[pa.Array, ...]  # per file, one per kept row (Arrow: no Python object per row)
    extra_infos: tuple[pa.Array | None, ...]  # per file, or None where the file has no extra_info
    messages: tuple[pa.Array, ...] | None = None  # per file, the prompts' chat messages; None = not kept


def _codes_dtype(categories: int) -> np.dtype:
    return np.dtype(np.uint8 if categories <= 1 << 8 else np.uint16 if categories <= 1 << 16 else np.int32)


class PromptStore:
    """Tokenized prompts in flat arrays; ``PromptRecord``s are built only for the rows asked for.

    Memory: 4 bytes per token (one int32 buffer) + 8 bytes per prompt (int64 offsets) + 1-2 bytes
    per prompt (data-source code) + the kept ground truths, extra infos and (when kept) chat messages as Arrow
    arrays, where
    a Python ``tuple`` of ints cost ~36 bytes per token and a ``dict`` per row several hundred bytes.
    ``nbytes`` adds it up.

    Acts as a read-only sequence of ``PromptRecord``: ``len``, ``store[i]`` (a record),
    ``store[a:b:c]`` (a ``PromptStore`` sharing the arrays, as ``records[rank::world]``),
    iteration, and ``take(indices)`` (a list of records, one Arrow ``take`` per file).
    """

    def __init__(self, columns: _Columns, rows: range | None = None):
        self._columns = columns
        self._rows = range(len(columns.offsets) - 1) if rows is None else rows

    @classmethod
    def from_arrays(
        cls,
        token_ids: np.ndarray,
        lengths: np.ndarray,
        data_sources: Sequence[str],
        ground_truths: Sequence[Any] | pa.Array | pa.ChunkedArray,
        extra_infos: Sequence[dict | None] | pa.Array | pa.ChunkedArray | None = None,
        messages: Sequence[list[dict]] | pa.Array | pa.ChunkedArray | None = None,
    ) -> "PromptStore":
        """A store of ``len(lengths)`` prompts whose tokens are ``token_ids`` cut at ``lengths`` (one file);
        ``messages``: their chat messages, to keep."""
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] != len(token_ids):
            raise ValueError(f"lengths add up to {offsets[-1]} tokens, token_ids has {len(token_ids)}")
        sources, codes = _encode_sources(data_sources, {})
        truths = _as_arrow(ground_truths)
        infos = None if extra_infos is None else _as_arrow(extra_infos)
        chats = None if messages is None else _as_arrow(messages)
        optional = [len(a) for a in (infos, chats) if a is not None]
        if not len(truths) == len(codes) == len(lengths) or any(n != len(lengths) for n in optional):
            raise ValueError(
                "from_arrays: lengths, data_sources, ground_truths, extra_infos and messages differ in length"
            )
        return cls(
            _Columns(
                token_ids=np.ascontiguousarray(token_ids, dtype=np.int32),
                offsets=offsets,
                source_codes=codes.astype(_codes_dtype(len(sources))),
                sources=tuple(sources),
                file_starts=np.array([0, len(lengths)], dtype=np.int64),
                ground_truths=(truths,),
                extra_infos=(infos,),
                messages=None if chats is None else (chats,),
            )
        )

    def __len__(self) -> int:
        return len(self._rows)

    def source_counts(self) -> dict[str, int]:
        """Rows per data source, in order of first appearance."""
        c = self._columns
        counts = np.bincount(c.source_codes[self._rows], minlength=len(c.sources))
        return {source: int(n) for source, n in zip(c.sources, counts, strict=True) if n}

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (shared with every slice of the same store)."""
        c = self._columns
        arrays = sum(a.nbytes for a in c.ground_truths + c.extra_infos + (c.messages or ()) if a is not None)
        return (
            c.token_ids.nbytes
            + c.offsets.nbytes
            + c.source_codes.nbytes
            + c.file_starts.nbytes
            + sum(len(s.encode()) for s in c.sources)
            + arrays
        )

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole underlying store (not only this slice's rows)."""
        return len(self._columns.token_ids)

    def __getitem__(self, key: int | slice) -> "PromptRecord | PromptStore":
        if isinstance(key, slice):
            return PromptStore(self._columns, self._rows[key])
        if isinstance(key, (int, np.integer)):
            return self.take([key])[0]
        raise TypeError(f"PromptStore indices must be int or slice, not {type(key).__name__}")

    def __iter__(self) -> Iterator[PromptRecord]:
        block = 1024
        for start in range(0, len(self), block):
            yield from self.take(range(start, min(start + block, len(self))))

    def __repr__(self) -> str:
        return f"PromptStore({len(self)} prompts, {self.nbytes / 2**20:.1f} MiB)"

    def take(self, indices: Iterable[int] | np.ndarray) -> list[PromptRecord]:
        """The records at ``indices`` (positions in this store; negative ones count from the end)."""
        n = len(self)
        positions = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=np.int64)
        if positions.size and (positions.min() < -n or positions.max() >= n):
            raise IndexError(f"PromptStore index out of range (size {n})")
        positions = np.where(positions < 0, positions + n, positions)
        rows = self._rows.start + self._rows.step * positions  # rows of the underlying columns
        c = self._columns
        starts, ends = c.offsets[rows].tolist(), c.offsets[rows + 1].tolist()
        prompt_ids = [tuple(c.token_ids[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]
        sources = [c.sources[code] for code in c.source_codes[rows].tolist()]
        truths: list[Any] = [None] * len(rows)
        infos: list[dict] = [{}] * len(rows)
        chats: list[list[dict] | None] = [None] * len(rows)
        files = np.searchsorted(c.file_starts, rows, side="right") - 1
        for file in np.unique(files).tolist():
            where = np.flatnonzero(files == file)
            local = pa.array(rows[where] - c.file_starts[file])
            file_truths = c.ground_truths[file].take(local).to_pylist()
            file_infos = c.extra_infos[file]
            file_infos = file_infos.take(local).to_pylist() if file_infos is not None else [None] * len(where)
            for i, truth, info in zip(where.tolist(), file_truths, file_infos, strict=True):
                truths[i], infos[i] = truth, info or {}
            if c.messages is not None:
                for i, chat in zip(where.tolist(), c.messages[file].take(local).to_pylist(), strict=True):
                    chats[i] = chat
        return [PromptRecord(*fields) for fields in zip(prompt_ids, sources, truths, infos, chats, strict=True)]


def _as_arrow(values: Sequence[Any] | pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    return values if isinstance(values, pa.Array) else pa.array(list(values))


def _encode_sources(data_sources: Iterable[str], codes_of: dict[str, int]) -> tuple[list[str], np.ndarray]:
    """Codes of ``data_sources`` in ``codes_of`` (extended with new sources): ``(sources, codes)``."""
    codes = np.fromiter((codes_of.setdefault(s, len(codes_of)) for s in data_sources), dtype=np.int32)
    return list(codes_of), codes


class _Int32Buffer:
    """A growing int32 array. ``ndarray.resize`` reallocates in place (``mremap`` for large blocks on
    Linux), so growing does not hold the old and the new copy at once, as concatenating chunks would."""

    def __init__(self):
        self._array, self._size = np.empty(1 << 16, dtype=np.int32), 0

    def extend(self, values: list[int]) -> None:
        end = self._size + len(values)
        if end > len(self._array):
            self._array.resize(max(end, len(self._array) + len(self._array) // 4), refcheck=False)
        self._array[self._size : end] = values
        self._size = end

    def finish(self) -> np.ndarray:
        self._array.resize(self._size, refcheck=False)
        array, self._array = self._array, np.empty(0, dtype=np.int32)
        return array


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
        if message["role"] not in CHAT_ROLES:
            raise _row_error(
                file,
                row,
                f"{prompt_key!r} holds a message with role {message['role']!r}, not one of {', '.join(CHAT_ROLES)} "
                "(the roles chat templates know)",
                "map the roles when preparing the data (e.g. ShareGPT's human -> user, gpt -> assistant)",
            )
        if not message["content"].strip() and not message.get("tool_calls"):
            raise _row_error(
                file,
                row,
                f"{prompt_key!r} holds a {message['role']} message with empty content",
                "drop the message or give it its text when preparing the data",
            )
    return value


def _check_row(file: str, row: int, prompt_key: str, data_source, prompt, reward_model, extra_info) -> list[dict]:
    """The messages of a valid row; a ValueError naming the file, the row, the rule and the fix otherwise."""
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
    return _messages(prompt, file, row, prompt_key)


def _open(file: str, prompt_key: str) -> tuple[pq.ParquetFile, list[str]]:
    """The parquet file and the columns to read; errors for a missing file or missing columns."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {file!r} does not exist (create it with scripts/prepare_data.py)")
    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowInvalid as err:
        raise ValueError(
            f"{file}: not a parquet file ({err}). Fix: convert it (e.g. pandas.read_json(path, lines=True)"
            ".to_parquet(out)) or write it with scripts/prepare_data.py"
        ) from err
    names = parquet.schema_arrow.names
    missing = [c for c in ("data_source", prompt_key, "reward_model") if c not in names]
    if missing:
        raise ValueError(
            f"{file}: no column {missing} (columns: {names}). verl's schema needs data_source, "
            f"{prompt_key}, reward_model. Fix: write the file with scripts/prepare_data.py, or set data.prompt_key."
        )
    return parquet, ["data_source", prompt_key, "reward_model"] + (["extra_info"] if "extra_info" in names else [])


def _no_chat_template_error() -> ValueError:
    return ValueError(
        "the tokenizer of actor_rollout_ref.model.path has no chat template, and prompts are chat messages "
        "(verl's schema) that only a chat template turns into the text the model sees; dsrl does not guess "
        "a format, as a made-up one would silently change the experiment. dsrl has no key for a custom "
        "template (verl's actor_rollout_ref.model.custom_chat_template is refused). Fix: set "
        "actor_rollout_ref.model.path to an instruct/chat model, or to a copy of the model directory with the "
        "template in a chat_template.jinja file next to tokenizer_config.json (transformers loads it as the "
        "tokenizer's chat_template)"
    )


def load_tokenizer(path: str, *, trust_remote_code: bool):
    """The tokenizer of the model at ``path`` (a directory or a hub id), padding with EOS where it has no pad token
    (e.g. Llama 3), as verl and the rollouts do.

    A ValueError naming the key and the fix when the tokenizer or the model's config cannot be loaded, or when
    the tokenizer holds more tokens than the model's vocabulary (``vocab_size``): ids past it would index beyond
    the embedding, a device-side assert deep in the first forward pass.
    """
    from transformers import AutoConfig, AutoTokenizer

    key = f"actor_rollout_ref.model.path={path}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers and tokenizers raise many types for files they cannot read
        reason = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        raise ValueError(
            f"{key}: the tokenizer or config.json cannot be loaded ({reason}). Fix: point it at a complete model "
            "directory or hub id (the files save_pretrained writes)"
        ) from err
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(
            f"{key}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size={vocab_size} "
            f"(config.json), so token ids from {vocab_size} on index past the embedding. Fix: use the tokenizer "
            "saved with this model, or resize the model's embedding to the tokenizer "
            "(model.resize_token_embeddings(len(tokenizer))) and save both"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        logger.info(f"{path}: the tokenizer has no pad token; padding with EOS ({tokenizer.eos_token})")
    return tokenizer


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
    keep_messages: bool = False,
) -> tuple[PromptStore, dict[str, int]]:
    """Read parquet prompt files (in order; a directory stands for its ``*.parquet`` files, sorted) and tokenize
    them with the tokenizer's chat template.

    Each prompt is ``apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)``
    tokenized without extra special tokens (the template writes them). Only the first
    ``max_samples`` rows of the files are read (-1: all). Returns ``(records, stats)``: a
    ``PromptStore`` and ``stats = {"rows": read, "kept": len(records), "filtered_overlong": dropped,
    "truncated": cut}``; dropped prompts are also logged as a warning. Files are streamed in
    batches of ``READ_BATCH_ROWS`` rows, so only the store grows with the dataset. ``keep_messages``: the store
    also keeps the prompts' chat messages (the records' ``messages``; else None), for a reward model that renders
    them with its own chat template; they cost about their text's bytes.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation={truncation!r}: must be one of {list(TRUNCATION_MODES)}")
    if max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length={max_prompt_length}: must be >= 1")
    if getattr(tokenizer, "chat_template", None) is None:
        raise _no_chat_template_error()
    template_kwargs = chat_template_kwargs or {}
    stats = {"rows": 0, "kept": 0, "filtered_overlong": 0, "truncated": 0}
    tokens, lengths, codes, codes_of = _Int32Buffer(), [], [], {}
    file_starts, ground_truths, extra_infos, messages = [0], [], [], []
    for file in parquet_paths(files):
        if stats["rows"] == max_samples:
            break
        parquet, columns = _open(file, prompt_key)
        limit = max_samples - stats["rows"] if max_samples > 0 else None
        file_truths, file_infos, file_messages, file_kept, row0 = [], [], [], 0, 0
        for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, columns=columns):
            if limit is not None:
                if row0 >= limit:
                    break
                batch = batch.slice(0, limit - row0)
            if not len(batch):
                continue
            values = [batch.column(c).to_pylist() for c in columns]  # transient, one batch at a time
            if len(values) == 3:
                values.append([None] * len(batch))  # no extra_info column
            conversations = [
                _check_row(file, row0 + j, prompt_key, *row) for j, row in enumerate(zip(*values, strict=True))
            ]
            texts = tokenizer.apply_chat_template(
                conversations, add_generation_prompt=True, tokenize=False, **template_kwargs
            )
            kept, kept_lengths = [], []
            for j, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
                if not ids:  # a chat template alone gives tokens: 0 means a tokenizer without its vocabulary
                    raise _row_error(
                        file,
                        row0 + j,
                        "the prompt is 0 tokens after the chat template, so the tokenizer of "
                        "actor_rollout_ref.model.path turns text into nothing",
                        "give the model directory its tokenizer files (tokenizer.json or the vocabulary files)",
                    )
                if len(ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        stats["filtered_overlong"] += 1
                        continue
                    if truncation == "error":
                        raise _row_error(
                            file,
                            row0 + j,
                            f"the prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length} "
                            "(data.truncation=error)",
                            "raise data.max_prompt_length, set data.filter_overlong_prompts=true, "
                            "or set data.truncation=left",
                        )
                    ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                    stats["truncated"] += 1
                tokens.extend(ids)
                kept_lengths.append(len(ids))
                kept.append(j)
            lengths.append(np.array(kept_lengths, dtype=np.int64))
            codes.append(_encode_sources((values[0][j] for j in kept), codes_of)[1])
            taken = pa.array(kept, type=pa.int64())
            file_truths.append(pc.struct_field(batch.column("reward_model"), "ground_truth").take(taken))
            if "extra_info" in columns and not pa.types.is_null(batch.column("extra_info").type):
                file_infos.append(batch.column("extra_info").take(taken))
            if keep_messages:
                file_messages.append(batch.column(prompt_key).take(taken))
            file_kept += len(kept)
            row0 += len(batch)
        stats["rows"] += row0
        if file_kept:  # one contiguous Arrow array per file (files may differ in types)
            file_starts.append(file_starts[-1] + file_kept)
            ground_truths.append(pa.chunked_array(file_truths).combine_chunks())
            extra_infos.append(pa.chunked_array(file_infos).combine_chunks() if file_infos else None)
            if keep_messages:
                messages.append(pa.chunked_array(file_messages).combine_chunks())
    lengths = np.concatenate(lengths or [np.zeros(0, np.int64)])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    records = PromptStore(
        _Columns(
            token_ids=tokens.finish(),
            offsets=offsets,
            source_codes=np.concatenate(codes or [np.zeros(0, np.int32)]).astype(_codes_dtype(len(codes_of))),
            sources=tuple(codes_of),
            file_starts=np.array(file_starts, dtype=np.int64),
            ground_truths=tuple(ground_truths),
            extra_infos=tuple(extra_infos),
            messages=tuple(messages) if keep_messages else None,
        )
    )
    stats["kept"] = len(records)
    if stats["filtered_overlong"]:
        logger.warning(
            "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts=true)",
            stats["filtered_overlong"],
            stats["rows"],
            max_prompt_length,
        )
    if stats["truncated"]:
        kept = "last" if truncation == "left" else "first"
        # The end of a prompt is the generation prompt the template appends (e.g. "<|im_start|>assistant\n").
        why = (
            ""
            if truncation == "left"
            else (
                ": cutting the end drops the generation prompt the chat template appends, so the model continues the "
                "prompt instead of answering; data.truncation=left keeps it"
            )
        )
        logger.warning(
            "cut %d of %d prompts to their %s data.max_prompt_length=%d tokens (data.truncation=%s)%s",
            stats["truncated"],
            stats["rows"],
            kept,
            max_prompt_length,
            truncation,
            why,
        )
    if not len(records):
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
    and takes the same global batch, then its own slice. ``records`` is a ``PromptStore`` (only
    the batch's records are built) or any sequence. ``key``: the config key of ``batch_size``, for the errors.
    """

    def __init__(
        self,
        records: PromptStore | Sequence[PromptRecord],
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        key: str = "data.train_batch_size",
    ):
        if not 0 < batch_size <= len(records):
            raise ValueError(
                f"{key}={batch_size}: must be between 1 and the {len(records)} prompts of the "
                f"dataset. Fix: lower {key} or add prompts"
            )
        self.key = key  # the config key batch_size came from, for the messages
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
        return self.take(self.next_indices())

    def next_indices(self) -> list[int]:
        """The rows of the next ``batch_size`` records (``take`` builds them); advances the position."""
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        start = self.index * self.batch_size
        self.index += 1
        return self._epoch_order()[start : start + self.batch_size].tolist()

    def take(self, indices: Sequence[int]) -> list[PromptRecord]:
        """The records of rows ``indices``."""
        if isinstance(self.records, PromptStore):
            return self.records.take(indices)
        return [self.records[i] for i in indices]

    def state_dict(self) -> dict[str, int]:
        """The position after the batches taken so far."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (same records, batch size, shuffle and seed)."""
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.batches_per_epoch:
            raise ValueError(
                f"sampler state {state}: index must be within 0..{self.batches_per_epoch} batches per epoch; "
                f"the checkpoint was written with another dataset or {self.key}"
            )
        self.epoch, self.index = epoch, index


def collate_prompts(records: Iterable[PromptRecord], pad_token_id: int) -> dict[str, Any]:
    """The prompt fields of a ``Batch``: ``prompt_ids``/``prompt_mask`` ``[B, P]`` (left-padded) and per-row lists;
    ``raw_prompts`` holds the records' chat messages where every record has them, else it is empty.

    ``records``: a list of records or a ``PromptStore`` slice."""
    records = list(records)
    messages = [r.messages for r in records]
    prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in records], pad_token_id)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "data_sources": [r.data_source for r in records],
        "ground_truths": [r.ground_truth for r in records],
        "extra_infos": [r.extra_info for r in records],
        "raw_prompts": messages if all(m is not None for m in messages) else [],
    }
