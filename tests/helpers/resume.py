"""Runs of ``tests/helpers/train_worker.py`` that are killed and resumed, and the comparisons of their results.

A run is a subprocess (one rank, or two under the deepspeed launcher) so that SIGKILL is real.
Exactness is judged on everything a run leaves: every logged metric except wall-clock ones, and
every tensor and value in the DeepSpeed checkpoint files and trainer state of the final step.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from dsrl.config.layout import ADAPTER_DIR
from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import QUICKSTART, RANK_LOCAL, recipe

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "train_worker.py"
STEPS = 5


# Every configuration dsrl ships, as the tests run it: each recipe under the CPU overlay, and the quickstart.
SHIPPED = ("grpo", "ppo", "rloo", "reinforce_pp", "opo", "otb", "dapo", "quickstart")


def shipped_files(name: str) -> list[str]:
    """The config files of a shipped configuration: ``quickstart``, or a recipe under the CPU overlay."""
    return QUICKSTART if name == "quickstart" else recipe(name)


def resume_overrides(name, *, model, data, ds_config, ckpt) -> list[str]:
    """A shipped configuration as it is, but for what a test machine needs: the tiny model, the test data
    and the digits reward (an untrained model then gets rewards that differ within a group, so every step
    moves the weights), the test DeepSpeed config (ZeRO-3 partitions even the tiny model's small tensors),
    ``STEPS`` steps with a checkpoint after each (epochs enough for them: the quickstart's 32 prompts a step
    cross epochs of the 64 test prompts), the console logger. PPO's critic gets the same."""
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"custom_reward_function.path={data / 'digits_reward.py'}",
        f"actor_rollout_ref.actor.deepspeed_config={ds_config}",
        f"trainer.total_training_steps={STEPS}",
        f"trainer.total_epochs={STEPS}",
        "trainer.save_freq=1",
        f"trainer.default_local_dir={ckpt}",
        "trainer.logger=[console]",
    ]
    if name == "ppo":
        overrides += [f"critic.model.path={model}", f"critic.deepspeed_config={ds_config}"]
    return overrides


LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
]


# Two "nodes" on this machine: two names for it, each a host of the hostfile and of SLURM's node list.
NODES = ("localhost", "127.0.0.1")


def two_nodes(launcher: str, command: list[str], port: int, out: Path) -> list[tuple[list[str], dict[str, str]]]:
    """The command and variables of each of two simulated nodes with one rank each, as ``launcher`` starts them:
    ``no_ssh`` (``deepspeed --no_ssh --node_rank N`` on each node), ``slurm`` (the tasks of ``srun -N2 -n2``, with
    the variables srun sets) or ``mpi`` (Open MPI's ``mpirun -n 2`` over two hosts, ``-x MASTER_ADDR``)."""
    if launcher == "no_ssh":
        hostfile = out / "hostfile"
        hostfile.write_text("".join(f"{host} slots=1\n" for host in NODES))
        return [
            (
                [
                    sys.executable,
                    "-m",
                    "deepspeed.launcher.runner",
                    "--hostfile",
                    str(hostfile),
                    "--no_ssh",
                    "--node_rank",
                    str(node),
                    "--num_nodes",
                    "2",
                    "--master_addr",
                    NODES[0],
                    "--master_port",
                    str(port),
                    *command[1:],
                ],
                {},
            )
            for node in (0, 1)
        ]
    if launcher == "slurm":
        step = {
            "SLURM_JOB_ID": str(port),
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_NNODES": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_STEP_NODELIST": ",".join(NODES),
            "SLURM_JOB_NODELIST": ",".join(NODES),
            "MASTER_PORT": str(port),
        }  # a free port: the one derived from the job id may be taken here
        return [
            (command, {**step, "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_NODEID": str(node)})
            for node in (0, 1)
        ]
    assert launcher == "mpi", launcher
    world = {
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "MASTER_ADDR": NODES[0],
        "MASTER_PORT": str(port),
    }
    return [
        (command, {**world, "OMPI_COMM_WORLD_RANK": str(node), "OMPI_COMM_WORLD_LOCAL_RANK": "0"}) for node in (0, 1)
    ]


def start_worker(
    config,
    overrides,
    out: Path,
    *,
    world=1,
    port,
    kill_at=None,
    dump_loaded=False,
    slow_convert=0,
    launcher="deepspeed",
) -> subprocess.Popen:
    """Start the worker on ``world`` ranks; ``out`` collects its files. Pass a free port per concurrent run.
    ``dump_loaded``, ``slow_convert``: the worker's ``--dump-loaded`` (the engines' state right after a resume),
    ``--slow-convert`` (a universal conversion that takes that many seconds longer, writing). ``launcher``:
    ``deepspeed`` (one node), or two simulated nodes of one rank each (``two_nodes``), both started here and
    waited for by one shell, which exits with the larger exit code."""
    out.mkdir(parents=True, exist_ok=True)
    flags = (
        ["--out", str(out)]
        + (["--kill-at", kill_at] if kill_at else [])
        + (["--dump-loaded"] if dump_loaded else [])
        + (["--slow-convert", str(slow_convert)] if slow_convert else [])
    )
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DEEPSPEED_TIMEOUT": "3"})
    arguments = [*flags, *shipped_files(config), *overrides]
    if launcher != "deepspeed":
        assert world == 2, "two simulated nodes of one rank each"
        nodes = two_nodes(launcher, [sys.executable, str(WORKER)], port, out)
        script = "".join(
            f"{shlex.join(['env', *(f'{k}={v}' for k, v in extra.items()), *command, *arguments])} & p{i}=$!\n"
            for i, (command, extra) in enumerate(nodes)
        )
        script += "wait $p0; a=$?; wait $p1; b=$?; exit $(( a > b ? a : b ))\n"
        return subprocess.Popen(
            ["bash", "-c", script], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    if world == 1:
        command = [sys.executable, str(WORKER)]
        env.update(
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        )
    else:
        command = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(world),
            "--master_port",
            str(port),
            str(WORKER),
        ]
    return subprocess.Popen(
        [*command, *arguments],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen, timeout=600) -> tuple[int, str]:
    """(exit code, output) of a started worker."""
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def run_worker(config, overrides, out: Path, **kwargs) -> tuple[int, str]:
    return finish(start_worker(config, overrides, out, **kwargs))


def logged_steps(out: Path, rank: int = 0) -> list[dict]:
    """Every ``{"step", "metrics"}`` the runs writing to ``out`` logged on ``rank``, in order."""
    path = out / f"metrics_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(RANK_LOCAL)}


def _validation_only(entry: dict) -> bool:
    return all(name.startswith("val-") for name in entry["metrics"])


def metric_mismatches(reference: list[dict], entries: list[dict]) -> list[str]:
    """Entries whose non-timing metrics differ from the reference run's at the same step (NaN == NaN)."""
    by_step = {entry["step"]: comparable(entry["metrics"]) for entry in reference}
    problems = []
    for entry in entries:
        expected, got = by_step[entry["step"]], comparable(entry["metrics"])
        same = expected.keys() == got.keys() and all(
            expected[k] == got[k] or (math.isnan(expected[k]) and math.isnan(got[k])) for k in expected
        )
        if not same:
            diff = {
                k: (expected.get(k), got.get(k)) for k in expected.keys() | got.keys() if expected.get(k) != got.get(k)
            }
            problems.append(f"step {entry['step']}: {diff}")
    return problems


def _differences(a, b, where: str) -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        same = same and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    if type(a).__module__.startswith("deepspeed") and type(a) is type(b):  # e.g. the loss scaler
        return _differences(vars(a), vars(b), where)
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _zero3_valid_masks(optim_file: Path) -> list[torch.Tensor]:
    """Per parameter group, the elements of rank R's flat fp32 partition that hold parameters.

    ZeRO-3 gives each parameter of ``n`` elements a partition of ``ceil(n / W)`` per rank, in the
    group's order; the last ranks' partitions end in padding that is never read (nor initialised).
    """
    rank = int(re.search(r"zero_pp_rank_(\d+)_", optim_file.name).group(1))
    model_states = torch.load(
        optim_file.with_name(optim_file.name.replace("optim_states", "model_states")), weights_only=False
    )
    world = model_states["dp_world_size"]
    masks = []
    for shapes in model_states["param_shapes"]:
        valid = []
        for shape in shapes.values():
            n = math.prod(shape)
            part = -(-n // world)
            kept = min(max(n - rank * part, 0), part)
            valid += [True] * kept + [False] * (part - kept)
        masks.append(torch.tensor(valid))
    return masks


def checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Every difference between two checkpoint directories: each DeepSpeed file's tensors and values
    (optimizer state, fp32 partitions, LR scheduler, step counters), the RNG files and the trainer state."""
    files = sorted(p.relative_to(a) for p in a.rglob("*.pt"))
    assert files == sorted(p.relative_to(b) for p in b.rglob("*.pt")), (a, b)
    problems = []
    for name in files:
        x = torch.load(a / name, weights_only=False, map_location="cpu")
        y = torch.load(b / name, weights_only=False, map_location="cpu")
        # ZeRO-3 pads each parameter's partition; padding is garbage
        if "fp32_flat_groups" in x.get("optimizer_state_dict", {}):
            valid = _zero3_valid_masks(a / name)
            for state in (x, y):
                flat = state["optimizer_state_dict"]["fp32_flat_groups"]
                flat[:] = [group.detach()[mask] for group, mask in zip(flat, valid, strict=True)]
        problems += _differences(x, y, str(name))
    state_a, state_b = (_comparable_state(json.loads((p / "trainer_state.json").read_text())) for p in (a, b))
    problems += _differences(state_a, state_b, "trainer_state.json")
    return problems


def _comparable_state(state: dict) -> dict:
    """A trainer state less the files' sizes and SHA-256 and its own checksum. The digests cover ZeRO-3's padding
    bytes too, which are garbage; the sizes depend on how pickle shares equal objects: a fresh engine's optimizer
    param group holds the very ``betas`` list of its DeepSpeed config, a resumed one an equal copy, 21 bytes more
    of pickle (and 64 more of file where that crosses the zip's 64-byte alignment). The files' tensors and values
    are compared above, the padding masked out."""
    files = {
        name: {k: v for k, v in entry.items() if k not in ("sha256", "bytes")} for name, entry in state["files"].items()
    }
    return {**{k: v for k, v in state.items() if k != "state_sha256"}, "files": files}


class Baselines:
    """Uninterrupted runs, one per config, started on demand and shared by the tests that compare with them."""

    def __init__(self, root: Path, overrides_for, free_port, world: int):
        self.root, self.overrides_for, self.free_port, self.world = root, overrides_for, free_port, world
        self.running: dict[str, subprocess.Popen] = {}
        self.done: dict[str, Path] = {}

    def start(self, name: str) -> None:
        if name not in self.running and name not in self.done:
            out = self.root / name
            self.running[name] = start_worker(
                name, self.overrides_for(name, out / "ckpt"), out, world=self.world, port=self.free_port()
            )

    def checkpoint(self, name: str, step: int, timeout=600) -> Path:
        """The run's ``global_step_<step>``, once published (it appears whole, by a rename)."""
        self.start(name)
        directory = self.root / name / "ckpt" / f"global_step_{step}"
        deadline = time.monotonic() + timeout
        while name in self.running and not directory.is_dir():
            process = self.running[name]
            assert process.poll() is None, (
                f"{name} ended before writing {directory}:\n{process.communicate()[0][-4000:]}"
            )
            assert time.monotonic() < deadline, f"no {directory} within {timeout} s"
            time.sleep(0.2)
        assert directory.is_dir(), directory
        return directory

    def result(self, name: str) -> Path:
        """The finished run's folder (``metrics_rank<R>.jsonl``, ``ckpt/global_step_<N>`` for every step)."""
        self.start(name)
        if name not in self.done:
            code, output = finish(self.running.pop(name))
            assert code == 0, output[-4000:]
            self.done[name] = self.root / name
        return self.done[name]


def resume_chain(
    name, start: Path, kills, *, out: Path, overrides, world, free_port, launcher="deepspeed"
) -> list[str]:
    """From the checkpoint ``start`` (copied into ``out``): a run killed with SIGKILL at each of ``kills``
    ((kill point, the step the next run resumes from)), then one to the end. Returns every run's output;
    asserts the kills and where each run resumed."""
    shutil.copytree(start, out / "ckpt" / start.name)
    resume_points = [int(start.name.rpartition("_")[2])] + [resumes_from for _, resumes_from in kills]
    outputs = []
    for kill_at, resumes_from in zip([kill_at for kill_at, _ in kills] + [None], resume_points, strict=True):
        code, output = run_worker(
            name, overrides, out, world=world, port=free_port(), kill_at=kill_at, launcher=launcher
        )
        outputs.append(output)
        if kill_at is None:
            assert code == 0, output[-4000:]
        else:
            assert code != 0 and f"SIGKILL at {kill_at}" in output, output[-4000:]
        resumed = out / "ckpt" / f"global_step_{resumes_from}"
        assert f"resumed from {resumed} (step {resumes_from};" in output, (kill_at, output[-3000:])
    return outputs


def assert_same_run(baseline: Path, chain: Path, *, first_step: int, ranks=(0,)) -> int:
    """A run resumed at ``first_step - 1`` (``chain``) is the uninterrupted one (``baseline``): every
    metric any of its runs logged equals the baseline's at that step, every step from ``first_step``
    on was logged, every checkpoint it wrote is bit-identical to the baseline's of the same step, and
    so is the exported model. Returns the number of compared checkpoints."""
    for rank in ranks:
        reference, entries = logged_steps(baseline, rank), logged_steps(chain, rank)
        # A resumed run validates before training, as verl does, at the step it resumed from: no such entry
        # in the uninterrupted run, whose validations at the start and at the last step are compared.
        resumed = {e["step"] for e in reference if not _validation_only(e)}
        entries = [e for e in entries if not (_validation_only(e) and e["step"] in resumed)]
        assert {e["step"] for e in entries} == set(range(first_step, STEPS + 1)) | ({0} & {e["step"] for e in entries})
        assert metric_mismatches(reference, entries) == []
    written = sorted((chain / "ckpt").glob("global_step_*"), key=lambda p: int(p.name.rpartition("_")[2]))
    assert [p.name for p in written][-1] == f"global_step_{STEPS}"
    for directory in written:
        assert checkpoint_differences(baseline / "ckpt" / directory.name, directory) == [], directory.name
    assert not list((chain / "ckpt").glob(".tmp_*")), "a partial checkpoint was left behind"
    model_dir = chain / "ckpt" / "huggingface"  # the last checkpoint has no hf_model: exported beside it
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (baseline / "ckpt" / "huggingface").glob("*.safetensors"))
    for shard in shards:
        assert (
            _differences(load_file(baseline / "ckpt" / "huggingface" / shard), load_file(model_dir / shard), shard)
            == []
        )
    adapter = Path(ADAPTER_DIR) / "adapter_model.safetensors"  # a LoRA run's adapter, exported with the merged model
    assert (model_dir / adapter).is_file() == (baseline / "ckpt" / "huggingface" / adapter).is_file()
    if (model_dir / adapter).is_file():
        assert (
            _differences(
                load_file(baseline / "ckpt" / "huggingface" / adapter), load_file(model_dir / adapter), str(adapter)
            )
            == []
        )
    return len(written)
