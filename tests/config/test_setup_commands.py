"""The setup commands validation prints in its fixes run as printed and write what the config names: after running
them in a fresh directory, the same config validates."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import config_problems, recipe

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"(python scripts/\S+\.py.*)$")  # a fix that ends with a command


def printed_commands(found):
    """The distinct commands at the end of the fixes, in order."""
    commands = [match.group(1) for v in found if (match := COMMAND.search(v))]
    return list(dict.fromkeys(commands))


def run_as_printed(command, cwd):
    """The command as a user pastes it in a checkout (scripts/ at hand); the tiny model untrained, to be quick."""
    argv = shlex.split(command)
    assert argv[0] == "python"
    extra = ["--sft-steps", "0"] if argv[1] == "scripts/make_tiny_model.py" else []
    subprocess.run([sys.executable, *argv[1:], *extra], cwd=cwd, check=True, capture_output=True, timeout=600)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fresh checkout: scripts/ and nothing built yet (no outputs/)."""
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_cpu_overlays_fixes_build_its_inputs(checkout):
    found = config_problems(recipe("ppo"), [])
    assert printed_commands(found) == [
        "python scripts/prepare_data.py --task arithmetic",
        "python scripts/make_tiny_model.py",
    ]
    for command in printed_commands(found):
        run_as_printed(command, checkout)
    assert (checkout / "outputs" / "tiny_model" / "config.json").is_file()
    assert config_problems(recipe("ppo"), []) == []


def test_fixes_for_other_paths_write_those_paths(checkout):
    overrides = [
        "data.train_files=data/mine/train.parquet",
        "data.val_files=data/mine/test.parquet",
        "actor_rollout_ref.model.path=./models/tiny",  # a local directory starts with ./ (owner/name is a hub id)
    ]
    found = config_problems(recipe("grpo"), overrides)
    assert printed_commands(found) == [
        "python scripts/prepare_data.py --task arithmetic --out data/mine",
        "python scripts/make_tiny_model.py --out ./models/tiny",
    ]
    for command in printed_commands(found):
        run_as_printed(command, checkout)
    assert config_problems(recipe("grpo"), overrides) == []
