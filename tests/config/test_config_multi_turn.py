"""Validation of ``actor_rollout_ref.rollout.multi_turn.*``: the rules on the keys, and the tool files read by the
command (``--validate-only`` too) without importing torch, before any model loads."""

from __future__ import annotations

from tests.conftest import REPO, config_problems, recipe, run_train_without_torch, stub_file_overrides

MT = "actor_rollout_ref.rollout.multi_turn"
CALCULATOR = REPO / "configs" / "tools" / "calculator.yaml"


def test_enabling_multi_turn_needs_tools_and_sane_limits(tmp_path):
    files = stub_file_overrides(tmp_path)
    problems = config_problems(
        recipe("grpo"),
        [
            *files,
            f"{MT}.enable=true",
            f"{MT}.max_user_turns=0",
            f"{MT}.tool_response_truncate_side=top",
            f"{MT}.tool_timeout=0",
        ],
    )
    assert any(p.startswith(f"{MT}.tool_config_path=null: {MT}.enable=true needs tools") for p in problems)
    assert any(p.startswith(f"{MT}.max_user_turns=0: must be >= 1 or null") for p in problems)
    assert any(
        p.startswith(f"{MT}.tool_response_truncate_side=top: must be one of left, right, middle") for p in problems
    )
    assert any(p.startswith(f"{MT}.tool_timeout=0.0: must be > 0 seconds") for p in problems)


def test_tensor_parallel_engines_are_refused_with_multi_turn(tmp_path):
    overrides = [
        *stub_file_overrides(tmp_path),
        f"{MT}.enable=true",
        f"{MT}.tool_config_path={CALCULATOR}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ]
    problems = config_problems(recipe("grpo"), overrides, world_size=2)
    assert any("each rank's conversations take their own number of turns" in p for p in problems), problems
    assert config_problems(recipe("grpo"), overrides[:-1], world_size=2) == []


def test_with_enable_false_the_other_keys_are_not_read(tmp_path):
    overrides = [*stub_file_overrides(tmp_path), f"{MT}.tool_config_path=/nowhere/tools.yaml", f"{MT}.max_user_turns=0"]
    assert config_problems(recipe("grpo"), overrides) == []


def test_a_bad_tool_file_is_refused_by_validate_only_naming_the_file_and_line(tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text(
        'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n    return a + b\n\n\n'
        "def shout(text):\n    return text.upper()\n"
    )
    args = [
        *recipe("grpo"),
        *stub_file_overrides(tmp_path),
        f"{MT}.enable=true",
        f"{MT}.function_tool_path={tools}",
        "--validate-only",
    ]
    result = run_train_without_torch(args)
    assert result.returncode == 2, result.stderr
    assert f"{MT}.function_tool_path={tools}: {tools}:6:" in result.stderr, result.stderr
    assert "fix:" in result.stderr
    good = [a for a in args if not a.startswith(f"{MT}.function_tool_path")] + [f"{MT}.tool_config_path={CALCULATOR}"]
    assert run_train_without_torch(good).returncode == 0


def test_the_tool_workers_memory_bound_is_refused_below_256_mb_like_the_reward_workers(tmp_path):
    """security_3 D17: tool_memory_limit_mb=-1 passed and the workers ran with RLIMIT_DATA -1 MiB: no limit."""
    files = [*stub_file_overrides(tmp_path), f"{MT}.enable=true", f"{MT}.tool_config_path={CALCULATOR}"]
    for value in (-1, 100):
        (problem,) = config_problems(recipe("grpo"), [*files, f"{MT}.tool_memory_limit_mb={value}"])
        assert problem.startswith(f"{MT}.tool_memory_limit_mb={value}: must be 0 (no limit) or >= 256 MB")
        assert problem.endswith(f"fix: set {MT}.tool_memory_limit_mb=4096, or 0 for no limit")
    for value in (0, 256):
        assert config_problems(recipe("grpo"), [*files, f"{MT}.tool_memory_limit_mb={value}"]) == []
