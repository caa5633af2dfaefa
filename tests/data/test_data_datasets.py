"""Prompt parquet files: reading, chat template, length policy, errors, the flat store, sampler, left padding."""

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from dsrl.data import datasets
from dsrl.data.batch import left_pad
from dsrl.data.datasets import PromptRecord, PromptSampler, PromptStore, collate_prompts, load_prompts

_spec = importlib.util.spec_from_file_location(
    "make_tiny_model", Path(__file__).parents[2] / "scripts" / "make_tiny_model.py"
)
make_tiny_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny_model)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_model.build_tokenizer()


def row(content="1+2=", truth="3", source="arithmetic", index=0):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index},
    }


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def load(files, tokenizer, **kwargs):
    options = dict(max_prompt_length=64, filter_overlong_prompts=True, truncation="error") | kwargs
    return load_prompts(files, tokenizer, **options)


def test_reads_files_in_order_and_applies_the_chat_template(tmp_path, tokenizer):
    first = write(tmp_path / "a.parquet", [row("1+2=", "3", index=0), row("4+5=", "9", index=1)])
    second = write(tmp_path / "b.parquet", [row("10+1=", "11", source="other", index=0)])
    records, stats = load([first, second], tokenizer)
    expected = tokenizer("<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    assert list(records[0].prompt_ids) == expected
    assert [r.ground_truth for r in records] == ["3", "9", "11"]
    assert [r.data_source for r in records] == ["arithmetic", "arithmetic", "other"]
    assert records[1].extra_info == {"split": "train", "index": 1}
    assert stats == {"rows": 3, "kept": 3, "filtered_overlong": 0, "truncated": 0}
    assert len(load(first, tokenizer)[0]) == 2  # a single path works too


def test_missing_extra_info_column_gives_empty_dicts_and_prompt_key_selects_the_column(tmp_path, tokenizer):
    rows = [
        {
            "data_source": "arithmetic",
            "question": [{"role": "user", "content": "1+1="}],
            "reward_model": {"ground_truth": "2"},
        }
    ]
    path = write(tmp_path / "q.parquet", rows)
    records, _ = load(path, tokenizer, prompt_key="question")
    assert records[0].extra_info == {}
    with pytest.raises(ValueError, match=r"no column \['prompt'\].*data.prompt_key"):
        load(path, tokenizer)


def test_overlong_prompts_are_filtered_counted_and_reported(tmp_path, tokenizer, caplog):
    path = write(tmp_path / "p.parquet", [row("1+2="), row("x" * 100), row("3+4="), row("y" * 200)])
    with caplog.at_level(logging.WARNING):
        records, stats = load(path, tokenizer, max_prompt_length=40)
    assert len(records) == 2 and all(len(r.prompt_ids) <= 40 for r in records)
    assert stats == {"rows": 4, "kept": 2, "filtered_overlong": 2, "truncated": 0}
    assert "dropped 2 of 4 prompts longer than data.max_prompt_length=40" in caplog.text
    with pytest.raises(ValueError, match="no prompts left"):
        load(path, tokenizer, max_prompt_length=5)


def test_truncation_error_names_file_row_and_fixes(tmp_path, tokenizer):
    path = write(tmp_path / "p.parquet", [row("1+2="), row("x" * 100)])
    with pytest.raises(ValueError) as info:
        load(path, tokenizer, max_prompt_length=40, filter_overlong_prompts=False)
    message = str(info.value)
    assert "p.parquet row 1" in message and "data.max_prompt_length=40" in message
    assert "data.filter_overlong_prompts=true" in message and "data.truncation=left" in message


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_left_keeps_the_end_right_keeps_the_start(tmp_path, tokenizer, mode):
    path = write(tmp_path / "p.parquet", [row("1+2="), row("x" * 100)])
    full = load(path, tokenizer, max_prompt_length=200)[0][1].prompt_ids
    records, stats = load(path, tokenizer, max_prompt_length=40, filter_overlong_prompts=False, truncation=mode)
    assert stats["truncated"] == 1 and len(records) == 2
    assert records[1].prompt_ids == (full[-40:] if mode == "left" else full[:40])
    with pytest.raises(ValueError, match=r"data.truncation='middle'"):
        load(path, tokenizer, truncation="middle")


@pytest.mark.parametrize(
    "bad, rule",
    [
        ({"prompt": "1+2="}, r"'prompt' is str .* not a list of messages"),
        ({"prompt": []}, r"not a list of messages"),
        ({"prompt": [{"role": "user"}]}, r"without str 'role' and 'content'"),
        ({"reward_model": {"style": "rule", "ground_truth": None}}, r"without reward_model.ground_truth"),
        ({"data_source": ""}, r"data_source is '', not a non-empty string"),
    ],
)
def test_malformed_rows_are_errors_naming_file_row_and_rule(tmp_path, tokenizer, bad, rule):
    path = write(
        tmp_path / "bad.parquet", [row(index=0), row(index=1) | bad] if "prompt" not in bad else [row(index=0) | bad]
    )
    bad_row = 0 if "prompt" in bad else 1
    with pytest.raises(ValueError, match=rf"bad.parquet row {bad_row}: .*{rule}.*Fix: "):
        load(path, tokenizer)


def test_missing_file_and_missing_chat_template(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="prepare_data.py"):
        load(str(tmp_path / "none.parquet"), tokenizer)
    plain = make_tiny_model.build_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template") as info:
        load(write(tmp_path / "p.parquet", [row()]), plain)
    message = str(info.value)  # what to set, and why there is no key for a template
    assert "actor_rollout_ref.model.path" in message and "chat_template.jinja" in message
    assert "custom_chat_template is refused" in message


def test_the_fix_named_for_a_missing_chat_template_works(tmp_path, tokenizer):
    plain = make_tiny_model.build_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text(make_tiny_model.CHAT_TEMPLATE)
    fixed = AutoTokenizer.from_pretrained(tmp_path / "model")
    path = write(tmp_path / "p.parquet", [row()])
    assert load(path, fixed)[0][0] == load(path, tokenizer)[0][0]


def records_of(n, tokenizer, tmp_path):
    path = write(tmp_path / "n.parquet", [row(f"{i}+0=", str(i), index=i) for i in range(n)])
    return load(path, tokenizer)[0]


def test_sampler_epochs_are_seeded_permutations_without_the_remainder(tmp_path, tokenizer):
    records = records_of(10, tokenizer, tmp_path)
    sampler = PromptSampler(records, 3, shuffle=True, seed=7)
    assert sampler.batches_per_epoch == 3
    epochs = [[r.ground_truth for _ in range(3) for r in sampler.next_batch()] for _ in range(2)]
    assert sampler.state_dict() == {"epoch": 1, "index": 3}
    for taken in epochs:
        assert len(taken) == len(set(taken)) == 9  # one batch of 3 per step, 1 record left out per epoch
    assert epochs[0] != epochs[1]
    again = PromptSampler(records, 3, shuffle=True, seed=7)
    assert [r.ground_truth for r in again.next_batch()] == epochs[0][:3]
    other_seed = PromptSampler(records, 3, shuffle=True, seed=8)
    assert [r.ground_truth for _ in range(3) for r in other_seed.next_batch()] != epochs[0]
    ordered = PromptSampler(records, 4, shuffle=False, seed=7)
    assert [r.ground_truth for r in ordered.next_batch()] == ["0", "1", "2", "3"]


def test_sampler_resumes_exactly(tmp_path, tokenizer):
    records = records_of(10, tokenizer, tmp_path)
    straight = PromptSampler(records, 4, shuffle=True, seed=1)
    expected = [straight.next_batch() for _ in range(7)]
    first = PromptSampler(records, 4, shuffle=True, seed=1)
    taken = [first.next_batch() for _ in range(3)]
    resumed = PromptSampler(records, 4, shuffle=True, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert taken + [resumed.next_batch() for _ in range(4)] == expected
    with pytest.raises(ValueError, match="another dataset or data.train_batch_size"):
        resumed.load_state_dict({"epoch": 0, "index": 5})
    with pytest.raises(ValueError, match="data.train_batch_size=11"):
        PromptSampler(records, 11, shuffle=True, seed=1)
    # dynamic sampling's rounds of data.gen_batch_size: the errors name that key
    rounds = PromptSampler(records, 5, shuffle=True, seed=1, key="data.gen_batch_size")
    with pytest.raises(ValueError, match="another dataset or data.gen_batch_size"):
        rounds.load_state_dict({"epoch": 0, "index": 3})
    with pytest.raises(ValueError, match=r"data.gen_batch_size=11: .* Fix: lower data.gen_batch_size"):
        PromptSampler(records, 11, shuffle=True, seed=1, key="data.gen_batch_size")


def test_left_pad_and_collate():
    ids, mask = left_pad([(5, 6, 7), (8,)], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_collate_prompts_gives_the_batch_prompt_fields(tmp_path, tokenizer):
    records = records_of(3, tokenizer, tmp_path)
    fields = collate_prompts(records[:2], tokenizer.pad_token_id)
    assert set(fields) == {"prompt_ids", "prompt_mask", "data_sources", "ground_truths", "extra_infos", "raw_prompts"}
    assert fields["raw_prompts"] == []  # the store keeps no messages unless asked
    assert fields["prompt_ids"].shape == fields["prompt_mask"].shape == (2, len(records[0].prompt_ids))
    assert fields["prompt_ids"][fields["prompt_mask"].bool()].tolist() == list(
        records[0].prompt_ids + records[1].prompt_ids
    )
    assert fields["ground_truths"] == ["0", "1"] and fields["extra_infos"][1] == {"split": "train", "index": 1}


def test_max_samples_reads_the_first_rows_across_files(tmp_path, tokenizer):
    first = write(tmp_path / "a.parquet", [row(f"{i}+1=", str(i + 1), index=i) for i in range(3)])
    second = write(tmp_path / "b.parquet", [row("9+9=", "18", index=0)])
    records, stats = load([first, second], tokenizer, max_samples=2)
    assert [r.ground_truth for r in records] == ["1", "2"] and stats["rows"] == 2
    records, _ = load([first, second], tokenizer, max_samples=4)
    assert [r.ground_truth for r in records] == ["1", "2", "3", "18"]


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tokenizer = make_tiny_model.build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
        "0{% endif %}"
    )
    path = write(tmp_path / "a.parquet", [row("1+2=")])
    plain = load(path, tokenizer)[0][0].prompt_ids
    no_think = load(path, tokenizer, chat_template_kwargs={"enable_thinking": False})[0][0].prompt_ids
    assert tokenizer.decode(plain) == "1+2=" and tokenizer.decode(no_think) == "1+2=0"


# ---- the flat store --------------------------------------------------------------------------


def reference_load(files, tokenizer, *, max_prompt_length, filter_overlong_prompts, truncation, max_samples=-1):
    """The records as the tuple-based loader (before PromptStore) built them: whole files, one row at a time."""
    records, read = [], 0
    for file in files:
        if read == max_samples:
            break
        rows = pq.read_table(file).to_pylist()
        rows = rows[: max_samples - read] if max_samples > 0 else rows
        read += len(rows)
        for r in rows:
            text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    continue
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            truth, info = r["reward_model"]["ground_truth"], r.get("extra_info")
            records.append(PromptRecord(tuple(ids), r["data_source"], truth, info or {}))
    return records


@pytest.fixture
def varied_files(tmp_path):
    """Files that differ in ground-truth type, extra_info shape and data sources; some prompts too long."""
    strings = [row("x" * (1 + i * 7 % 40), str(i), source=f"s{i % 3}", index=i) for i in range(11)]
    lists = [row(f"{i}?", [str(i), "or", str(-i)], source="lists") | {"extra_info": None} for i in range(5)]
    for i, r in enumerate(lists):
        r["extra_info"] = None if i % 2 else {"split": "test", "index": i, "tags": ["a", str(i)]}
    numbers = [row(f"{i}*2=", "0") | {"reward_model": {"ground_truth": i * 2}} for i in range(4)]
    for r in numbers:
        del r["extra_info"]
    nulls = [row("9-1=", "8", source="s1") | {"extra_info": None}]
    names = ["strings", "lists", "numbers", "nulls"]
    return [
        write(tmp_path / f"{n}.parquet", rows) for n, rows in zip(names, [strings, lists, numbers, nulls], strict=True)
    ]


@pytest.mark.parametrize(
    "options",
    [
        dict(max_prompt_length=64, filter_overlong_prompts=True, truncation="error"),
        dict(max_prompt_length=40, filter_overlong_prompts=True, truncation="error"),
        dict(max_prompt_length=40, filter_overlong_prompts=False, truncation="left"),
        dict(max_prompt_length=40, filter_overlong_prompts=False, truncation="right", max_samples=14),
    ],
)
def test_store_gives_the_records_of_the_tuple_loader(varied_files, tokenizer, monkeypatch, options):
    monkeypatch.setattr(datasets, "READ_BATCH_ROWS", 3)  # batches that cut files and filtered rows
    expected = reference_load(varied_files, tokenizer, **options)
    store, stats = load_prompts(varied_files, tokenizer, **options)
    assert isinstance(store, PromptStore) and stats["kept"] == len(store) == len(expected)
    assert list(store) == expected  # ids, data source, ground truth, extra info, order
    assert [store[i] for i in range(len(store))] == expected
    order = np.random.default_rng(0).permutation(len(store))
    assert store.take(order) == [expected[i] for i in order]
    assert {type(r.prompt_ids) for r in store} == {tuple}
    assert store.num_tokens == sum(len(r.prompt_ids) for r in expected)


def test_store_slicing_as_the_trainer_uses_it(varied_files, tokenizer):
    store, _ = load(varied_files, tokenizer)
    records = list(store)
    world, chunk = 3, 2
    for rank in range(world):
        shard = store[rank::world]
        assert isinstance(shard, PromptStore) and len(shard) == len(records[rank::world])
        for start in range(0, len(shard) + chunk, chunk):
            part = shard[start : start + chunk]
            assert list(part) == records[rank::world][start : start + chunk]
            assert bool(part) == bool(records[rank::world][start : start + chunk])
    assert list(store[:1]) == records[:1] and list(store[::-2]) == records[::-2]
    assert list(store[2:9][1::3]) == records[2:9][1::3] and list(store[5:2]) == []
    assert store[-1] == records[-1] and store[3:][-2] == records[3:][-2]
    with pytest.raises(IndexError):
        store[len(store)]
    with pytest.raises(TypeError):
        store["0"]
    assert collate_prompts(store[1:4], 0)["ground_truths"] == [r.ground_truth for r in records[1:4]]
    assert torch.equal(collate_prompts(store[1:4], 0)["prompt_ids"], collate_prompts(records[1:4], 0)["prompt_ids"])


# Batches of the tuple-based PromptSampler (before PromptStore) for records 0..n-1: the store must
# not change the permutation, or a resumed run would train on other prompts.
OLD_SAMPLER_BATCHES = {
    (10, 3, True, 7): [[8, 0, 7], [1, 3, 6], [2, 4, 5], [9, 0, 8], [6, 7, 1], [3, 4, 2], [1, 5, 3]],
    (23, 5, True, 0): [
        [18, 4, 20, 10, 11],
        [2, 21, 6, 19, 3],
        [22, 8, 0, 12, 16],
        [13, 7, 5, 17, 14],
        [15, 19, 18, 16, 14],
        [1, 22, 3, 4, 0],
    ],
    (7, 2, False, 0): [[0, 1], [2, 3], [4, 5], [0, 1]],
}


@pytest.mark.parametrize("n, batch_size, shuffle, seed", list(OLD_SAMPLER_BATCHES))
def test_sampler_batches_match_the_previous_implementation(tmp_path, tokenizer, n, batch_size, shuffle, seed):
    expected = OLD_SAMPLER_BATCHES[n, batch_size, shuffle, seed]
    store = records_of(n, tokenizer, tmp_path)
    sampler = PromptSampler(store, batch_size, shuffle=shuffle, seed=seed)
    assert [[int(r.ground_truth) for r in sampler.next_batch()] for _ in expected] == expected
    plain = PromptSampler(list(range(n)), batch_size, shuffle=shuffle, seed=seed)  # any sequence still works
    assert [plain.next_batch() for _ in expected] == expected
    resumed = PromptSampler(store, batch_size, shuffle=shuffle, seed=seed)
    resumed.load_state_dict({"epoch": 0, "index": 2})
    assert [int(r.ground_truth) for r in resumed.next_batch()] == expected[2]


def test_store_costs_at_most_5_bytes_per_token(tmp_path, tokenizer):
    n, length = 50_000, 200
    rng = np.random.default_rng(0)
    store = PromptStore.from_arrays(
        rng.integers(0, 150_000, n * length, dtype=np.int32),
        np.full(n, length),
        [f"source{i % 4}" for i in range(n)],
        [str(i) for i in range(n)],
        [{"split": "train", "index": i} for i in range(n)],
    )
    assert store.num_tokens == n * length and store.nbytes / store.num_tokens <= 5
    last = store[n - 1]
    assert (last.data_source, last.ground_truth, last.extra_info) == (
        "source3",
        str(n - 1),
        {"split": "train", "index": n - 1},
    )
    assert np.array_equal(last.prompt_ids, store._columns.token_ids[-length:])
    # The real loader on ~200-token prompts: the same budget, ground truths and extra infos included.
    content = "x" * (200 - 19)  # the template adds 19 tokens
    path = write(tmp_path / "long.parquet", [row(content, str(i), index=i) for i in range(500)])
    loaded, _ = load(path, tokenizer, max_prompt_length=256)
    assert loaded.num_tokens == 500 * 200 and loaded.nbytes / loaded.num_tokens <= 5


# ---- chat messages kept for a reward model with another template -----------------------------


def rendered_ids(tokenizer, messages) -> tuple[int, ...]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_store_keeps_the_messages_only_when_asked(varied_files, tokenizer, monkeypatch):
    monkeypatch.setattr(datasets, "READ_BATCH_ROWS", 3)  # batches that cut files and filtered rows
    options = dict(max_prompt_length=40, filter_overlong_prompts=True, truncation="error")
    plain, _ = load_prompts(varied_files, tokenizer, **options)
    kept, stats = load_prompts(varied_files, tokenizer, keep_messages=True, **options)
    assert stats["filtered_overlong"] > 0  # the messages must follow the kept rows
    assert {r.messages is None for r in plain} == {True}
    assert [r.prompt_ids for r in kept] == [r.prompt_ids for r in plain]
    # every kept row's messages render to its prompt tokens: each row got its own prompt's messages
    assert all(rendered_ids(tokenizer, r.messages) == r.prompt_ids for r in kept)
    order = np.random.default_rng(1).permutation(len(kept))
    assert kept.take(order) == [list(kept)[i] for i in order]
    assert [r.messages for r in kept[1::2]] == [r.messages for r in list(kept)[1::2]]
    text = sum(len(m["content"]) + len(m["role"]) for r in kept for m in r.messages)
    assert kept.nbytes - plain.nbytes >= text  # the messages are accounted for, and only when kept
    assert collate_prompts(kept[:3], 0)["raw_prompts"] == [r.messages for r in list(kept)[:3]]
    assert collate_prompts(plain[:3], 0)["raw_prompts"] == []


def test_from_arrays_keeps_given_messages(tokenizer):
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "x"}
    chats = [[{"role": "user", "content": "1+2="}], [system, user]]
    store = PromptStore.from_arrays(np.arange(5), [2, 3], ["a", "b"], ["3", "x"], messages=chats)
    assert [r.messages for r in store] == chats and store[1].prompt_ids == (2, 3, 4)
    assert store.nbytes > PromptStore.from_arrays(np.arange(5), [2, 3], ["a", "b"], ["3", "x"]).nbytes
    with pytest.raises(ValueError, match="differ in length"):
        PromptStore.from_arrays(np.arange(5), [2, 3], ["a", "b"], ["3", "x"], messages=chats[:1])
