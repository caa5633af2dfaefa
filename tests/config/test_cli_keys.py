"""scripts/train.py --show-keys (the config reference from the schema), --validate-only --world-size N, and a
config file that does not parse stopping validation there."""

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dsrl import config as C
from dsrl.runtime.launch import LAUNCHER_VARIABLES
from tests.conftest import recipe, run_train_without_torch, write_model_stub, write_parquet_stub

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")


def train(*args, env=None, cwd=REPO):
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return subprocess.run(
        [sys.executable, TRAIN, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        env={**environ, **(env or {})},
    )


@pytest.fixture
def files(tmp_path):
    write_parquet_stub(tmp_path / "train.parquet")
    write_model_stub(tmp_path / "model")
    return [
        f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=null",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
    ]


# ---------------------------------------------------------------- --show-keys


def test_show_keys_prints_type_default_and_help_of_each_key_under_the_prefix():
    start = time.monotonic()
    result = train("--show-keys", "actor_rollout_ref.actor.optim")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    expected_keys = [key for key in C.SCHEMA if key.startswith("actor_rollout_ref.actor.optim")]
    assert len(lines) == len(expected_keys) == 11
    assert lines[0] == "# actor_rollout_ref.actor.optim: actor optimizer"
    assert lines[1] == (
        "actor_rollout_ref.actor.optim.lr: float = 1e-06  # AdamW learning rate; ~1e-6 for a 0.5B-7B actor, ~1e-5 for "
        "a critic"
    )
    assert "actor_rollout_ref.actor.optim.betas: list[float] = [0.9,0.999]  # AdamW (beta1, beta2)" in lines
    assert (
        "actor_rollout_ref.actor.optim.warmup_style: str | null = null  # verl's deprecated name of lr_scheduler_type; "
        "used when set (setting both to different values is refused)" in lines
    )
    assert elapsed < 10, elapsed  # about 0.7 s measured on 2 CPU cores: the schema only, no torch


def test_show_keys_without_a_prefix_lists_every_key_once():
    result = train("--show-keys")
    assert result.returncode == 0, result.stderr
    keys = [line.removeprefix("# ").split(":")[0] for line in result.stdout.splitlines()]
    assert keys == list(C.SCHEMA)
    lines = result.stdout.splitlines()
    assert "data.train_files: any = ??? (required)  # " + C.SCHEMA["data.train_files"].help in lines
    assert any(
        line.startswith("data.apply_chat_template_kwargs: dict (free-form: any keys) = {}  # ") for line in lines
    )
    # a default that follows another key shows the reference
    assert any(
        line.startswith("critic.ppo_mini_batch_size: int = ${actor_rollout_ref.actor.ppo_mini_batch_size}  # ")
        for line in lines
    )
    assert any(line.startswith("algorithm.import_modules: list[str] = []  # ") for line in lines)


def test_show_keys_imports_no_torch():
    result = run_train_without_torch(["--show-keys"])
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == len(C.SCHEMA)


def test_show_keys_with_a_prefix_no_key_has_exits_2_listing_the_sections():
    result = train("--show-keys", "actor.optim")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "dsrl: --show-keys actor.optim: no config key starts with it; fix: start it with one of data, "
        "actor_rollout_ref, critic, algorithm, custom_reward_function, reward_model, distillation, reward, trainer"
    )


def test_no_config_and_no_show_keys_is_a_usage_error():
    result = train()
    assert result.returncode == 2
    assert "give config files (or shipped recipe names) and/or key=value overrides, or --show-keys" in result.stderr


def test_an_unknown_key_with_no_close_match_points_at_show_keys_and_that_command_lists_its_section(files):
    with pytest.raises(C.ConfigError) as err:
        C.load_and_validate(recipe("grpo"), files + ["trainer.qqqqqqqqqqqq=1"], 1)
    [v] = err.value.violations
    assert v == (
        "trainer.qqqqqqqqqqqq=1: unknown key; fix: remove it (no dsrl key is close; "
        "python scripts/train.py --show-keys trainer lists the keys)"
    )
    command = v.split("close; ")[1].removesuffix(" lists the keys)")
    argv = shlex.split(command)
    assert argv[:2] == ["python", "scripts/train.py"]
    result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == "# trainer: loop length, evaluation, checkpoints, logging"
    assert all(line.removeprefix("# ").startswith("trainer") for line in result.stdout.splitlines())


# ---------------------------------------------------------------- --world-size


def test_validate_only_says_which_world_size_it_checked(files):
    """grpo under the CPU overlay: train_batch_size 8 splits over 1, 2, 4 or 8 ranks, not 3."""
    args = [*recipe("grpo"), *files, "--validate-only"]
    default = train(*args)
    assert default.returncode == 0, default.stderr
    assert (
        default.stdout.splitlines()[0]
        == "# validated for world size 1 (no launcher: one process; --world-size N checks N)"
    )
    assert yaml.safe_load(default.stdout)["data"]["train_batch_size"] == 8
    launched = train(*args, env={"RANK": "0", "WORLD_SIZE": "2"})
    assert launched.stdout.splitlines()[0] == "# validated for world size 2 (RANK and WORLD_SIZE in the environment)"
    srun = train(*args, env={"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7"})
    assert srun.stdout.splitlines()[0] == "# validated for world size 2 (the slurm launcher)"
    stale = train(*args, env={"WORLD_SIZE": "2"})
    assert stale.returncode == 2 and "dsrl: WORLD_SIZE=2 but no RANK" in stale.stderr
    flagged = train(*args, "--world-size", "2", env={"WORLD_SIZE": "3"})  # the flag wins (3 ranks would be refused)
    assert flagged.returncode == 0, flagged.stderr
    assert flagged.stdout.splitlines()[0] == "# validated for world size 2 (--world-size)"
    refused = train(*args, "--world-size", "3")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "  data.train_batch_size=8: must be divisible by the world size 3" in refused.stderr


def test_world_size_flag_needs_validate_only_and_a_positive_count(files):
    alone = train(*recipe("grpo"), *files, "--world-size", "2")
    assert alone.returncode == 2 and "--world-size goes with --validate-only" in alone.stderr
    zero = train(*recipe("grpo"), *files, "--validate-only", "--world-size", "0")
    assert zero.returncode == 2 and "--world-size 0: must be a positive number of ranks" in zero.stderr


# ---------------------------------------------------------------- a config file that does not parse


def test_a_file_that_does_not_parse_is_the_only_problem_reported(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_batch_size: 8\n  max_prompt_length: [1, 2\nfoo: bar\n")
    with pytest.raises(C.ConfigError) as err:
        C.load_and_validate([str(bad)], [], 1)  # no model path, no data: the defaults are not the user's
    assert err.value.violations == [
        f"config file {bad}: not valid YAML at line 4, column 4: did not find expected ',' or ']' "
        "(while parsing a flow sequence at line 3, column 22); fix: correct the YAML syntax there"
    ]


def test_an_unreadable_file_stops_there_with_the_overrides_syntax_errors_only(tmp_path):
    with pytest.raises(C.ConfigError) as err:
        C.load_and_validate([str(tmp_path / "absent.yaml"), "grpo"], ["data.train_batch_size=abc", "oops"], 1)
    found = err.value.violations
    assert len(found) == 2
    assert found[0].startswith(f"config file {tmp_path / 'absent.yaml'}: cannot be read (No such file or directory)")
    assert found[1].startswith("override oops: not key=value")  # a value of the wrong type is not reported yet


def test_the_cli_prints_only_the_yaml_error(tmp_path):
    bad = tmp_path / "tabs.yaml"
    bad.write_text("data:\n\ttrain_batch_size: 8\n")
    result = train(str(bad), "--validate-only")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"dsrl: {bad}: 1 problem(s) in the configuration:",
        f"  config file {bad}: not valid YAML at line 2, column 1: found character that cannot start any token "
        "(while scanning for the next token at line 2, column 1); fix: correct the YAML syntax there",
    ]
