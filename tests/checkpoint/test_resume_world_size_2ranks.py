"""Resuming at another world size (``trainer.resume_allow_world_size_change``) under the real ``deepspeed``
launcher: a run on two ranks stopped after step 1, resumed on one rank and stopped after step 2, resumed on two
ranks to the end (step 3). Right after each load, every trained parameter's fp32 master weight equals DeepSpeed's
``zero_to_fp32`` consolidation of the checkpoint, and its Adam moments and the optimizer's step equal the
checkpoint's universal form, exactly; each run continues from the saved step and sampler position with finite
metrics, writes checkpoints of its own world size, and leaves no conversion behind. The first resume uses a
conversion made before the launch (``dsrl-convert --universal``); the second converts in the run, 30 s slower than
``actor_rollout_ref.nccl_timeout`` (20 s) allows a collective, while rank 1 waits (review gpu_path_3 G4).

The default run is the quickstart on ZeRO-3 with CPU offload of parameters and optimizer (the default actor
config), about 2 minutes on two cores; PPO (a critic too) on ZeRO-2 is ``slow``. With sequence parallelism the
two-rank runs split each row over both ranks (``ulysses_sequence_parallel_size=2``, the critic's too in PPO) and the
one-rank run does not: the checkpoints cross sequence-parallel sizes as well as world sizes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from dsrl.checkpoint.save import DS_TAG, step_dir
from dsrl.checkpoint.universal import convert, universal_dir
from dsrl.commands.convert import main as dsrl_convert
from tests.helpers.resume import LORA, logged_steps, resume_overrides, run_worker

pytestmark = pytest.mark.dist

LAST_STEP = 3
# (ranks, the step after whose checkpoint the run is killed; None: to the end)
CHAIN = ((2, 1), (1, 2), (2, None))
NCCL_TIMEOUT = 20


def loaded_differences(loaded: dict, checkpoint: Path, roles: list[str], scratch: Path) -> list[str]:
    """Where the engines' state right after a resume (the worker's ``--dump-loaded``) is not the checkpoint's:
    fp32 weights against ``zero_to_fp32``, Adam moments and step against the universal form."""
    convert(checkpoint, roles, scratch)
    problems = []
    for role in roles:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / role), tag=DS_TAG)
        universal = scratch / role / DS_TAG / "zero"
        names = [
            key.partition("/")[2] for key in loaded if key.startswith(f"{role}/") and key != f"{role}/optimizer_steps"
        ]
        assert names and set(names) <= set(fp32), (role, sorted(set(names) - set(fp32)))
        for name in names:
            state = loaded[f"{role}/{name}"]
            if not torch.equal(state["fp32"], fp32[name].float()):
                problems.append(f"{role}/{name}: fp32")
            for key in ("exp_avg", "exp_avg_sq"):
                saved = torch.load(universal / name / f"{key}.pt", weights_only=False)
                saved = (
                    saved["param"] if isinstance(saved, dict) else saved
                )  # ZeRO-1/2's files: a dict; ZeRO-3's: the tensor
                if not torch.equal(state[key], saved.reshape(state[key].shape)):
                    problems.append(f"{role}/{name}: {key}")
        per_parameter = list(universal.glob("*/step.pt"))  # ZeRO-1/2's; ZeRO-3's are in the optimizer state
        saved_steps = sorted(
            {float(torch.load(path, weights_only=False)) for path in per_parameter}
            or {
                float(s["step"])
                for s in torch.load(universal / "optimizer_state.pt", weights_only=False)["optimizer_state_dict"][
                    "state"
                ].values()
            }
        )
        if loaded[f"{role}/optimizer_steps"] != saved_steps:
            problems.append(f"{role}: optimizer steps {loaded[f'{role}/optimizer_steps']} vs {saved_steps}")
    return problems


def sequence_parallel(name: str, size: int) -> list[str]:
    """The overrides that split each row of the trained roles over ``size`` ranks."""
    roles = [("actor_rollout_ref.actor", "actor_rollout_ref.model")] + ([("critic", "critic.model")] * (name == "ppo"))
    return [
        f"{key}={value}"
        for role, model in roles
        for key, value in ((f"{role}.ulysses_sequence_parallel_size", size), (f"{model}.use_remove_padding", "true"))
    ]


@pytest.mark.parametrize(
    "name, zero, extra, sp",
    [
        pytest.param("quickstart", "zero3_offload", [], 1, id="quickstart-zero3_offload"),
        pytest.param("ppo", "zero2", [], 1, marks=pytest.mark.slow, id="ppo-zero2"),
        pytest.param(
            "quickstart", "zero3_offload", LORA, 1, marks=pytest.mark.slow, id="quickstart-lora-zero3_offload"
        ),
        pytest.param("quickstart", "zero3_offload", [], 2, id="quickstart-sp2-zero3_offload"),
        pytest.param("ppo", "zero3_offload", [], 2, marks=pytest.mark.slow, id="ppo-sp2-zero3_offload"),
    ],
)
def test_a_run_resumes_on_one_rank_then_on_two_with_its_state_exact(
    name, zero, extra, sp, tiny_model_dir, arithmetic_data, ds_test_config, free_port, tmp_path, deepspeed_cpu_ops
):
    ckpt = tmp_path / "ckpt"
    overrides = (
        resume_overrides(name, model=tiny_model_dir, data=arithmetic_data, ds_config=ds_test_config(zero), ckpt=ckpt)
        + extra
    )
    overrides += [
        f"trainer.total_training_steps={LAST_STEP}",
        "trainer.val_before_train=false",
        "trainer.resume_allow_world_size_change=true",
        f"actor_rollout_ref.nccl_timeout={NCCL_TIMEOUT}",
    ]
    roles = ["actor"] + (["critic"] if name == "ppo" else [])
    prompts = pq.read_metadata(arithmetic_data / "train.parquet").num_rows
    resumed_from = None
    for run, (world, kill_after) in enumerate(CHAIN):
        out = tmp_path / f"run{run}"
        if run == 1:  # converted before the launch, where the run looks for it
            assert (
                dsrl_convert([str(step_dir(ckpt, resumed_from)), str(universal_dir(ckpt, resumed_from)), "--universal"])
                == 0
            )
        code, output = run_worker(
            name,
            overrides + (sequence_parallel(name, sp if world == 2 else 1) if sp > 1 else []),
            out,
            world=world,
            port=free_port(),
            dump_loaded=True,
            kill_at=f"publish@{kill_after}" if kill_after else None,
            slow_convert=NCCL_TIMEOUT + 10 if run == 2 else 0,
        )
        assert code == 0 if kill_after is None else f"SIGKILL at publish@{kill_after}" in output, output[-4000:]
        split = "Ulysses sequence parallelism over 2 ranks" in output
        assert split == (sp > 1 and world == 2), output[-4000:]
        last = kill_after or LAST_STEP
        if resumed_from is not None:
            assert f"resumed from {step_dir(ckpt, resumed_from)} (step {resumed_from};" in output, output[-4000:]
            converted = "to universal form in" in output and ": converted in" in output
            reused = f"using its universal conversion in {universal_dir(ckpt, resumed_from)}" in output
            assert (converted, reused) == (run == 2, run == 1), output[-4000:]
            loaded = torch.load(out / f"loaded_step_{resumed_from}.pt", weights_only=False)
            assert loaded_differences(loaded, step_dir(ckpt, resumed_from), roles, tmp_path / f"universal{run}") == []
            assert not universal_dir(ckpt, resumed_from).exists()
        trained = [entry for entry in logged_steps(out) if not all(k.startswith("val-") for k in entry["metrics"])]
        assert [entry["step"] for entry in trained] == list(range((resumed_from or 0) + 1, last + 1))
        assert all(math.isfinite(v) for entry in trained for v in entry["metrics"].values())
        state = json.loads((step_dir(ckpt, last) / "trainer_state.json").read_text())
        batches = prompts // state["config"]["data.train_batch_size"]
        assert (state["world_size"], state["global_step"]) == (world, last)
        assert state["sampler"] == {"epoch": (last - 1) // batches, "index": (last - 1) % batches + 1}
        assert sorted(p.name for p in (step_dir(ckpt, last) / "rng").iterdir()) == [
            f"rank_{r}.pt" for r in range(world)
        ]
        resumed_from = last
