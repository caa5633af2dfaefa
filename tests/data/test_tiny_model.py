"""scripts/make_tiny_model.py: an offline, deterministic tiny Qwen3 with a character chat tokenizer."""

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsrl.rollout.multi_turn import MultiTurnRollout

pytestmark = pytest.mark.e2e  # builds and warm-starts the tiny models (minutes)

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


def test_chat_template_renders_tool_messages_as_qwen2_5_and_other_roles_as_before():
    tokenizer = make_tiny_model.build_tokenizer()

    def render(messages, add_generation_prompt=False):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert render(messages, True) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Alone, as the agent loop renders a tool output to append it.
    assert render([{"role": "tool", "content": "56088"}], True) == (
        "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Consecutive tool messages share one user turn; a tool message after another role opens a new one.
    tools = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert render([*messages, *tools, {"role": "assistant", "content": "3"}, tools[0]]) == (
        render(messages) + "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n"
    )


def test_tool_traces_train_on_the_assistant_turns_only_and_fit_the_positions():
    tokenizer = make_tiny_model.build_tokenizer()
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "999*999"}}\n</tool_call>'
    assert make_tiny_model.tool_call_text("999*999") == call
    assert make_tiny_model.parse_call("x" + call + "y") == "999*999"
    for broken in (call.replace("}}", "}"), call.replace("calculator", "python"), call.replace("\n", " "), "998001"):
        assert make_tiny_model.parse_call(broken) is None
    assert make_tiny_model.run_calculator("999*999") == "998001"
    assert make_tiny_model.run_calculator("999+1").startswith("Error")

    ids, labels = make_tiny_model.tool_trace(tokenizer, 999, 999, call=True)
    assert len(ids) == len(labels) <= 200 < make_tiny_model.MAX_POSITIONS
    conversation = [
        {"role": "user", "content": "What is 999*999?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "998001"},
        {"role": "assistant", "content": "998001"},
    ]  # the whole conversation as the template renders it, less the newline after the last turn
    assert tokenizer.decode(ids) + "\n" == tokenizer.apply_chat_template(conversation, tokenize=False)
    # ... and the tool output as the agent loop appends it after the call turn
    loop = MultiTurnRollout(
        SimpleNamespace(
            eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, static_memory=None
        ),
        tokenizer,
        SimpleNamespace(schemas=[]),
        None,
    )
    assert make_tiny_model.tool_turn_ids(tokenizer, "998001") == loop.tool_turn_ids([conversation[2]])
    assert tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100]) == (
        call + "<|im_end|>998001<|im_end|>"
    )
    ids, labels = make_tiny_model.tool_trace(tokenizer, 999, 999, call=False)
    assert tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100]) == "998001<|im_end|>"


def test_calculator_task_is_deterministic_and_reports_its_tool_use(tmp_path, capsys):
    for name in "ab":
        accuracy = make_tiny_model.main(["--task", "calculator", "--out", str(tmp_path / name), "--sft-steps", "2"])
        assert 0.0 <= accuracy <= 1.0
    assert files(tmp_path / "a") == files(tmp_path / "b")
    out = capsys.readouterr().out
    assert "2 SFT steps" in out and "calculator validation problems, greedy: well-formed calls" in out
    rendered = AutoTokenizer.from_pretrained(tmp_path / "a").apply_chat_template(
        [{"role": "tool", "content": "1"}], tokenize=False
    )
    assert rendered == "<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n"


def test_a_tool_target_is_a_share_of_the_calculator_tasks_probe(tmp_path, capsys):
    for argv in (
        ["--tool-target", "0.3"],
        ["--task", "calculator", "--tool-target", "0"],
        ["--task", "calculator", "--tool-target", "1.5"],
    ):
        with pytest.raises(SystemExit):
            make_tiny_model.main([*argv, "--out", str(tmp_path)])
        assert "a share in (0, 1], with --task calculator" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before building anything


def test_preference_pairs_put_the_true_answer_above_each_distinct_wrong_sample():
    tokenizer = make_tiny_model.build_tokenizer()
    eos = tokenizer.eos_token_id
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    samples = [[ids("5") + [eos], ids("6") + [eos], ids("6") + [eos], ids("12")]]  # right, wrong twice, cut short
    pairs = make_tiny_model.preference_pairs(tokenizer, [(2, 3)], samples)
    prompt = make_tiny_model.prompt_ids(tokenizer, 2, 3)
    assert pairs == [(prompt + ids("5") + [eos], prompt + r) for r in sorted([ids("12"), ids("6") + [eos]])]


def test_the_reward_model_is_a_score_head_dsrl_reads_that_learns_to_rank(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from dsrl.engines.reward_model import score_head_problem

    args = ["--reward-model", "--sft-steps", "0", "--rm-steps", "25", "--out", str(tmp_path)]
    trained = make_tiny_model.main(args)
    out = capsys.readouterr().out
    before = float(re.search(r"\(([0-9.]+)% before training\)", out).group(1)) / 100
    # The untrained policy's samples are rarely its answer: ranking the answer above them is learnt in 25 steps
    assert "25 Bradley-Terry steps" in out and trained > max(before, 0.75), out
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert score_head_problem(rm, str(tmp_path)) is None and rm.config.num_labels == 1
