"""Write prompt datasets in verl's parquet schema: DIR/train.parquet and DIR/test.parquet.

    python scripts/prepare_data.py --task arithmetic                       # synthetic, offline
    python scripts/prepare_data.py --task calculator                       # synthetic, for tool calls
    python scripts/prepare_data.py --task worded                           # synthetic, for pretrained chat models
    python scripts/prepare_data.py --task gsm8k --local-path ~/gsm8k       # or from the hub when online
    python scripts/prepare_data.py --task math --out outputs/data/math

Rows: ``data_source``, ``prompt`` (one user message), ``ability``, ``reward_model`` ({style: rule,
ground_truth}), ``extra_info`` ({split, index, ...}), as verl's examples/data_preprocess write them
(same data_source names and instructions), so the files work in verl and in dsrl alike:

- arithmetic: ``"a+b="`` -> ``"a+b"`` as an integer string (see ``dsrl.data.arithmetic``);
  ``--train-size``/``--test-size`` default to 5000/200, ``--seed`` picks the problems.
- calculator: ``"What is a*b?"`` (3-digit operands) -> ``"a*b"`` as an integer string, the task of
  tool-integrated rollouts (see ``dsrl.data.calculator``); sizes and seed as for arithmetic.
- worded: ``"What is a+b? Answer with just the number."`` (operands 0..19) -> ``"a+b"``, scored on the
  response's last integer (see ``dsrl.data.worded``); ``--train-size``/``--test-size`` default to 1200/100
  (the whole test pool; the train split repeats its 300 problems).
- gsm8k (``openai/gsm8k``, config ``main``): question + the ``####`` instruction; ground truth
  = the number after ``####`` without commas.
- math (``DigitalLearningGmbH/MATH-lighteval``): problem + the ``\\boxed{}`` instruction; ground
  truth = the last boxed answer of the reference solution.

For gsm8k/math, ``--local-path DIR`` reads a local copy: ``train``/``test`` files in DIR or below
(``train.jsonl``, ``test.parquet``, or the hub layout ``main/train-00000-of-00001.parquet``).
Without it the hub is tried via ``datasets.load_dataset``. ``--train-size``/``--test-size`` take a
seeded random subset (all rows by default); ``extra_info.index`` is the row in the source split.
"""

import argparse
import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dsrl.data import arithmetic, calculator, worded
from dsrl.rewards.gsm8k import extract_answer
from dsrl.rewards.math import last_boxed_answer

SOURCES = {
    # task: (hub dataset, hub config, question field, solution field)
    "gsm8k": ("openai/gsm8k", "main", "question", "answer"),
    "math": ("DigitalLearningGmbH/MATH-lighteval", None, "problem", "solution"),
}
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SYNTHETIC = {"arithmetic": arithmetic, "calculator": calculator, "worded": worded}  # generated offline, no source files
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _read_local_split(root: Path, split: str) -> list[dict]:
    """All rows of ``split`` from jsonl/json/parquet files named ``<split>*`` under ``root``."""
    files = (
        sorted(p for p in root.rglob(f"{split}*") if p.is_file() and p.suffix in (".jsonl", ".json", ".parquet"))
        if root.is_dir()
        else []
    )
    if not files:
        raise SystemExit(
            f"--local-path {root}: no {split}*.jsonl / {split}*.parquet file in it or below. "
            "Fix: point --local-path at a directory holding the dataset's train and test files."
        )
    rows = []
    for file in files:
        if file.suffix == ".parquet":
            rows += pq.read_table(file).to_pylist()
        else:
            with open(file) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _read_hub_split(task: str, split: str) -> list[dict]:
    import datasets

    name, config, _, _ = SOURCES[task]
    try:
        return datasets.load_dataset(name, config, split=split).to_list()
    except Exception as exc:  # the hub raises many kinds (connection, offline mode, auth)
        raise SystemExit(
            f"could not load {name} ({split}) from the Hugging Face hub: {type(exc).__name__}: {exc}\n"
            f"Fix: download it where the hub is reachable (e.g. `hf download {name} --repo-type dataset "
            f"--local-dir DIR`) and pass --local-path DIR."
        ) from exc


def _convert(task: str, examples: list[dict], split: str) -> list[dict]:
    """verl-schema rows of gsm8k/math source examples; extra_info.index = position in the split."""
    data_source, _, question_field, solution_field = SOURCES[task]
    rows = []
    for index, example in enumerate(examples):
        if question_field not in example or solution_field not in example:
            raise SystemExit(
                f"{task} {split} row {index}: needs fields {question_field!r} and {solution_field!r}, "
                f"has {sorted(example)}"
            )
        question, solution = example[question_field], example[solution_field]
        if task == "gsm8k":
            ground_truth = extract_answer(solution, method="strict")
            content = question + " " + GSM8K_INSTRUCTION
            extra_info = {"split": split, "index": index, "answer": solution, "question": question}
        else:
            ground_truth = last_boxed_answer(solution)
            content = question + " " + MATH_INSTRUCTION
            extra_info = {"split": split, "index": index}
        if ground_truth is None:
            raise SystemExit(
                f"{task} {split} row {index}: the reference {solution_field!r} has no final answer to extract: "
                f"{solution[-200:]!r}"
            )
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": content}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": extra_info,
            }
        )
    return rows


def _subset(rows: list[dict], size: int | None, seed: int, split: str) -> list[dict]:
    if size is None:
        return rows
    if not 0 < size <= len(rows):
        raise SystemExit(f"--{split}-size {size}: the {split} split has {len(rows)} rows; choose 1..{len(rows)}")
    picked = sorted(random.Random(f"dsrl-prepare/{split}/{seed}").sample(range(len(rows)), size))
    return [rows[i] for i in picked]


def build_split(task: str, split: str, size: int | None, seed: int, local_path: str | None) -> list[dict]:
    """The rows of one split of ``task``."""
    if task in SYNTHETIC:
        module = SYNTHETIC[task]
        default = module.DEFAULT_TRAIN_SIZE if split == "train" else module.DEFAULT_TEST_SIZE
        return module.rows(split, default if size is None else size, seed)
    examples = _read_local_split(Path(local_path).expanduser(), split) if local_path else _read_hub_split(task, split)
    return _subset(_convert(task, examples, split), size, seed, split)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=["arithmetic", "calculator", "worded", "gsm8k", "math"])
    parser.add_argument("--out", help="output directory (default: outputs/data/<task>)")
    parser.add_argument(
        "--train-size", type=int, help="rows in train.parquet (arithmetic, calculator: 5000; worded: 1200; else all)"
    )
    parser.add_argument(
        "--test-size", type=int, help="rows in test.parquet (arithmetic, calculator: 200; worded: 100; else all)"
    )
    parser.add_argument("--seed", type=int, default=arithmetic.DEFAULT_SEED, help="picks the rows (default 0)")
    parser.add_argument("--local-path", help="gsm8k/math: directory with a local copy of the hub dataset")
    args = parser.parse_args(argv)
    if args.local_path and args.task in SYNTHETIC:
        parser.error(f"--local-path applies to gsm8k and math; {args.task} is generated")

    out = Path(args.out or f"outputs/data/{args.task}")
    splits = {
        split: build_split(args.task, split, size, args.seed, args.local_path)
        for split, size in (("train", args.train_size), ("test", args.test_size))
    }
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"{out / f'{split}.parquet'}: {len(rows)} rows")
    print("example:", json.dumps(splits["train"][0]))


if __name__ == "__main__":
    main(sys.argv[1:])
