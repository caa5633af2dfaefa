"""Checks of the files a config names that cost a few reads, made at validation so that a bad file fails in a
second, as one line with its fix, instead of as a traceback after seconds of loading (or, for a model directory
without tokenizer files, as an empty tokenizer that turns every prompt into 0 tokens).

- Data files (``data.train_files``, ``data.val_files``): parquet by their magic bytes; a directory stands for the
  ``*.parquet`` files in it (``parquet_paths``, which the loader uses too).
- Model paths: a local directory or a hub id owner/name (``model_path_problem``). In a local directory,
  ``config.json`` with a ``model_type``; the weights ``from_pretrained`` would load (every shard of an index),
  complete by their headers; the tokenizer's vocabulary files.
- ``not_regular``: what every check asks before it opens a file (here, and for the DeepSpeed JSON, the YAML layers,
  the reward file and the user's modules): reading a FIFO blocks until something writes to it, a device may never end.

Only headers are read: no torch, transformers or pyarrow.
"""

from __future__ import annotations

import json
import re
import stat
import zipfile
from collections.abc import Sequence
from pathlib import Path

PARQUET_MAGIC = b"PAR1"  # the first and last 4 bytes of a parquet file
# What from_pretrained loads, in its order of preference; the first present is checked.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_REFETCH = (
    "download the model again (huggingface-cli download OWNER/NAME --local-dir DIR) or save it with save_pretrained"
)


_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def file_kind(path: Path) -> str | None:
    """What is at ``path``, a symlink followed: "a regular file", "a directory", "a FIFO", ...; None for nothing
    (or a symlink that points nowhere)."""
    try:
        return _KINDS[stat.S_IFMT(path.stat().st_mode)]
    except OSError:
        return None


def not_regular(path: Path) -> str | None:
    """``not a regular file (a FIFO)`` when something other than a regular file is at ``path``; None for a regular
    file or nothing at all (the callers say "missing" in their own words)."""
    kind = file_kind(path)
    return None if kind in (None, "a regular file") else f"not a regular file ({kind})"


def parquet_paths(files: str | Sequence[str]) -> list[str]:
    """The files a ``data.*_files`` value names, in order: each path, a directory standing for the ``*.parquet``
    files directly in it, sorted by name."""
    paths = []
    for file in [files] if isinstance(files, str) else files:
        path = Path(file).expanduser()
        paths += [str(p) for p in sorted(path.glob("*.parquet"))] if path.is_dir() else [file]
    return paths


def parquet_problem(path: Path) -> str | None:
    """Why the file at ``path`` is not a complete parquet file, or None."""
    if problem := not_regular(path):
        return problem
    if not path.exists():  # listed in a directory, but a link to nothing
        return "a symlink that points nowhere"
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if head != PARQUET_MAGIC:
        return f"not a parquet file ({size} bytes, not starting with {PARQUET_MAGIC.decode()})"
    if size < 12 or tail != PARQUET_MAGIC:
        return f"a truncated parquet file ({size} bytes, no {PARQUET_MAGIC.decode()} footer)"
    return None


def _json(path: Path) -> tuple[object, str | None]:
    """The JSON in ``path`` and None, or None and why it cannot be read."""
    try:
        return json.loads(path.read_bytes()), None
    except OSError as err:
        return None, f"{path.name} cannot be read ({err.strerror})"
    except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        return None, f"{path.name} is not valid JSON ({err})"


def adapter_settings(path: Path) -> tuple[dict, str | None]:
    """``adapter_config.json`` of the PEFT adapter directory ``path`` and None, or ``{}`` and why it is not a LoRA
    adapter's: unreadable, cut short, another PEFT method, a rank that is not a positive whole number."""
    file = path / "adapter_config.json"
    settings, problem = ({}, f"{file.name} is not a regular file") if not_regular(file) else _json(file)
    if problem is None and not isinstance(settings, dict):
        problem = f"{file.name} holds a JSON {type(settings).__name__}, not PEFT's settings object"
    if problem is not None:
        return {}, problem
    assert isinstance(settings, dict)
    if settings.get("peft_type") != "LORA":
        return {}, f"a {settings.get('peft_type')!r} adapter, not LoRA"
    rank = settings.get("r")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        return {}, f"{file.name} has r={rank!r}: a LoRA adapter's rank is a positive whole number"
    return settings, None


def _weights_problem(path: Path) -> str | None:
    """Why the weights file ``path`` would not load in full, or None (read from its header)."""
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        # 8 bytes of little-endian header length, the JSON header, then the tensors' bytes.
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + length > size:
                return f"{path.name} is truncated ({size} bytes, shorter than its header)"
            try:
                header = json.loads(f.read(length))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            except (ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError, AttributeError):
                return f"{path.name} is not a safetensors file (its header is not a tensor table)"
        if 8 + length + end > size:
            return f"{path.name} is truncated ({size} bytes of the {8 + length + end} its header describes)"
        return None
    with path.open("rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save's format since PyTorch 1.6 (older files are bare pickles)
    if size == 0 or (zipped and not zipfile.is_zipfile(path)):
        return f"{path.name} is truncated ({size} bytes; its zip directory is missing)"
    return None


def _tokenizer_files(path: Path) -> bool:
    """Whether ``path`` holds a tokenizer's vocabulary: tokenizer.json, a sentencepiece or tiktoken model, or a
    BPE/WordPiece vocabulary."""
    names = {p.name for p in path.iterdir()}
    return (
        "tokenizer.json" in names
        or any(name.endswith((".model", ".tiktoken")) for name in names)
        or {"vocab.json", "merges.txt"} <= names
        or "vocab.txt" in names
    )


def model_dir_problems(path: Path, *, tokenizer: bool) -> list[tuple[str, str]]:
    """(rule, fix) of each problem of the local model directory ``path`` that ``from_pretrained`` would meet;
    ``tokenizer``: the run loads its tokenizer from here too."""
    fix = f"put the file itself there, or {_REFETCH}"
    problems = [
        (f"{p.name} is {kind}", fix) for p in sorted(path.iterdir()) if not p.is_dir() and (kind := not_regular(p))
    ]
    if problems:  # the checks below would open them
        return problems
    if not (path / "config.json").is_file():
        problems.append(("no config.json: not a transformers model directory", f"point it at one, or {_REFETCH}"))
    else:
        config, error = _json(path / "config.json")
        if error is not None:
            problems.append((error, _REFETCH))
        elif not isinstance(config, dict) or not config.get("model_type"):
            problems.append(
                (
                    "config.json has no model_type, so transformers cannot tell the architecture",
                    f'add the model_type to config.json (e.g. "model_type": "qwen2"), or {_REFETCH}',
                )
            )
    weights = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if weights is None:
        problems.append((f"no weights (none of {', '.join(WEIGHT_FILES)})", _REFETCH))
    elif weights.name.endswith(".index.json"):
        index, error = _json(weights)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if error is not None or not isinstance(weight_map, dict):
            problems.append((error or f"{weights.name} has no weight_map", _REFETCH))
        else:
            for shard in sorted(set(weight_map.values())):
                if not (path / shard).is_file():
                    problems.append((f"{weights.name} names the shard {shard}, which is missing", _REFETCH))
                elif problem := _weights_problem(path / shard):
                    problems.append((problem, _REFETCH))
    elif problem := _weights_problem(weights):
        problems.append((problem, _REFETCH))
    if tokenizer and not _tokenizer_files(path):
        problems.append(
            (
                "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json with merges.txt, vocab.txt or "
                "*.tiktoken): transformers would build an empty tokenizer that turns every prompt into 0 tokens",
                "copy the tokenizer files of the model into the directory (tokenizer.save_pretrained(DIR))",
            )
        )
    return problems


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_path_problem(path: str) -> str | None:
    """None if ``path`` is an existing directory or looks like a hub id owner/name that is not a local path."""
    if Path(path).expanduser().is_dir() or (_HUB_ID.match(path) and not Path(path).exists()):
        return None
    return "no such model directory (a hub id is owner/name)"


def model_config(path: Path) -> dict | None:
    """The model directory's ``config.json``, None where it is missing or unreadable (``model_dir_problems`` says
    so)."""
    config, error = _json(path / "config.json")
    return config if error is None and isinstance(config, dict) else None


def packing_problem(config: dict) -> str | None:
    """Why a model of this ``config.json`` cannot run packed rows (``use_remove_padding``), or None. Packing relies
    on transformers' mask from restarting position ids, which full and sliding attention layers read; a layer
    that keeps a state along the row (linear attention, state-space), multimodal rotary positions and a vision
    tower are not built to restart there."""
    nested = config.get("text_config")
    text: dict = nested if isinstance(nested, dict) else config
    layers = {str(kind) for kind in text.get("layer_types") or ()}
    stateful = sorted(layers - {"full_attention", "sliding_attention", "chunked_attention"})
    if stateful:
        return f"its layers of type {', '.join(stateful)} carry a state along a packed row into the next sequence"
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if isinstance(rope, dict) and ("mrope_section" in rope or rope.get("rope_type") == "mrope"):
        return "its multimodal rotary positions (mrope) take 3-D position ids, not a packed row's restarting ones"
    if "vision_config" in config:
        return "it is a vision-language model, whose image tokens dsrl does not place in packed rows"
    return None


def sequence_parallel_problem(config: dict, size: int) -> str | None:
    """Why a model of this ``config.json`` cannot split its attention heads over ``size`` sequence-parallel ranks
    (DeepSpeed's Ulysses gives each rank ``heads / size`` query heads, and a share or a copy of the KV heads), or
    None."""
    nested = config.get("text_config")
    text: dict = nested if isinstance(nested, dict) else config
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return None
    if heads % size:
        return f"its {heads} attention heads do not split over {size} ranks"
    if kv_heads % size and size % kv_heads:
        return f"its {kv_heads} KV heads neither split over {size} ranks nor divide {size}"
    return None
