"""Host memory and load time of the prompt store, against the tuple-of-ints records it replaced.

    PYTHONPATH=. python scripts/bench_prompts.py                       # 1M prompts x 200 tokens
    PYTHONPATH=. python scripts/bench_prompts.py --rows 100000 --load-rows 20000
    git show <old commit>:dsrl/data/datasets.py > /tmp/old_datasets.py
    PYTHONPATH=. python scripts/bench_prompts.py --old-datasets /tmp/old_datasets.py   # also the old loader

Writes ``--rows`` synthetic prompts in verl's parquet schema to a temporary directory (one user
message of 181 characters: 200 tokens with the character tokenizer of scripts/make_tiny_model.py
and its chat template), then measures, each part in a fresh subprocess so that peak RSS
(``getrusage`` maxrss) belongs to that part alone:

- ``old memory``: the previous representation rebuilt: ``--rows`` records holding a tuple of 200
  Python ints (random ids below 150k, as a real vocabulary gives) and per-row Python metadata
  (data_source str, ground_truth str, extra_info dict), as the old loader's ``to_pylist`` made them;
- ``new memory``: a ``PromptStore`` of the same size built from arrays (no tokenization);
- ``new load``: the real ``load_prompts`` on the first ``--load-rows`` rows (chat template +
  tokenizer; the character tokenizer is slow, ~0.3 ms per 200-character prompt);
- ``old load``: the same with the loader in ``--old-datasets``, if given.

RSS delta = resident memory after the part (inputs dropped, ``gc.collect()``) minus before it;
bytes/token = that delta (and, for the store, ``nbytes``) over the tokens held.
"""

import argparse
import gc
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_TOKENS = 19  # "<|im_start|>user\n" ... "<|im_end|>\n<|im_start|>assistant\n" with the tiny tokenizer
SOURCES = ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "arithmetic", "other"]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def tiny_tokenizer():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_tokenizer()


def write_parquet(path: Path, rows: int, tokens: int) -> None:
    """verl's schema: data_source, prompt [{role, content}], ability, reward_model, extra_info."""
    width = tokens - TEMPLATE_TOKENS
    filler = "What is x+y? " * (width // 13 + 1)
    content = pa.array([(f"{i:09d}: " + filler)[:width] for i in range(rows)])
    message = pa.StructArray.from_arrays([pa.array(["user"] * rows), content], names=["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32)), message)
    index = pa.array(np.arange(rows))
    table = pa.table(
        {
            "data_source": pa.array([SOURCES[i % len(SOURCES)] for i in range(rows)]),
            "prompt": prompt,
            "ability": pa.array(["math"] * rows),
            "reward_model": pa.StructArray.from_arrays(
                [pa.array(["rule"] * rows), pc.cast(index, pa.string())], names=["style", "ground_truth"]
            ),
            "extra_info": pa.StructArray.from_arrays([pa.array(["train"] * rows), index], names=["split", "index"]),
        }
    )
    pq.write_table(table, path)


def part_old_memory(rows: int, tokens: int) -> dict:
    from dsrl.data.datasets import PromptRecord

    rng = np.random.default_rng(0)
    before = rss()
    start = time.perf_counter()
    records = []
    for i in range(rows):
        ids = tuple(rng.integers(0, 150_000, tokens).tolist())  # fresh int objects, as tokenizer output
        source = "".join(SOURCES[i % len(SOURCES)])  # a new str per row, as to_pylist gives
        records.append(PromptRecord(ids, source, str(i), {"split": "".join("train"), "index": i}))
    gc.collect()
    return {"rss_delta": rss() - before, "tokens": rows * tokens, "seconds": time.perf_counter() - start}


def part_new_memory(rows: int, tokens: int) -> dict:
    from dsrl.data.datasets import PromptSampler, PromptStore

    before = rss()
    start = time.perf_counter()
    token_ids = np.random.default_rng(0).integers(0, 150_000, rows * tokens, dtype=np.int32)
    index = pa.array(np.arange(rows))
    store = PromptStore.from_arrays(
        token_ids,
        np.full(rows, tokens),
        [SOURCES[i % len(SOURCES)] for i in range(rows)],
        pc.cast(index, pa.string()),
        pa.StructArray.from_arrays([pa.array(["train"] * rows), index], names=["split", "index"]),
    )
    del token_ids, index
    gc.collect()
    seconds = time.perf_counter() - start
    sampler = PromptSampler(store, 1024, shuffle=True, seed=1)
    sampler.next_batch()  # the epoch's permutation
    tic = time.perf_counter()
    batch = sampler.next_batch()
    batch_ms = (time.perf_counter() - tic) * 1e3
    assert len(batch) == 1024 and len(batch[0].prompt_ids) == tokens
    parts = {
        "token_ids": store._columns.token_ids.nbytes,
        "offsets": store._columns.offsets.nbytes,
        "source_codes": store._columns.source_codes.nbytes,
        "ground_truths": sum(a.nbytes for a in store._columns.ground_truths),
        "extra_infos": sum(a.nbytes for a in store._columns.extra_infos if a is not None),
    }
    return {
        "rss_delta": rss() - before,
        "nbytes": store.nbytes,
        "parts": parts,
        "tokens": store.num_tokens,
        "seconds": seconds,
        "batch_1024_ms": batch_ms,
    }


def part_load(path: str, rows: int, tokens: int, datasets_file: str | None) -> dict:
    if datasets_file:
        spec = importlib.util.spec_from_file_location("old_datasets", datasets_file)
        datasets = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(datasets)
    else:
        from dsrl.data import datasets
    tokenizer = tiny_tokenizer()
    before = rss()
    start = time.perf_counter()
    records, stats = datasets.load_prompts(
        path,
        tokenizer,
        max_prompt_length=tokens + 56,
        filter_overlong_prompts=True,
        truncation="error",
        max_samples=rows,
    )
    seconds = time.perf_counter() - start
    gc.collect()
    assert stats["kept"] == rows and len(records[0].prompt_ids) == tokens, (stats, len(records[0].prompt_ids))
    result = {"rss_delta": rss() - before, "tokens": rows * tokens, "seconds": seconds}
    if hasattr(records, "nbytes"):
        result["nbytes"] = records.nbytes
    return result


def run_part(args: argparse.Namespace, part: str, *extra: str) -> dict:
    command = [sys.executable, __file__, "--part", part, "--rows", str(args.rows), "--tokens", str(args.tokens)]
    out = subprocess.run(command + list(extra), check=True, capture_output=True, text=True, env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(name: str, result: dict) -> None:
    gib, tokens = 2**30, result["tokens"]
    line = (
        f"{name:<11} {tokens / 1e6:7.1f}M tokens  peak RSS {result['maxrss'] / gib:6.2f} GiB  "
        f"RSS delta {result['rss_delta'] / gib:6.2f} GiB = {result['rss_delta'] / tokens:5.2f} B/token"
    )
    if "nbytes" in result:
        line += f"  nbytes {result['nbytes'] / tokens:5.2f} B/token"
    print(line + f"  {result['seconds']:7.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows", type=int, default=1_000_000, help="prompts in the synthetic file and the memory parts"
    )
    parser.add_argument("--tokens", type=int, default=200, help="tokens per prompt (chat template included)")
    parser.add_argument("--load-rows", type=int, default=100_000, help="rows loaded through load_prompts")
    parser.add_argument("--old-datasets", help="a copy of the old dsrl/data/datasets.py: also time its loader")
    parser.add_argument("--skip-old-memory", action="store_true", help="skip rebuilding the tuple records")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.part:  # one measurement, in this subprocess
        if args.part == "old-memory":
            result = part_old_memory(args.rows, args.tokens)
        elif args.part == "new-memory":
            result = part_new_memory(args.rows, args.tokens)
        else:
            result = part_load(args.path, args.load_rows, args.tokens, args.old_datasets)
        print(json.dumps(result | {"maxrss": maxrss()}))
        return

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = Path(tmp) / "prompts.parquet"
        write_parquet(path, args.rows, args.tokens)
        load_path = path
        if args.load_rows < args.rows:  # the old loader reads whole files: give it one of --load-rows rows
            load_path = Path(tmp) / "prompts_head.parquet"
            pq.write_table(pq.read_table(path).slice(0, args.load_rows), load_path)
        print(
            f"wrote {args.rows} prompts of {args.tokens} tokens ({path.stat().st_size / 2**20:.0f} MiB parquet) "
            f"in {time.perf_counter() - start:.1f} s"
        )
        results = {}
        if not args.skip_old_memory:
            results["old memory"] = run_part(args, "old-memory")
        results["new memory"] = run_part(args, "new-memory")
        load = ["--path", str(load_path), "--load-rows", str(args.load_rows)]
        results["new load"] = run_part(args, "load", *load)
        if args.old_datasets:
            results["old load"] = run_part(args, "load", *load, "--old-datasets", args.old_datasets)
    for name, result in results.items():
        report(name, result)
    parts = results["new memory"]["parts"]
    print(
        "new store parts (B/token): "
        + ", ".join(f"{k} {v / results['new memory']['tokens']:.3f}" for k, v in parts.items())
    )
    print(f"new store: a sampler batch of 1024 records built in {results['new memory']['batch_1024_ms']:.1f} ms")


if __name__ == "__main__":
    main()
