"""A data source that no reward scores is refused when the prompts load, before any model: without the
check it would score 0 on every row for the whole run."""

from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.helpers.trainer import trainer_for

pytestmark = pytest.mark.e2e


def with_sources(src, dst, sources):
    """``src``'s rows with data_source set from ``sources`` (cycled)."""
    table = pq.read_table(src)
    values = [sources[i % len(sources)] for i in range(table.num_rows)]
    pq.write_table(
        table.set_column(table.schema.get_field_index("data_source"), "data_source", pc.cast(values, "string")), dst
    )
    return table.num_rows


def test_unmatched_data_sources_are_listed_with_their_row_counts(
    tiny_model_dir, arithmetic_data, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path, monkeypatch
):
    from dsrl.config import ConfigError
    from dsrl.engines import actor as actor_module

    rows = with_sources(arithmetic_data / "train.parquet", tmp_path / "train.parquet", ["arithmetic", "my_math"])
    with_sources(arithmetic_data / "test.parquet", tmp_path / "test.parquet", ["my_eval"])
    monkeypatch.setattr(actor_module.ActorEngine, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    overrides = [
        "custom_reward_function.path=",
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'test.parquet'}",
    ]
    with pytest.raises(ConfigError) as err:
        trainer_for("grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path / "out", *overrides)
    [message] = err.value.violations
    assert f"'my_math' ({rows // 2} rows of data.train_files)" in message
    assert "'my_eval' (" in message and "rows of data.val_files" in message and "'arithmetic' (" not in message
    assert "custom_reward_function.path" in message  # the fix

    # Scored by Math-Verify, or by a custom function: accepted (the check passes; the model loads).
    monkeypatch.setattr(
        actor_module.ActorEngine, "__init__", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("loads"))
    )
    for accepted in (
        ["reward.math_verify_sources=[my_math,my_eval]"],
        [f"custom_reward_function.path={arithmetic_data / 'digits_reward.py'}"],
    ):
        with pytest.raises(RuntimeError, match="loads"):
            trainer_for(
                "grpo", tiny_model_dir, arithmetic_data, ds_test_config, tmp_path / "out", *overrides, *accepted
            )
