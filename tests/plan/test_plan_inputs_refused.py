"""``--plan``'s inputs on the inputs of security_3 F22-F31 and more: a device size of 0 is refused as a size (not
read as "not given"), a config.json with impossible values is refused with the value and the rule (not a
traceback, not a plan of -663 M parameters), a mixture of experts is found at any depth, ``--model-config`` names
the path it was given, and the plan needs no data file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrl.plan.inputs import parse_size
from dsrl.plan.shape import PlanError, read_shape
from tests.conftest import run_train_without_torch

REPO = Path(__file__).resolve().parents[2]
QWEN_05B = REPO / "bench" / "model_shapes" / "Qwen2.5-0.5B-Instruct.json"
BASE = json.loads(QWEN_05B.read_text())


@pytest.mark.parametrize("text", ["0", "0GiB", "0.0MiB", "0.0001B", "0.4B"])
def test_a_device_size_of_no_bytes_is_refused(text):
    """security_3 F24: --device-memory 0 was read as "not given" (then: "pass --device-memory")."""
    with pytest.raises(ValueError, match="write e.g. 141GiB"):
        parse_size(text)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": "896"}, "hidden_size='896': sizes must be positive whole numbers"),  # F27: a TypeError
        ({"num_hidden_layers": -24, "vocab_size": -151936}, "num_hidden_layers=-24, vocab_size=-151936: sizes must"),
        ({"num_attention_heads": 0}, "num_attention_heads=0: sizes must be positive whole numbers"),
        ({"intermediate_size": 4864.5}, "intermediate_size=4864.5"),
        ({"hidden_size": True}, "hidden_size=True"),
        ({"num_key_value_heads": -2}, "num_key_value_heads=-2"),
        ({"head_dim": "64"}, "head_dim='64'"),
        ({"vocab_size": None}, "vocab_size=None"),
        ({"num_key_value_heads": 3}, "num_attention_heads=14 is not a multiple of num_key_value_heads=3"),
        ({"hidden_size": 900}, "hidden_size=900 is not a multiple of num_attention_heads=14 and no head_dim is given"),
        ({"num_experts": 64}, "a mixture-of-experts model (num_experts)"),
        ({"ffn_config": {"moe_num_experts": 16}}, "a mixture-of-experts model (ffn_config.moe_num_experts)"),  # F26
    ],
)
def test_a_model_config_with_impossible_values_is_refused_with_the_value(tmp_path, changes, message):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **changes}))
    with pytest.raises(PlanError) as refused:
        read_shape("unused", str(tmp_path / "config.json"))
    assert message in str(refused.value)
    assert "; fix: " in str(refused.value) or str(refused.value).endswith("the memory plan knows dense decoders only")


def test_a_multimodal_config_says_where_its_decoder_is_and_nested_experts_are_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": BASE}))
    with pytest.raises(PlanError, match=r"\(they are in text_config: a multimodal model, not a plain decoder\)"):
        read_shape("unused", str(tmp_path / "config.json"))
    moe = {"model_type": "llama4", "text_config": {**BASE, "num_local_experts": 16}}  # security_3 F26
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(PlanError, match=r"a mixture-of-experts model \(text_config.num_local_experts\)"):
        read_shape("unused", str(tmp_path / "config.json"))
    dense = {**BASE, "num_experts": 0, "text_config": {"num_local_experts": 1}}  # written out, and none
    (tmp_path / "config.json").write_text(json.dumps(dense))
    assert read_shape("unused", str(tmp_path / "config.json")).hidden == 896


def test_model_config_names_the_path_it_was_given(tmp_path):
    """security_3 F30: a missing --model-config or a folder was reported as the hub id having no config.json."""
    with pytest.raises(PlanError, match=f"--model-config {tmp_path / 'missing.json'}: no such file; fix: "):
        read_shape("Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match=f"--model-config {tmp_path}: a directory without a config.json; fix: "):
        read_shape("Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path))
    (tmp_path / "config.json").write_text(QWEN_05B.read_text())  # a model's folder: its config.json
    assert read_shape("Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path)).layers == 24
    (tmp_path / "config.json").write_text("[" * 5000)
    with pytest.raises(PlanError, match="cannot be read as JSON"):
        read_shape("unused", str(tmp_path / "config.json"))


def test_the_plan_needs_no_data_file_but_validate_only_does(tmp_path):
    """security_3 F31: the README's plan of the GSM8K recipe was refused on a machine without the GSM8K data."""
    args = ["grpo", "data.train_files=/nonexistent/train.parquet", "data.val_files=/nonexistent/test.parquet",
            "custom_reward_function.path=/nonexistent/reward.py", "--world-size", "8", "--device-memory", "141GiB",
            "--model-config", str(QWEN_05B)]  # fmt: skip
    planned = run_train_without_torch([*args, "--plan"], HF_HUB_CACHE=str(tmp_path))
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.startswith("memory plan: ")
    checked = run_train_without_torch([*args, "--validate-only"], HF_HUB_CACHE=str(tmp_path))
    assert checked.returncode == 2
    assert "data.train_files=/nonexistent/train.parquet: file does not exist" in checked.stderr
    assert "custom_reward_function.path=/nonexistent/reward.py" in checked.stderr
    refused = run_train_without_torch([*args, "--plan", "--device-memory", "0"], HF_HUB_CACHE=str(tmp_path))
    assert refused.returncode == 2 and "'0': a device's memory is more than 0 bytes" in refused.stderr
