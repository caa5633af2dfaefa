"""scripts/make_tiny_model.py: an offline, deterministic tiny Qwen3 with a character chat tokenizer."""

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

_spec = importlib.util.spec_from_file_location(
    "make_tiny_model", Path(__file__).parents[2] / "scripts" / "make_tiny_model.py"
)
make_tiny_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny_model)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path):
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        accuracy = make_tiny_model.main(["--out", str(tmp_path / name), "--sft-steps", "3", "--seed", seed])
        assert 0.0 <= accuracy <= 1.0
    a, b, c = (files(tmp_path / n) for n in "abc")
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= set(a)
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]


def test_saved_model_and_tokenizer_reload_as_a_chat_model(tmp_path):
    make_tiny_model.main(["--out", str(tmp_path), "--sft-steps", "0"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 64  # vLLM's CPU attention needs 64
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["vocab_size"] == len(tokenizer) == 100
    assert (
        model.config.eos_token_id
        == model.generation_config.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tokenizer.pad_token_id

    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+3="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\n12+3=<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len("user\n12+3=\nassistant\n") + 3  # one token per character, one per marker
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\n12+3=\nassistant\n"

    batch = tokenizer(["1+1=", "10+10="], return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # left padding
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], 100)
