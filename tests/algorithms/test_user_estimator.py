"""algorithm.import_modules: an estimator and a policy loss registered by the user's own file are accepted by
validation and used by a real training step; a module that fails to import is a violation at the key."""

import sys
from pathlib import Path

import pytest

from dsrl import config as C
from tests.conftest import config_problems, recipe, write_model_stub, write_parquet_stub

pytestmark = pytest.mark.e2e

USER_CODE = """
import torch

from dsrl.algorithms import register_estimator, register_policy_loss

CALLS = {"estimator": 0, "loss": 0}


@register_estimator("constant_half")
def constant_half(inputs, **_):
    \"\"\"Every response token gets advantage 0.5: critic/advantages/mean must read 0.5.\"\"\"
    CALLS["estimator"] += 1
    advantages = 0.5 * inputs.response_mask.to(inputs.token_level_rewards.dtype)
    return advantages, advantages


@register_policy_loss("plain_ratio")
def plain_ratio(*, old_log_probs, log_probs, advantages, response_mask, **_):
    \"\"\"-A * pi / pi_old, unclipped.\"\"\"
    CALLS["loss"] += 1
    return -advantages * torch.exp(log_probs - old_log_probs), {}
"""
USE_IT = ["algorithm.adv_estimator=constant_half", "actor_rollout_ref.actor.policy_loss.loss_mode=plain_ratio"]


@pytest.fixture
def fresh_process(monkeypatch):
    """``fresh_process()`` puts the registries back as dsrl ships them and forgets the user's modules, as in a
    new process (another rank); the test's registrations are undone afterwards either way."""
    from dsrl.algorithms import estimators, losses

    shipped = (dict(estimators._ESTIMATORS), set(estimators._POLICY_FREE), dict(losses._POLICY_LOSSES))
    before = set(sys.modules)

    def reset():
        monkeypatch.setattr(estimators, "_ESTIMATORS", dict(shipped[0]))
        monkeypatch.setattr(estimators, "_POLICY_FREE", set(shipped[1]))
        monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(shipped[2]))
        for name in set(sys.modules) - before:
            if name.startswith(("dsrl_user_", "my_dsrl_plugin")):
                del sys.modules[name]

    reset()
    yield reset
    reset()


@pytest.fixture
def files(tmp_path):
    write_parquet_stub(tmp_path / "train.parquet")
    write_model_stub(tmp_path / "model")
    return [
        f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=null",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
    ]


def problems(overrides):
    return config_problems(recipe("grpo"), overrides)


def user_module(path: Path) -> object:
    [module] = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path)]
    return module


def test_validation_accepts_names_the_users_module_registers(files, tmp_path, fresh_process):
    [estimator, loss] = problems(files + USE_IT)
    assert estimator.startswith(
        "algorithm.adv_estimator=constant_half: unknown estimator; fix: register it with "
        "dsrl.algorithms.register_estimator in a module listed in algorithm.import_modules"
    )
    assert loss.startswith("actor_rollout_ref.actor.policy_loss.loss_mode=plain_ratio: unknown policy loss")
    path = tmp_path / "my_estimators.py"
    path.write_text(USER_CODE)
    assert problems(files + USE_IT + [f"algorithm.import_modules=[{path}]"]) == []
    # validated again in the same process (e.g. validation, then the trainer): imported once, registered once
    assert problems(files + USE_IT + [f"algorithm.import_modules=[{path}]"]) == []


def test_a_module_name_on_the_path_works_as_an_entry(files, tmp_path, fresh_process, monkeypatch):
    (tmp_path / "my_dsrl_plugin.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert problems(files + USE_IT + ["algorithm.import_modules=[my_dsrl_plugin]"]) == []


@pytest.mark.parametrize(
    "source, failure",
    [
        ("x = 1\nraise RuntimeError('no GPU here')\n", "import failed: RuntimeError: no GPU here at {path}:2"),
        ("def f(:\n", "import failed: SyntaxError: invalid syntax ({name}, line 1) at {path}:1"),
        (
            "import no_such_package_for_dsrl\n",
            "import failed: ModuleNotFoundError: No module named 'no_such_package_for_dsrl' at {path}:1",
        ),
        # Before: SystemExit passed through validation and ended the run with its code, 0 included, nothing trained.
        ("import sys\nsys.exit(0)\n", "import failed: called sys.exit(0) while being imported at {path}:2"),
        ("import sys\n\nsys.exit()\n", "import failed: called sys.exit() while being imported at {path}:3"),
        (
            "raise SystemExit('no GPU, giving up')\n",
            "import failed: called sys.exit('no GPU, giving up') while being imported at {path}:1",
        ),
    ],
)
def test_a_module_that_fails_to_import_is_a_violation_with_the_file_and_the_exception(
    files, tmp_path, fresh_process, source, failure
):
    path = tmp_path / "broken_estimators.py"
    path.write_text(source)
    found = problems(files + [f"algorithm.import_modules=[{path}]"])
    assert found == [
        f"algorithm.import_modules={path}: "
        + failure.format(path=path, name=path.name)
        + "; fix: fix that module, or remove it from algorithm.import_modules (a .py path or an importable module name)"
    ]


def test_a_module_name_that_exits_on_import_is_a_violation(files, tmp_path, fresh_process, monkeypatch):
    (tmp_path / "my_dsrl_plugin_exits.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [found] = problems(files + ["algorithm.import_modules=[my_dsrl_plugin_exits]"])
    assert found.startswith(
        "algorithm.import_modules=my_dsrl_plugin_exits: import failed: called sys.exit(3) "
        f"while being imported at {tmp_path / 'my_dsrl_plugin_exits.py'}:2; fix: "
    )


def test_a_keyboard_interrupt_while_importing_is_the_users_and_propagates(files, tmp_path, fresh_process):
    path = tmp_path / "interrupted.py"
    path.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        problems(files + [f"algorithm.import_modules=[{path}]"])


def test_entries_that_do_not_exist(files, tmp_path, fresh_process):
    missing = tmp_path / "absent.py"
    found = problems(files + [f"algorithm.import_modules=[{missing},no_such_module_for_dsrl]"])
    assert [v.split("; fix:")[0] for v in found] == [
        f"algorithm.import_modules={missing}: import failed: no such file {missing}",
        "algorithm.import_modules=no_such_module_for_dsrl: import failed: ModuleNotFoundError: No module named "
        "'no_such_module_for_dsrl'",
    ]


def test_a_training_step_runs_the_users_estimator_and_loss(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, fresh_process
):
    from dsrl.algorithms import estimator_names, policy_loss_names
    from dsrl.trainer.loop import Trainer

    path = tmp_path / "my_estimators.py"
    path.write_text(USER_CODE)
    cfg, _ = C.load_and_validate(
        recipe("grpo"),
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={arithmetic_data / 'train.parquet'}",
            "data.val_files=null",
            f"custom_reward_function.path={arithmetic_data / 'digits_reward.py'}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "trainer.total_training_steps=1",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"algorithm.import_modules=[{path}]",
            *USE_IT,
        ],
        world_size=1,
    )
    assert "constant_half" in estimator_names() and "plain_ratio" in policy_loss_names()  # validation imported it
    fresh_process()  # the trainer must import the module itself, as on a rank that did not validate
    assert "constant_half" not in estimator_names() and "plain_ratio" not in policy_loss_names()
    trainer = Trainer(cfg)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))
    trainer.fit()
    assert user_module(path).CALLS["estimator"] == 1 and user_module(path).CALLS["loss"] >= 1
    [(step, metrics)] = [(s, m) for s, m in logged if "critic/advantages/mean" in m]
    assert step == 1
    assert metrics["critic/advantages/mean"] == pytest.approx(0.5)
    assert metrics["critic/advantages/min"] == metrics["critic/advantages/max"] == pytest.approx(0.5)
