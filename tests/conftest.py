"""Shared fixtures: CPU DeepSpeed environment, a tiny model, a world of one, test DeepSpeed configs.

CPU facts (shared/notes/platform.md): DeepSpeed runs on the CPU accelerator over gloo; one
OpenMP thread per process; test DeepSpeed configs set ``stage3_param_persistence_threshold: 0``
so that ZeRO-3 partitions even the tiny model's small tensors.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parents[1]
# tests/verl compares dsrl with verl itself, which only .ci/verl_tier.sh's environment has; the tier sets
# DSRL_VERL_TIER=1, and there a missing verl fails collection instead of skipping.
collect_ignore = [] if os.environ.get("DSRL_VERL_TIER") == "1" else ["verl"]


def recipe(name: str) -> list[str]:
    """configs/<name>.yaml under the CPU overlay configs/cpu.yaml: a shipped recipe as the tests run it."""
    return [str(REPO / "configs" / f"{name}.yaml"), str(REPO / "configs" / "cpu.yaml")]


QUICKSTART = [*recipe("grpo"), str(REPO / "configs" / "quickstart.yaml")]  # what scripts/quickstart.sh runs
# Metrics measured by each rank's own clock or process: they differ between ranks and between runs.
RANK_LOCAL = ("timing_s/", "timing_per_token_ms/", "perf/")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model_stub(path: Path) -> Path:
    """A directory that passes validation's model checks without being a model (validation reads names and
    headers only): config.json with a model_type, a one-tensor model.safetensors, a tokenizer.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 100}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    (path / "tokenizer.json").write_text("{}")
    return path


def write_parquet_stub(path: Path) -> Path:
    """A parquet file that passes validation (which reads its magic bytes only); not a prompt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"stub": [0]}), path)
    return path


def stub_file_overrides(folder: Path) -> list[str]:
    """Overrides pointing every file key at stubs in ``folder`` that pass validation (the shipped YAMLs name
    outputs/ files): training and validation data, then the actor's model directory."""
    write_parquet_stub(folder / "train.parquet")
    write_parquet_stub(folder / "test.parquet")
    write_model_stub(folder / "model")
    return [
        f"data.train_files={folder / 'train.parquet'}",
        f"data.val_files={folder / 'test.parquet'}",
        f"actor_rollout_ref.model.path={folder / 'model'}",
    ]


def config_problems(files: list[str], overrides: list[str], world_size: int = 1) -> list[str]:
    """The violations ``load_and_validate`` reports for ``files`` + ``overrides``; [] when the config is valid."""
    from dsrl.config import ConfigError, load_and_validate

    try:
        load_and_validate(files, overrides, world_size)
    except ConfigError as err:
        return err.violations
    return []


def run_train_without_torch(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``scripts/train.py args`` in a fresh Python (cwd the checkout, ``env`` added) that fails with an
    AssertionError if torch, deepspeed or transformers got imported: what validation and --show-keys promise."""
    code = (
        "import runpy, sys; main = runpy.run_path(sys.argv[1])['main']; rc = main(sys.argv[2:]);"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules];"
        "assert not heavy, heavy; sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(REPO / "scripts" / "train.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="session", autouse=True)
def mlflow_store(tmp_path_factory) -> str:
    """Runs log to MLflow by default: every test (and the runs it starts) writes to one sqlite store of
    the session, not to ./mlflow.db of the checkout. A test that needs its own store sets the variable."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return uri


@pytest.fixture(scope="session")
def free_port():
    """``free_port()``: a TCP port on localhost nobody listens on (distinct rendezvous per run)."""
    return _free_port


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen3 (hidden 128, head_dim 64) and its tokenizer, built once per session."""
    out = tmp_path_factory.mktemp("tiny_model")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out), "--sft-steps", "0"],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A reward model on the tiny model's backbone: ``Qwen3ForSequenceClassification`` with one label, its ``score``
    head drawn from seed 0, and the tiny model's tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_reward_model")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory) -> Path:
    """A distillation teacher for the tiny model: another untrained tiny Qwen3 (seed 1), the same tokenizer."""
    out = tmp_path_factory.mktemp("tiny_teacher")
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_tiny_model.py"),
            "--out",
            str(out),
            "--sft-steps",
            "0",
            "--seed",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen3-MoE (8 experts of width 96, top 2; ``make_tiny_model.py --moe``) and its tokenizer."""
    out = tmp_path_factory.mktemp("tiny_moe_model")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--moe", "--out", str(out), "--sft-steps", "0"],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def deepspeed_cpu_ops() -> None:
    """Build DeepSpeed's CPU ops (shared-memory collectives, CPU Adam) once, in one process.

    Ranks that find them missing compile them concurrently, which on two cores takes minutes;
    the torch extensions cache (``~/.cache/torch_extensions``) keeps them for later runs. A build killed
    earlier (a timed-out test) leaves torch's extension lock there, and this build, its output captured, would
    wait on it forever: such a lock fails the tests that need the ops, naming the file to remove.
    """
    from dsrl.runtime.stalls import lock_report, stale_extension_locks

    if stale := stale_extension_locks():
        pytest.fail("DeepSpeed's CPU ops cannot be built: " + "; ".join(lock_report(lock) for lock in stale))
    code = (
        "from deepspeed.accelerator import get_accelerator as a\n"
        "a().create_op_builder('ShareMemCommBuilder').load()\n"
        "a().create_op_builder('CPUAdamBuilder').load()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.fixture(scope="session")
def world_of_one() -> None:
    """torch.distributed with one rank on a free port (what ``python scripts/train.py`` gets)."""
    import torch

    from dsrl.engines import init_distributed

    torch.set_num_threads(1)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ[name] = value
    os.environ["MASTER_PORT"] = str(_free_port())
    init_distributed()


@pytest.fixture(scope="session")
def ds_test_config(tmp_path_factory):
    """``ds_test_config(name, optimizer={...}, **zero)``: path of a copy of ``ds_configs/<name>.json``
    with ``stage3_param_persistence_threshold: 0``, optimizer params and ``zero_optimization`` overrides."""
    tmp_dir = tmp_path_factory.mktemp("ds_configs")
    count = iter(range(10**6))

    def make(name: str, *, optimizer: dict | None = None, **zero) -> str:
        ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds["zero_optimization"].update(zero)
        if optimizer:
            ds["optimizer"]["params"].update(optimizer)
        path = tmp_dir / f"{name}-{next(count)}.json"
        path.write_text(json.dumps(ds))
        return str(path)

    return make


@pytest.fixture(scope="session")
def make_cfg(tiny_model_dir):
    """``make_cfg(*overrides)``: a run config for the tiny model in float32 (exact comparisons)."""
    from dsrl.config import load_config

    base = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"critic.model.path={tiny_model_dir}",
        "actor_rollout_ref.model.dtype=float32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false",
        "data.train_files=unused.parquet",
    ]
    return lambda *overrides: load_config(None, [*base, *overrides])


DIGITS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / 4.0, "digits": digits}
"""


def prepared(task: str, out: Path) -> Path:
    """``scripts/prepare_data.py --task <task>`` into ``out``, 64 train and 8 test prompts."""
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "prepare_data.py"),
            "--task",
            task,
            "--out",
            str(out),
            "--train-size",
            "64",
            "--test-size",
            "8",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> Path:
    """A small arithmetic task (64 train / 8 test prompts) and ``digits_reward.py``: a custom reward
    paying for digits, so that even an untrained model's samples differ in reward within a group; it
    also returns the digit count as an extra (``reward/digits/mean``)."""
    out = prepared("arithmetic", tmp_path_factory.mktemp("arithmetic"))
    (out / "digits_reward.py").write_text(DIGITS_REWARD)
    return out


TOOL_MODEL_ARGS = ["--task", "calculator"]


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> Path:
    """The tiny model warm-started to call the calculator on some products (``make_tiny_model.py`` with
    ``TOOL_MODEL_ARGS``: minutes of CPU). The build is deterministic, so it is kept in ``$DSRL_TEST_CACHE`` (default
    ~/.cache/dsrl/test_models) under a digest of the code that makes it and of its arguments: the main tests and the
    vLLM tier's environment share one build, and a changed script builds a new one.

    It stops at the docs' 60% of the probe's forced calls. At 40% (about 40 s less) the vLLM tier's tool run had
    a training step without a single call (tests/vllm/test_vllm_training.py needs one in each of its 3 steps)."""
    sources = [
        REPO / "scripts" / "make_tiny_model.py",
        REPO / "dsrl" / "data" / "calculator.py",
        REPO / "dsrl" / "data" / "arithmetic.py",
    ]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources) + " ".join(TOOL_MODEL_ARGS).encode())
    digest = digest.hexdigest()[:16]
    cache = Path(os.environ.get("DSRL_TEST_CACHE", Path.home() / ".cache" / "dsrl" / "test_models"))
    out = cache / f"tiny_tool_model-{digest}"
    cache.mkdir(parents=True, exist_ok=True)
    # One build for the test processes of a run (pytest-xdist's workers): the others wait on the lock, then find it.
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "config.json").exists():
            building = tmp_path_factory.mktemp("tiny_tool_model")
            script = REPO / "scripts" / "make_tiny_model.py"
            subprocess.run(
                [sys.executable, str(script), *TOOL_MODEL_ARGS, "--out", str(building)],
                check=True,
                capture_output=True,
            )
            shutil.rmtree(out, ignore_errors=True)  # a build interrupted while it was copied
            shutil.rmtree(out.with_suffix(".partial"), ignore_errors=True)
            shutil.copytree(building, out.with_suffix(".partial"))
            out.with_suffix(".partial").rename(out)
    return out


@pytest.fixture(scope="session")
def calculator_data(tmp_path_factory) -> Path:
    """The calculator task (products of 3-digit numbers): 64 train / 8 test prompts."""
    return prepared("calculator", tmp_path_factory.mktemp("calculator"))


@pytest.fixture
def gsm8k_checkout(tmp_path, monkeypatch):
    """A checkout where ``python scripts/prepare_data.py --task gsm8k`` has run (its default paths), as cwd."""
    data = tmp_path / "outputs" / "data" / "gsm8k"
    data.mkdir(parents=True)
    for split in ("train", "test"):
        write_parquet_stub(data / f"{split}.parquet")
    monkeypatch.chdir(tmp_path)
    return tmp_path
