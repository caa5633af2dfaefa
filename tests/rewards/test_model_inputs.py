"""The reward model's inputs (``dsrl.rewards.model_inputs``) on character tokenizers built here: with the policy's
vocabulary and template the policy's own tokens; otherwise verl's re-rendering with the reward model's template; the
longest sequences keep their end; and the problems of a reward model's or a teacher's tokenizer that cannot be used."""

import importlib.util
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dsrl.data.batch import Batch, left_pad, right_pad
from dsrl.rewards.model_inputs import (
    RewardModelInputs,
    reward_tokenizer_problem,
    same_template,
    teacher_vocabulary_problem,
)

_spec = importlib.util.spec_from_file_location(
    "make_tiny_model", Path(__file__).parents[2] / "scripts" / "make_tiny_model.py"
)
make_tiny_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny_model)

BOS = "<|endoftext|>"
# The reward model's own format: a BOS first, "role: content" turns
RM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
)


def char_tokenizer(characters: list[str], chat_template: str | None, *, adds_bos: bool) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer with its characters in the order given; ``adds_bos``: tokenising with special
    tokens puts a BOS first, as Llama's tokenizers do."""
    specials = make_tiny_model.SPECIAL_TOKENS
    backend = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(specials + characters)}, merges=[], unk_token="<|unk|>")
    )
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, specials.index(BOS))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token="<|im_end|>",
        pad_token=BOS,
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template,
    )


def saved(tokenizer, path: Path):
    """``tokenizer`` as a model directory holds it: saved and loaded again."""
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def policy():
    return make_tiny_model.build_tokenizer()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    """Another vocabulary (the characters reversed), its own template, a BOS added when tokenising."""
    tokenizer = char_tokenizer(make_tiny_model.CHARACTERS[::-1], RM_TEMPLATE, adds_bos=True)
    return saved(tokenizer, tmp_path_factory.mktemp("reward_model"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# Three rows: one turn that ended itself, one cut at the length limit, and a multi-turn row whose response holds a
# tool's output (in the context, response_mask 0 there).
MESSAGES = [
    [{"role": "user", "content": "1+2="}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "4*5="}],
    [{"role": "user", "content": "6*7="}],
]
TOOL_OUTPUT = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
# (text, model's) pieces of each response
RESPONSES = [
    [("3<|im_end|>", True)],
    [("20", True)],
    [("<tool_call>x</tool_call><|im_end|>", True), (TOOL_OUTPUT, False), ("42<|im_end|>", True)],
]
# What the reward model's template renders, written out by hand (its BOS cut): each response one assistant message,
# the policy's EOS text removed
RM_TEXTS = [
    "<|im_start|>user: 1+2=<|im_end|><|im_start|>assistant: 3<|im_end|>",
    "<|im_start|>system: be brief<|im_end|><|im_start|>user: 4*5=<|im_end|><|im_start|>assistant: 20<|im_end|>",
    "<|im_start|>user: 6*7=<|im_end|><|im_start|>assistant: <tool_call>x</tool_call>\n<|im_start|>user\n"
    "<tool_response>\n42\n</tool_response>\n<|im_start|>assistant\n42<|im_end|>",
]


def prompt_tokens(policy) -> list[list[int]]:
    return [make_tiny_model.chat_ids(policy, messages) for messages in MESSAGES]


def response_tokens(policy) -> list[list[int]]:
    return [[t for text, _ in pieces for t in ids(policy, text)] for pieces in RESPONSES]


def make_batch(policy, *, raw_prompts: bool = True) -> Batch:
    """The rows as the rollout leaves them: prompts left-padded, responses right-padded with the pad id."""
    responses = response_tokens(policy)
    masks = [[int(model) for text, model in pieces for _ in ids(policy, text)] for pieces in RESPONSES]
    width = max(map(len, responses)) + 2
    prompt_ids, prompt_mask = left_pad(prompt_tokens(policy), policy.pad_token_id)
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=right_pad(responses, width, policy.pad_token_id, torch.long),
        response_mask=right_pad(masks, width, 0, torch.long),
        group_ids=torch.arange(3),
        response_attention_mask=right_pad([[1] * len(r) for r in responses], width, 0, torch.long),
        raw_prompts=MESSAGES if raw_prompts else [],
    )


def test_with_the_policys_vocabulary_and_template_the_policys_tokens_are_read(policy, tmp_path):
    inputs = RewardModelInputs(policy, saved(policy, tmp_path), max_length=1000)
    assert inputs.same_template
    batch = make_batch(policy, raw_prompts=False)  # no messages needed
    assert not torch.equal(batch.response_mask, batch.response_attention)  # the tool output: context, not loss
    sequences, truncated = inputs.sequences(batch)
    expected = [p + r for p, r in zip(prompt_tokens(policy), response_tokens(policy), strict=True)]
    assert sequences == expected and truncated == 0
    assert policy.decode(sequences[2]).endswith(TOOL_OUTPUT + "42<|im_end|>")


def test_another_template_re_renders_the_conversation_as_verl(policy, reward):
    inputs = RewardModelInputs(policy, reward, max_length=1000)
    assert not inputs.same_template
    batch = make_batch(policy)
    assert inputs.texts(batch) == RM_TEXTS
    for messages, pieces, text in zip(MESSAGES, RESPONSES, RM_TEXTS, strict=True):
        response = "".join(t for t, _ in pieces).replace("<|im_end|>", "")
        rendered = reward.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], add_generation_prompt=False, tokenize=False
        )
        assert rendered == BOS + text  # the template writes a BOS, which is cut
    sequences, truncated = inputs.sequences(batch)
    # the tokenizer adds the BOS back: one, then the reward model's own ids of the text
    assert sequences == [[reward.bos_token_id, *ids(reward, text)] for text in RM_TEXTS] and truncated == 0
    assert reward.convert_ids_to_tokens(sequences[0][:2]) == [BOS, "<|im_start|>"]


def test_re_rendering_needs_the_prompts_messages(policy, reward):
    with pytest.raises(ValueError, match="keep_messages=True"):
        RewardModelInputs(policy, reward, max_length=1000).sequences(make_batch(policy, raw_prompts=False))


@pytest.mark.parametrize("same", [True, False])
def test_longer_sequences_keep_their_last_max_length_tokens_and_are_counted(policy, reward, tmp_path, same):
    rm = saved(policy, tmp_path) if same else reward
    full, _ = RewardModelInputs(policy, rm, max_length=1000).sequences(make_batch(policy))
    lengths = sorted(map(len, full))
    assert lengths[0] < lengths[1] < lengths[2]
    cut, truncated = RewardModelInputs(policy, rm, max_length=lengths[1]).sequences(make_batch(policy))
    assert truncated == 1  # as long as max_length is not cut
    assert cut == [s[-lengths[1] :] for s in full] and max(map(len, cut)) == lengths[1]
    assert cut[2][-1] == full[2][-1]  # the end, where the score is read, is kept
    with pytest.raises(ValueError, match="reward_model.max_length=0"):
        RewardModelInputs(policy, rm, max_length=0)


def test_same_template_needs_the_same_vocabulary_added_tokens_and_template(policy, tmp_path):
    assert same_template(policy, saved(policy, tmp_path / "copy"))
    other_template = make_tiny_model.build_tokenizer()
    other_template.chat_template = RM_TEMPLATE
    assert not same_template(policy, other_template)
    reordered = char_tokenizer(make_tiny_model.CHARACTERS[::-1], make_tiny_model.CHAT_TEMPLATE, adds_bos=False)
    assert not same_template(policy, reordered)
    added = make_tiny_model.build_tokenizer()
    added.add_tokens(["<think>"])
    assert not same_template(policy, added)


def test_a_reward_tokenizer_without_a_template_is_a_problem_unless_it_matches(policy, reward, tmp_path):
    assert reward_tokenizer_problem(policy, reward, "/rm") is None
    assert reward_tokenizer_problem(policy, saved(policy, tmp_path / "copy"), "/rm") is None
    bare = char_tokenizer(make_tiny_model.CHARACTERS[::-1], None, adds_bos=False)
    problem = reward_tokenizer_problem(policy, bare, "/rm")
    assert problem.startswith("reward_model.model.path=/rm: its tokenizer has no chat template")
    assert "its vocabulary differs" in problem and "actor_rollout_ref.model.path" in problem and "Fix:" in problem
    same_vocabulary = make_tiny_model.build_tokenizer()
    same_vocabulary.chat_template = None
    assert "the policy's has a chat template" in reward_tokenizer_problem(policy, same_vocabulary, "/rm")


def test_the_teacher_must_map_every_token_to_the_students_id(policy, tmp_path):
    assert teacher_vocabulary_problem(policy, saved(policy, tmp_path / "copy"), "/teacher") is None
    reordered = char_tokenizer(make_tiny_model.CHARACTERS[::-1], make_tiny_model.CHAT_TEMPLATE, adds_bos=False)
    problem = teacher_vocabulary_problem(policy, reordered, "/teacher")
    assert problem.startswith("distillation.teacher_models.teacher_model.model_path=/teacher: its tokenizer's vocab")
    # 4 special tokens, then 96 characters, "\n" first: reversed, it is the last (id 99), and the first in sort order
    assert "100 tokens to 100 in the student's, 96 tokens of both with other ids (e.g. '\\n': 99, 4 in" in problem
    assert "get_vocab() equal" in problem and "Fix:" in problem
    added = make_tiny_model.build_tokenizer()
    added.add_tokens(["<think>"])
    assert "1 token not in the student's (e.g. '<think>')" in teacher_vocabulary_problem(policy, added, "/teacher")
