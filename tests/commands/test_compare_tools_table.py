"""scripts/compare_tools.py without training: its arguments, the arms' configurations, the call counts, the table.
(The arms themselves train only once the agent loop, dsrl.rollout.multi_turn, is in.)"""

import runpy

import pytest

from tests.conftest import REPO

script = runpy.run_path(str(REPO / "scripts" / "compare_tools.py"))


def test_arguments_default_to_all_arms_and_refuse_sizes_below_one(capsys):
    args = script["parse_args"]([])
    assert (args.steps, args.batch, args.n, args.val_size) == (30, 4, 8, 32)
    assert args.arms == ["grpo-tools", "tir-otb-tools", "grpo-no-tools"] and args.overrides == []
    args = script["parse_args"](["--steps", "2", "--arms", "grpo-no-tools", "--", "trainer.seed=3"])
    assert args.steps == 2 and args.arms == ["grpo-no-tools"] and args.overrides == ["trainer.seed=3"]
    with pytest.raises(SystemExit):
        script["parse_args"](["--val-size", "0"])
    assert "--val-size 0: must be >= 1" in capsys.readouterr().err


def test_the_arms_differ_in_estimator_and_tools_only():
    args = script["parse_args"](["--steps", "5", "--batch", "2"])
    configs = {name: script["arm_overrides"](args, name) for name in args.arms}
    grpo_files, grpo = configs["grpo-tools"]
    assert configs["tir-otb-tools"][0][0].endswith("tir_otb.yaml") and grpo_files[0].endswith("grpo.yaml")
    assert configs["grpo-no-tools"] == (grpo_files, [*grpo, "actor_rollout_ref.rollout.multi_turn.enable=false"])
    assert {
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=5",
        "trainer.test_freq=5",
        "actor_rollout_ref.actor.use_kl_loss=false",
    } <= set(grpo)
    assert [f.rsplit("/", 1)[1] for f in grpo_files[1:]] == ["cpu.yaml", "calculator_cpu.yaml"]


def test_call_counts_read_the_decoded_responses():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1*2"}}\n</tool_call>'
    responses = [call + "user\n<tool_response>\n2\n</tool_response>\nassistant\n2", "56088", call + call, "<tool_"]
    assert script["call_counts"](responses) == (0.5, 0.75)


def test_table_has_one_aligned_row_per_arm():
    row = {
        "val_acc": (0.1, 0.55),
        "val_calls": (0.4, 0.9),
        "train_calls": (0.45, 1.0),
        "gen_tokens": 1809.4,
        "resp_tokens": 3000.0,
        "score": 0.25,
        "step_s": 3.5,
    }
    lines = script["format_table"]({"grpo-tools": row, "grpo-no-tools": row})
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1  # header, rule, two rows
    assert lines[0].split()[:3] == ["arm", "val", "acc"]
    assert lines[2].startswith("grpo-tools ") and "0.100 -> 0.550" in lines[2] and "40% -> 90%" in lines[2]
    assert "0.45 -> 1.00" in lines[2] and " 1809 " in lines[2] and lines[2].endswith("0.250    3.50")
