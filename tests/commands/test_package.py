"""dsrl as a package: the wheel built from this checkout, installed in a fresh environment, finds its
recipes and DeepSpeed configs from any directory and runs as ``dsrl-train`` and ``python -m dsrl``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib
import yaml

from tests.conftest import REPO, write_model_stub, write_parquet_stub

pytestmark = pytest.mark.e2e


def test_the_package_list_names_every_package_of_the_source_tree():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "dsrl").rglob("__init__.py")}
    assert listed == on_disk | {"dsrl.ds_configs", "dsrl.configs"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel of this checkout in a new virtual environment (its dependencies from this one)."""
    out = tmp_path_factory.mktemp("wheel")
    shutil.rmtree(REPO / "build", ignore_errors=True)  # an in-tree build would reuse stale files from it
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = out.glob("dsrl-*.whl")
    venv = out / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return wheel, venv


def test_the_wheel_ships_the_recipes_and_the_deepspeed_configs(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in (REPO / "configs").glob("*.yaml"):
        assert f"dsrl/configs/{recipe.name}" in names
    for tools in (REPO / "configs" / "tools").glob("*.yaml"):  # tool_config_path=<name>, from any directory
        assert f"dsrl/configs/tools/{tools.name}" in names
    for ds_config in (REPO / "ds_configs").glob("*.json"):
        assert f"dsrl/ds_configs/{ds_config.name}" in names
    assert "dsrl/__main__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    commands = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert (
        "dsrl-train = dsrl.commands.train:run" in commands and "dsrl-convert = dsrl.commands.convert:main" in commands
    )
    assert "dsrl-eval = dsrl.commands.evaluate:run" in commands


@pytest.mark.parametrize("command", ["dsrl-train", "python -m dsrl"])
def test_the_installed_command_validates_a_recipe_from_another_directory(installed, command, tmp_path):
    _, venv = installed
    for split in ("train", "test"):
        write_parquet_stub(tmp_path / f"{split}.parquet")
    write_model_stub(tmp_path / "model")
    files = [
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'test.parquet'}",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
    ]
    program = (
        [str(venv / "bin" / "dsrl-train")] if command == "dsrl-train" else [str(venv / "bin" / "python"), "-m", "dsrl"]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK")}
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import dsrl; print(dsrl.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
    )
    assert where.stdout.startswith(str(venv))  # the wheel, not this checkout
    result = subprocess.run(
        [*program, "ppo", "cpu", *files, "--validate-only"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["algorithm"]["adv_estimator"] == "gae"
    assert printed["critic"]["deepspeed_config"] == "zero3_offload"  # found inside the installed package
    bad = subprocess.run(
        [*program, "ppo", "cpu", *files, "actor_rollout_ref.actor.deepspeed_config=zero4", "--validate-only"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2
    assert f"no DeepSpeed config at {venv}" in bad.stderr and "zero3_offload" in bad.stderr


def test_the_installed_dsrl_eval_reports_a_bad_model_and_data_file(installed, tmp_path):
    _, venv = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK")}
    result = subprocess.run(
        [
            str(venv / "bin" / "dsrl-eval"),
            str(tmp_path / "no-model"),
            "--data",
            str(tmp_path / "none.parquet"),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"actor_rollout_ref.model.path={tmp_path / 'no-model'}: no such model directory" in result.stderr
    assert f"data.val_files={tmp_path / 'none.parquet'}: file does not exist" in result.stderr
