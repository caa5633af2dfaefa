"""Validation of the files a config names (issue 13, part 3) and of non-finite numbers and the process-group
timeout (parts 1 and 4): copies of the tiny model and real parquet files, each broken one way, must give one line
naming the key, the problem and the fix, before anything heavy is imported."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsrl import config as C
from tests.conftest import recipe, write_parquet_stub

REPO = Path(__file__).resolve().parents[2]
ACTOR = "actor_rollout_ref.model.path"


@pytest.fixture
def data(tmp_path):
    train, test = write_parquet_stub(tmp_path / "train.parquet"), write_parquet_stub(tmp_path / "test.parquet")
    return [f"data.train_files={train}", f"data.val_files={test}"]


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    """A copy of the tiny model to break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def problems(overrides, name="grpo"):
    try:
        C.load_and_validate(recipe(name), overrides, 1)
    except C.ConfigError as err:
        return err.violations
    return []


def about(found, key):
    return [v for v in found if v.startswith(f"{key}=")]


# ---------------------------------------------------------------- model directories


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def shard(model: Path) -> None:
    """Split model.safetensors into two shards with a model.safetensors.index.json, as save_pretrained does."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, model / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in parts.items() for n in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "model.safetensors").unlink()


def to_bin(model: Path, *, truncated: bool) -> None:
    """Replace the safetensors weights by a torch.save pytorch_model.bin (optionally cut short)."""
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    if truncated:
        truncate(model / "pytorch_model.bin", (model / "pytorch_model.bin").stat().st_size // 2)


BREAKAGES = {
    # name: (how to break the copy, what the one line says)
    "no config.json": (lambda m: (m / "config.json").unlink(), "no config.json: not a transformers model directory"),
    "config.json truncated": (lambda m: truncate(m / "config.json", 40), "config.json is not valid JSON"),
    "config.json not JSON": (
        lambda m: (m / "config.json").write_text("model_type: qwen3\n"),
        "config.json is not valid JSON",
    ),
    "no model_type": (
        lambda m: (m / "config.json").write_text(json.dumps({"vocab_size": 100})),
        "config.json has no model_type",
    ),
    "config.json a list": (lambda m: (m / "config.json").write_text("[1, 2]"), "config.json has no model_type"),
    "no weights": (lambda m: (m / "model.safetensors").unlink(), "no weights (none of model.safetensors"),
    "weights cut in half": (
        lambda m: truncate(m / "model.safetensors", (m / "model.safetensors").stat().st_size // 2),
        "model.safetensors is truncated (",  # "(N bytes of the M its header describes)"
    ),
    "weights cut inside the header": (
        lambda m: truncate(m / "model.safetensors", 20),
        "model.safetensors is truncated",
    ),
    "weights not safetensors": (
        lambda m: (m / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!" + bytes(64)),
        "model.safetensors is not a safetensors file",
    ),
    "a shard missing": (
        lambda m: (shard(m), (m / "model-00002-of-00002.safetensors").unlink()),
        "model.safetensors.index.json names the shard model-00002-of-00002.safetensors, which is missing",
    ),
    "a shard truncated": (
        lambda m: (shard(m), truncate(m / "model-00001-of-00002.safetensors", 5000)),
        "model-00001-of-00002.safetensors is truncated",
    ),
    "index not JSON": (
        lambda m: (shard(m), truncate(m / "model.safetensors.index.json", 30)),
        "model.safetensors.index.json is not valid JSON",
    ),
    "pytorch_model.bin truncated": (lambda m: to_bin(m, truncated=True), "pytorch_model.bin is truncated"),
    "no tokenizer files": (
        lambda m: [(m / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
        "no tokenizer files (tokenizer.json",
    ),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_a_broken_model_directory_is_one_line_with_the_fix(model, data, name):
    breaking, says = BREAKAGES[name]
    breaking(model)
    [line] = problems(data + [f"{ACTOR}={model}"])
    assert line.startswith(f"{ACTOR}={model}: {says}"), line
    assert "; fix: " in line


def test_intact_models_in_every_layout_pass(model, data, tmp_path):
    assert problems(data + [f"{ACTOR}={model}"]) == []
    sharded = Path(shutil.copytree(model, tmp_path / "sharded"))
    shard(sharded)
    assert problems(data + [f"{ACTOR}={sharded}"]) == []
    pickled = Path(shutil.copytree(model, tmp_path / "bin"))
    to_bin(pickled, truncated=False)
    assert problems(data + [f"{ACTOR}={pickled}"]) == []
    bpe = Path(shutil.copytree(model, tmp_path / "bpe"))  # a slow BPE tokenizer's files instead of tokenizer.json
    (bpe / "tokenizer.json").rename(bpe / "vocab.json")
    (bpe / "merges.txt").write_text("#version: 0.2\n")
    assert problems(data + [f"{ACTOR}={bpe}"]) == []


def test_every_problem_of_a_directory_is_reported(model, data):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).unlink()
    found = problems(data + [f"{ACTOR}={model}"])
    rules = [
        "no config.json",
        "no weights (none of model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
        "pytorch_model.bin.index.json)",
        "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json with merges.txt, vocab.txt or *.tiktoken)",
    ]
    assert len(found) == 3 and all(
        line.startswith(f"{ACTOR}={model}: {rule}") for line, rule in zip(found, rules, strict=True)
    )


def test_the_critic_directory_is_checked_but_needs_no_tokenizer(model, data, tiny_model_dir, tmp_path):
    (model / "tokenizer.json").unlink()  # the run's tokenizer is the actor's
    critic = [f"{ACTOR}={tiny_model_dir}", f"critic.model.path={model}"]
    assert problems(data + critic, name="ppo") == []
    (model / "model.safetensors").unlink()
    [line] = problems(data + critic, name="ppo")
    assert line.startswith(f"critic.model.path={model}: no weights")
    assert problems(data + [f"{ACTOR}={tiny_model_dir}"], name="grpo") == []  # no critic built: not read


def test_a_hub_id_is_checked_when_it_downloads(data):
    assert problems(data + [f"{ACTOR}=Qwen/Qwen2.5-0.5B-Instruct"]) == []


def test_validate_only_reports_model_problems_in_a_second_without_importing_torch(model, data):
    (model / "config.json").write_text("{")
    truncate(model / "model.safetensors", 1000)
    code = (
        "import runpy, sys; main = runpy.run_path(sys.argv[1])['main']; rc = main(sys.argv[2:]);"
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(REPO / "scripts" / "train.py"),
            *recipe("grpo"),
            *data,
            f"{ACTOR}={model}",
            "--validate-only",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "WORLD_SIZE": "1"},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].endswith("2 problem(s) in the configuration:") and "Traceback" not in result.stderr
    assert lines[1].startswith(f"  {ACTOR}={model}: config.json is not valid JSON")
    assert lines[2].startswith(f"  {ACTOR}={model}: model.safetensors is truncated (1000 bytes")


# ---------------------------------------------------------------- data files


def write_rows(path: Path) -> str:
    rows = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": "1+1="}],
            "reward_model": {"ground_truth": "2"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize(
    "name, content, says",
    [
        (
            "train.csv",
            b"data_source,prompt\narithmetic,1+1=\n",
            "not a parquet file (35 bytes, not starting with PAR1)",
        ),
        ("train.parquet", b'{"data_source": "arithmetic"}\n', "not a parquet file"),
        ("train.parquet", b"", "not a parquet file (0 bytes"),
        ("train.parquet", None, "a truncated parquet file"),  # a real file cut short
    ],
)
def test_a_file_that_is_not_parquet_is_named_with_the_fix(model, tmp_path, name, content, says):
    path = tmp_path / "data" / name
    path.parent.mkdir()
    if content is None:
        write_rows(path)
        truncate(path, path.stat().st_size - 10)
    else:
        path.write_bytes(content)
    [line] = problems([f"data.train_files={path}", "data.val_files=null", f"{ACTOR}={model}"])
    assert line.startswith(f"data.train_files={path}: {says}"), line
    assert "fix: write it (again) as parquet" in line


def test_a_directory_stands_for_its_parquet_files(model, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for name in ("b.parquet", "a.parquet"):
        write_rows(folder / name)
    (folder / "_SUCCESS").write_text("")  # what Spark leaves beside its files: not read
    assert C.parquet_paths(str(folder)) == [str(folder / "a.parquet"), str(folder / "b.parquet")]
    assert C.parquet_paths([str(folder), "x.parquet"])[-1] == "x.parquet"
    assert problems([f"data.train_files={folder}", "data.val_files=null", f"{ACTOR}={model}"]) == []
    (folder / "c.parquet").write_text("not parquet")
    [line] = problems([f"data.train_files={folder}", "data.val_files=null", f"{ACTOR}={model}"])
    assert line.startswith(f"data.train_files={folder / 'c.parquet'}: not a parquet file")
    empty = tmp_path / "empty"
    empty.mkdir()
    [line] = problems([f"data.train_files=[{folder / 'a.parquet'},{empty}]", "data.val_files=null", f"{ACTOR}={model}"])
    assert line.startswith(f"data.train_files={empty}: the directory holds no *.parquet files")


# ---------------------------------------------------------------- numbers and the process-group timeout


@pytest.mark.parametrize(
    "override, shown",
    [
        ("actor_rollout_ref.actor.optim.lr=inf", "inf"),
        ("actor_rollout_ref.actor.optim.lr=nan", "nan"),
        ("actor_rollout_ref.actor.optim.lr=-inf", "-inf"),
        ("actor_rollout_ref.actor.optim.lr=1e999", "inf"),  # overflows to inf when parsed
        ("actor_rollout_ref.actor.optim.betas=[0.9,nan]", "[0.9,nan]"),
        ("actor_rollout_ref.actor.clip_ratio_high=.inf", "inf"),  # an optional number
        ("algorithm.kl_ctrl.kl_coef=nan", "nan"),
        ("reward.timeout_s=inf", "inf"),
        ("actor_rollout_ref.rollout.temperature=nan", "nan"),
    ],
)
def test_non_finite_numbers_are_one_error_with_the_dotted_key(model, data, override, shown):
    key = override.partition("=")[0]
    [line] = problems(data + [f"{ACTOR}={model}", override])  # nan fails every other rule too: one line
    assert line.startswith(f"{key}={shown}: must be finite"), line
    assert "; fix: set it to a finite number (the default is " in line


def test_non_finite_critic_numbers_are_caught_too(model, data):
    found = problems(data + [f"{ACTOR}={model}", f"critic.model.path={model}", "critic.optim.lr=inf"], name="ppo")
    assert [line.split(": ")[0] for line in found] == ["critic.optim.lr=inf"]


def test_the_process_group_timeout_is_verls_key(model, data):
    cfg, _ = C.load_and_validate(recipe("grpo"), data + [f"{ACTOR}={model}"], 1)
    assert cfg.actor_rollout_ref.nccl_timeout == 600  # verl's default
    for bad in ("0", "-5"):
        [line] = problems(data + [f"{ACTOR}={model}", f"actor_rollout_ref.nccl_timeout={bad}"])
        assert (
            line.startswith(f"actor_rollout_ref.nccl_timeout={bad}: must be > 0 seconds")
            and "fix: set it to 600" in line
        )
    # a resumed run may wait longer or shorter
    assert any(re.fullmatch(p, "actor_rollout_ref.nccl_timeout") for p in C.RESUME_HARMLESS_KEYS)
