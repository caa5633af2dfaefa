"""dsrl.commands.tiny_runs, what the comparisons share: the tiny inputs built only when missing (and a clear error where
the checkout's scripts are not there), and the Markdown table."""

from __future__ import annotations

import pytest

from dsrl.commands import tiny_runs


def test_inputs_present_are_kept_and_missing_ones_without_the_scripts_name_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_runs, "CHECKOUT", tmp_path / "no-checkout")  # an installed package: no scripts/
    for marker in ("outputs/tiny_model/config.json", "outputs/data/arithmetic/train.parquet"):
        (tmp_path / marker).parent.mkdir(parents=True)
        (tmp_path / marker).touch()
    tiny_runs.build_tiny_inputs(tmp_path)  # nothing to build
    with pytest.raises(
        FileNotFoundError,
        match=r"fix: run python scripts/make_tiny_model.py --out outputs/tiny_tool_model "
        r"--task calculator in a dsrl checkout",
    ):
        tiny_runs.build_tiny_inputs(tmp_path, "calculator")


def test_the_markdown_table_has_a_row_per_dict_and_rounds_floats():
    table = tiny_runs.markdown_table(
        [{"arm": "full", "MiB": 1234.5, "s": 0.12345}, {"arm": "lora", "MiB": 12.0, "s": 2.0}]
    )
    assert table.splitlines() == [
        "| arm | MiB | s |",
        "|---|---|---|",
        "| full | 1,234 | 0.123 |",
        "| lora | 12 | 2 |",
    ]
