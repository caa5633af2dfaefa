"""scripts/prepare_data.py: verl-schema parquet files for arithmetic, calculator and worded sums (synthetic), GSM8K and
MATH (local copies)."""

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dsrl.data import arithmetic, calculator, worded
from dsrl.data.datasets import load_prompts
from dsrl.rewards import compute_score

_spec = importlib.util.spec_from_file_location(
    "prepare_data", Path(__file__).parents[2] / "scripts" / "prepare_data.py"
)
prepare_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_data)


def read(path):
    return pq.read_table(path).to_pylist()


def test_arithmetic_is_deterministic_and_in_verl_schema(tmp_path):
    prepare_data.main(["--task", "arithmetic", "--out", str(tmp_path / "a"), "--train-size", "50", "--test-size", "20"])
    prepare_data.main(["--task", "arithmetic", "--out", str(tmp_path / "b"), "--train-size", "50", "--test-size", "20"])
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.parquet").read_bytes() == (tmp_path / "b" / f"{split}.parquet").read_bytes()
    rows = read(tmp_path / "a" / "train.parquet")
    assert len(rows) == 50 and len(read(tmp_path / "a" / "test.parquet")) == 20
    first = rows[0]
    assert set(first) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert first["data_source"] == "arithmetic" and first["reward_model"]["style"] == "rule"
    assert first["extra_info"] == {"split": "train", "index": 0}
    for r in rows:
        a, b = map(int, r["prompt"][0]["content"].rstrip("=").split("+"))
        assert r["prompt"][0]["role"] == "user" and r["reward_model"]["ground_truth"] == str(a + b)
        assert compute_score("arithmetic", str(a + b), r["reward_model"]["ground_truth"]) == 1.0


def test_arithmetic_test_problems_never_appear_in_any_train_split():
    test = set(arithmetic.problems("test", arithmetic.TEST_POOL_SIZE, 0))
    for seed in (0, 1, 2):
        assert not test & set(arithmetic.problems("train", 3000, seed))
    assert arithmetic.problems("train", 10, 1) != arithmetic.problems("train", 10, 2)
    with pytest.raises(ValueError, match="choose 1..1000"):
        arithmetic.problems("test", 1001, 0)


def test_calculator_is_deterministic_and_in_verl_schema(tmp_path):
    for name in ("a", "b"):
        out = str(tmp_path / name)
        prepare_data.main(["--task", "calculator", "--out", out, "--train-size", "50", "--test-size", "20"])
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.parquet").read_bytes() == (tmp_path / "b" / f"{split}.parquet").read_bytes()
    rows = read(tmp_path / "a" / "train.parquet")
    assert len(rows) == 50 and len(read(tmp_path / "a" / "test.parquet")) == 20
    assert rows[0]["data_source"] == "calculator" and rows[0]["reward_model"]["style"] == "rule"
    assert rows[0]["extra_info"] == {"split": "train", "index": 0}  # no tools_kwargs: parquet has no empty struct
    for r in rows:
        [message] = r["prompt"]
        a, b = map(int, message["content"].removeprefix("What is ").removesuffix("?").split("*"))
        assert message["role"] == "user" and 100 <= a <= 999 and 100 <= b <= 999
        assert r["reward_model"]["ground_truth"] == str(a * b)
        assert compute_score("calculator", f"so {a * b}", r["reward_model"]["ground_truth"]) == 1.0


def test_calculator_test_problems_never_appear_in_any_train_split():
    test = set(calculator.problems("test", calculator.TEST_POOL_SIZE, 0))
    assert len(test) == calculator.TEST_POOL_SIZE
    for seed in (0, 1):
        train = calculator.problems("train", 20000, seed)
        assert len(set(train)) == 20000 and not test & set(train)
    assert calculator.problems("train", 10, 1) != calculator.problems("train", 10, 2)
    with pytest.raises(ValueError, match="choose 1..1000"):
        calculator.problems("test", 1001, 0)
    with pytest.raises(SystemExit):  # argparse: calculator is generated
        prepare_data.main(["--task", "calculator", "--local-path", "x"])


def test_worded_is_deterministic_and_in_verl_schema(tmp_path):
    for name in ("a", "b"):
        prepare_data.main(["--task", "worded", "--out", str(tmp_path / name)])
    for split in ("train", "test"):
        assert (tmp_path / "a" / f"{split}.parquet").read_bytes() == (tmp_path / "b" / f"{split}.parquet").read_bytes()
    rows, test = read(tmp_path / "a" / "train.parquet"), read(tmp_path / "a" / "test.parquet")
    assert (len(rows), len(test)) == (worded.DEFAULT_TRAIN_SIZE, worded.TEST_POOL_SIZE) == (1200, 100)
    assert rows[0]["data_source"] == "worded_arithmetic" and rows[0]["extra_info"] == {"split": "train", "index": 0}
    pairs = []
    for r in rows + test:
        [message] = r["prompt"]
        a, b = map(
            int, message["content"].removeprefix("What is ").removesuffix("? Answer with just the number.").split("+")
        )
        assert message["role"] == "user" and 0 <= a <= 19 and 0 <= b <= 19
        assert r["reward_model"]["ground_truth"] == str(a + b)
        assert compute_score("worded_arithmetic", f"{a} + {b} = {a + b}", r["reward_model"]["ground_truth"]) == 1.0
        pairs.append((a, b))
    # The train split passes over its 300 problems four times, each problem once per pass; the test split is the
    # whole test pool, none of it in training.
    train, held_out = pairs[:1200], pairs[1200:]
    assert len(set(held_out)) == 100 and not set(held_out) & set(train)
    for start in range(0, 1200, worded.TRAIN_POOL_SIZE):
        assert len(set(train[start : start + worded.TRAIN_POOL_SIZE])) == worded.TRAIN_POOL_SIZE
    assert train[:300] != train[300:600]  # each pass in a new order


def test_worded_sizes_are_checked():
    assert len(worded.problems("train", 301, 0)) == 301
    assert worded.problems("test", 5, 1) != worded.problems("test", 5, 2)
    with pytest.raises(ValueError, match="choose 1..100"):
        worded.problems("test", 101, 0)
    with pytest.raises(ValueError, match="choose 1..any number"):
        worded.problems("train", 0, 0)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gsm8k_from_a_local_copy(tmp_path):
    source = tmp_path / "gsm8k"
    write_jsonl(
        source / "main" / "train.jsonl",
        [
            {"question": "Tom has 1,000 apples and buys 234. How many?", "answer": "1000+234=1234\n#### 1,234"},
            {"question": "2+2?", "answer": "#### 4"},
        ],
    )
    write_jsonl(source / "main" / "test.jsonl", [{"question": "3+3?", "answer": "#### 6"}])
    out = tmp_path / "out"
    prepare_data.main(["--task", "gsm8k", "--local-path", str(source), "--out", str(out)])
    rows = read(out / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1234", "4"]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["prompt"][0]["content"].startswith("Tom has 1,000 apples")
    assert rows[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert rows[0]["extra_info"] == {
        "split": "train",
        "index": 0,
        "answer": "1000+234=1234\n#### 1,234",
        "question": "Tom has 1,000 apples and buys 234. How many?",
    }
    assert read(out / "test.parquet")[0]["extra_info"]["split"] == "test"
    assert compute_score("openai/gsm8k", "so #### 1,234", rows[0]["reward_model"]["ground_truth"]) == 1.0


def test_math_from_a_local_copy_with_a_seeded_subset(tmp_path):
    source = tmp_path / "math"
    train = [
        {
            "problem": f"What is {i}/2?",
            "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$.",
            "level": "Level 1",
            "type": "Algebra",
        }
        for i in range(6)
    ]
    write_jsonl(source / "train.jsonl", train)
    write_jsonl(source / "test.jsonl", [{"problem": "Nested?", "solution": "\\boxed{\\sqrt{\\frac{1}{2}}}"}])
    out = tmp_path / "out"
    prepare_data.main(
        ["--task", "math", "--local-path", str(source), "--out", str(out), "--train-size", "3", "--seed", "5"]
    )
    rows = read(out / "train.parquet")
    assert len(rows) == 3 and rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    for r in rows:  # the subset keeps each row's source index and its own answer
        i = r["extra_info"]["index"]
        assert r["reward_model"]["ground_truth"] == f"\\frac{{{i}}}{{2}}"
        assert (
            r["prompt"][0]["content"]
            == f"What is {i}/2? Let's think step by step and output the final answer within \\boxed{{}}."
        )
    assert read(out / "test.parquet")[0]["reward_model"]["ground_truth"] == "\\sqrt{\\frac{1}{2}}"


def test_clear_failures(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no train\\*.jsonl"):
        prepare_data.main(["--task", "gsm8k", "--local-path", str(tmp_path), "--out", str(tmp_path / "o")])
    write_jsonl(tmp_path / "m" / "train.jsonl", [{"problem": "p", "solution": "no box"}])
    write_jsonl(tmp_path / "m" / "test.jsonl", [{"problem": "p", "solution": "\\boxed{1}"}])
    with pytest.raises(SystemExit, match="math train row 0: .* no final answer"):
        prepare_data.main(["--task", "math", "--local-path", str(tmp_path / "m"), "--out", str(tmp_path / "o")])

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SystemExit, match="(?s)could not load openai/gsm8k.*--local-path"):
        prepare_data.main(["--task", "gsm8k", "--out", str(tmp_path / "o")])


def test_written_files_load_as_prompts(tmp_path):
    spec = importlib.util.spec_from_file_location("mtm", Path(__file__).parents[2] / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prepare_data.main(["--task", "arithmetic", "--out", str(tmp_path), "--train-size", "8", "--test-size", "4"])
    records, stats = load_prompts(
        str(tmp_path / "train.parquet"),
        module.build_tokenizer(),
        max_prompt_length=64,
        filter_overlong_prompts=True,
        truncation="error",
    )
    assert stats["kept"] == 8 and records[0].data_source == "arithmetic"
