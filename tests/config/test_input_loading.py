"""What loading the tokenizer and the prompts refuses or reports (issue 13, part 3), with copies of the tiny model
and real parquet files: a tokenizer without its vocabulary (0-token prompts), one larger than the model's
vocabulary, chat messages no template knows, a file that is not parquet, a directory of files, truncation."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsrl.data.datasets import load_prompts, load_tokenizer

ACTOR = "actor_rollout_ref.model.path"


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir), trust_remote_code=False)


def row(*messages, truth="3"):
    return {
        "data_source": "arithmetic",
        "prompt": list(messages) or [{"role": "user", "content": "1+2="}],
        "reward_model": {"ground_truth": truth},
    }


def write(path: Path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def load(files, tokenizer, **options):
    return load_prompts(
        files,
        tokenizer,
        **({"max_prompt_length": 64, "filter_overlong_prompts": True, "truncation": "error"} | options),
    )


# ---------------------------------------------------------------- the tokenizer


def test_a_model_without_tokenizer_files_gives_0_token_prompts_that_are_refused(model, tmp_path):
    """transformers builds an empty tokenizer from config.json alone; every prompt became 0 tokens and
    crashed inside generate. Now the first row is refused, naming the file and the fix."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    empty = load_tokenizer(str(model), trust_remote_code=False)
    assert empty("1+2=", add_special_tokens=False)["input_ids"] == []  # the failure this guards against
    path = write(tmp_path / "p.parquet", [row(), row()])
    with pytest.raises(ValueError) as info:
        load(path, empty)
    message = str(info.value)
    assert message.startswith(f"{path} row 0: the prompt is 0 tokens after the chat template")
    assert "Fix: give the model directory its tokenizer files" in message


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(model, tokenizer):
    config = json.loads((model / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == 100
    for vocab_size in (100, 128):  # as large, or larger (padded embeddings, e.g. Qwen's): fine
        (model / "config.json").write_text(json.dumps(config | {"vocab_size": vocab_size}))
        assert len(load_tokenizer(str(model), trust_remote_code=False)) == 100
    (model / "config.json").write_text(json.dumps(config | {"vocab_size": 90}))
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(model), trust_remote_code=False)
    message = str(info.value)
    assert message.startswith(f"{ACTOR}={model}: the tokenizer has 100 tokens, more than the model's vocab_size=90")
    assert (
        "token ids from 90 on index past the embedding" in message
        and "Fix: use the tokenizer saved with this model" in message
    )


def test_a_tokenizer_that_does_not_load_is_one_line_naming_the_key(model):
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(model), trust_remote_code=False)
    message = str(info.value)
    assert message.startswith(f"{ACTOR}={model}: the tokenizer or config.json cannot be loaded (")
    assert "\n" not in message and "Fix: point it at a complete model directory" in message


# ---------------------------------------------------------------- the messages


@pytest.mark.parametrize(
    "message, says",
    [
        (
            {"role": "human", "content": "1+2="},
            "holds a message with role 'human', not one of system, user, assistant, tool",
        ),
        ({"role": "gpt", "content": "3"}, "holds a message with role 'gpt'"),
        ({"role": "User", "content": "1+2="}, "holds a message with role 'User'"),  # templates compare exactly
        ({"role": "user", "content": ""}, "holds a user message with empty content"),
        ({"role": "system", "content": "  \n"}, "holds a system message with empty content"),
    ],
)
def test_messages_no_chat_template_knows_are_refused_with_file_and_row(tmp_path, tokenizer, message, says):
    path = write(tmp_path / "chat.parquet", [row(), row(), row({"role": "user", "content": "1+1="}, message)])
    with pytest.raises(ValueError) as info:
        load(path, tokenizer)
    assert str(info.value).startswith(f"{path} row 2: 'prompt' {says}"), str(info.value)
    assert ". Fix: " in str(info.value)


def test_every_known_role_and_an_assistant_turn_of_tool_calls_load(tmp_path, tokenizer):
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}],
    }
    messages = [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "1+2="},
        call,
        {"role": "tool", "content": "3"},
        {"role": "user", "content": "So?"},
    ]
    records, stats = load(write(tmp_path / "chat.parquet", [row(*messages)]), tokenizer, max_prompt_length=256)
    assert stats["kept"] == 1 and len(records[0].prompt_ids) > 0


# ---------------------------------------------------------------- files


def test_a_file_that_is_not_parquet_is_named_at_load_too(tmp_path, tokenizer):
    """Validation catches it first; load_prompts is also called without validation (scripts/bench_prompts.py)."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row()) + "\n")
    with pytest.raises(ValueError) as info:
        load(str(path), tokenizer)
    assert str(info.value).startswith(f"{path}: not a parquet file (") and "Fix: convert it" in str(info.value)


def test_a_directory_is_read_as_its_parquet_files_in_name_order(tmp_path, tokenizer):
    folder = tmp_path / "shards"
    folder.mkdir()
    write(folder / "b.parquet", [row(truth="b0"), row(truth="b1")])
    write(folder / "a.parquet", [row(truth="a0")])
    (folder / "notes.txt").write_text("not read")
    records, stats = load(str(folder), tokenizer)
    assert [r.ground_truth for r in records] == ["a0", "b0", "b1"] and stats["rows"] == 3
    listed, _ = load([str(folder / "a.parquet"), str(folder / "b.parquet")], tokenizer)
    assert [r.prompt_ids for r in listed] == [r.prompt_ids for r in records]


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_is_counted_and_right_truncation_warns_that_it_cuts_the_generation_prompt(
    tmp_path, tokenizer, caplog, mode
):
    path = write(
        tmp_path / "p.parquet",
        [row(), row({"role": "user", "content": "9" * 100}), row({"role": "user", "content": "8" * 90})],
    )
    generation_prompt = tuple(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    with caplog.at_level(logging.WARNING):
        records, stats = load(path, tokenizer, max_prompt_length=40, filter_overlong_prompts=False, truncation=mode)
    assert stats["truncated"] == 2 and stats["kept"] == 3
    kept = "last" if mode == "left" else "first"
    assert (
        f"cut 2 of 3 prompts to their {kept} data.max_prompt_length=40 tokens (data.truncation={mode})" in caplog.text
    )
    cut = [r.prompt_ids for r in records[1:]]
    if mode == "left":  # the prompt still ends where the answer starts
        assert all(ids[-len(generation_prompt) :] == generation_prompt for ids in cut)
        assert "generation prompt" not in caplog.text
    else:  # what the warning says: the model would continue the question instead of answering
        assert not any(ids[-len(generation_prompt) :] == generation_prompt for ids in cut)
        assert (
            "drops the generation prompt the chat template appends" in caplog.text
            and "data.truncation=left" in caplog.text
        )
