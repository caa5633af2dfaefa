"""The multi-turn loop (``dsrl.rollout.multi_turn``) with the real tool set and the tiny model's tokenizer: the
layout of the responses it builds (masks, log-probs, lengths), the conversation it renders equal to what the
chat template renders for the whole conversation, the turn limits and the length budget.

The engine here is ``ScriptedEngine``: it answers each conversation with a turn chosen from its text so far
(a tool call first, the tool's result after), so the expected layout is known token by token; the real
engines run the loop in tests/trainer/test_trainer_multi_turn.py and the vLLM tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from dsrl.data.batch import last_response_token, left_pad
from dsrl.rollout.base import RolloutOutput, SamplingParams
from dsrl.rollout.multi_turn import MultiTurnRollout
from dsrl.rollout.tools import ToolSet

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
LOG_PROB = -0.25  # what the scripted engine reports for each of its tokens

# Qwen2.5's way with tool outputs: a user turn wrapping each in <tool_response>; the tools listed in a system turn.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + tools | map(attribute='function.name') | join(', ') + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ScriptedEngine:
    """A rollout engine whose turns are ``reply(context text)``: deterministic, so each token's place is known."""

    static_memory = False

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply
        self.eos_token_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.pad_token_id = tokenizer.pad_token_id
        self.calls: list[SamplingParams] = []

    def generate(self, prompt_ids, prompt_mask, sampling: SamplingParams) -> RolloutOutput:
        self.calls.append(sampling)
        rows = [ids[mask.bool()] for ids, mask in zip(prompt_ids, prompt_mask, strict=True) for _ in range(sampling.n)]
        caps = sampling.row_max_tokens or [sampling.max_tokens] * len(rows)
        T = sampling.max_tokens
        out = RolloutOutput(
            torch.zeros(len(rows), T, dtype=torch.long),
            torch.zeros(len(rows), T, dtype=torch.long),
            torch.zeros(len(rows), T),
            [],
        )
        for i, (context, cap) in enumerate(zip(rows, caps, strict=True)):
            text = self.tokenizer.decode(context)
            tokens = self.tokenizer.encode(self.reply(text), add_special_tokens=False) + self.eos_token_ids
            tokens = tokens[:cap]
            out.response_ids[i, : len(tokens)] = torch.tensor(tokens)
            out.response_mask[i, : len(tokens)] = 1
            out.log_probs[i, : len(tokens)] = LOG_PROB
            out.finish_reasons.append("stop" if tokens[-1] in self.eos_token_ids else "length")
        return out


def calculator_first(text: str) -> str:
    """A call for the question's product until a result came back, then the last result as the answer."""
    if "<|im_start|>user\n<tool_response>" not in text and "<|im_start|>tool" not in text:
        question = text.split("What is ")[-1].split("?")[0]
        return CALL.format(question)
    return (
        text.rsplit("<tool_response>\n", 1)[-1].split("\n")[0]
        if "<tool_response>" in text
        else text.rsplit("tool\n", 1)[-1].split("<")[0]
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tools(tmp_path_factory, make_cfg):
    folder = tmp_path_factory.mktemp("tools")
    config = folder / "calculator.yaml"
    config.write_text("tools:\n  - class_name: dsrl:calculator\n    config: {type: native}\n")
    cfg = make_cfg(
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={config}",
    )
    toolset = ToolSet.from_config(cfg, log_file=folder / "tools.log")
    yield toolset
    toolset.close()


def loop_settings(**changes):
    return SimpleNamespace(
        **{"format": "hermes", "max_assistant_turns": None, "max_user_turns": None, "max_parallel_calls": 1, **changes}
    )


def prompts(tokenizer, questions: list[str], template_kwargs: dict | None = None):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        for q in questions
    ]
    return left_pad([tokenizer.encode(t, add_special_tokens=False) for t in texts], tokenizer.pad_token_id)


def run(tokenizer, tools, questions, *, reply=calculator_first, budget=200, n=1, template=None, **settings):
    if template is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
        tokenizer.chat_template = template
    engine = ScriptedEngine(tokenizer, reply)
    loop = MultiTurnRollout(engine, tokenizer, tools, loop_settings(**settings))
    ids, mask = prompts(tokenizer, questions, {"tools": tools.schemas})
    out = loop.generate(ids, mask, SamplingParams(n=n, max_tokens=budget, seed=3), tools_kwargs=[{}] * len(questions))
    return out, loop, engine, (ids, mask), tokenizer


@pytest.mark.parametrize("template", [None, QWEN_LIKE_TEMPLATE], ids=["tiny", "qwen-like"])
def test_the_tokens_of_a_conversation_are_what_the_template_renders_for_it(tokenizer, tools, template):
    out, _, _, (ids, mask), tokenizer = run(tokenizer, tools, ["What is 123*456?", "What is 7*8?"], template=template)
    for row, question in enumerate(["What is 123*456?", "What is 7*8?"]):
        talk = out.conversations[row]
        assert [m["role"] for m in talk["messages"]] == ["assistant", "tool", "assistant"]
        assert talk["messages"][1]["content"] == str(eval(question[8:-1]))  # the calculator's result
        assert (talk["num_turns"], talk["num_tool_calls"], talk["stop"]) == (2, 1, "answered")
        length = int(out.attention_mask[row].sum())
        tokens = torch.cat([ids[row][mask[row].bool()], out.response_ids[row, :length]])
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}, *talk["messages"]], tokenize=False, tools=tools.schemas
        )
        # The conversation ends at the model's end-of-turn token; the template adds its newline after it.
        assert tokenizer.decode(tokens) + "\n" == rendered


def test_the_model_tokens_are_in_the_loss_and_the_tool_outputs_only_in_the_context(tokenizer, tools):
    out, loop, _, _, tokenizer = run(tokenizer, tools, ["What is 12*34?"])
    length = int(out.attention_mask[0].sum())
    mask, attention, log_probs = out.response_mask[0], out.attention_mask[0], out.log_probs[0]
    first = len(tokenizer.encode(CALL.format("12*34"), add_special_tokens=False)) + 1  # with its end-of-turn token
    piece = loop.tool_turn_ids([{"role": "tool", "content": "408"}])
    last = len(tokenizer.encode("408", add_special_tokens=False)) + 1
    assert length == first + len(piece) + last
    assert mask[:length].tolist() == [1] * first + [0] * len(piece) + [1] * last
    assert attention.tolist() == [1] * length + [0] * (len(attention) - length)
    assert torch.equal(log_probs[:length], LOG_PROB * mask[:length].float()) and not log_probs[length:].any()
    assert int(last_response_token(out.response_mask)[0]) == length - 1  # the score's token: the model's last
    assert tokenizer.decode(out.response_ids[0, first : first + len(piece)]) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_every_conversation_of_a_turn_is_generated_in_one_call_with_its_own_room(tokenizer, tools):
    def answer_short_questions_directly(text):
        return "56" if "7*8" in text else calculator_first(text)

    out, _, engine, _, _ = run(
        tokenizer, tools, ["What is 7*8?", "What is 12*34?"], reply=answer_short_questions_directly, n=2
    )
    assert [c.n for c in engine.calls] == [2, 1]  # the first turn samples n per prompt; the second only who called
    second = engine.calls[1]
    assert len(second.row_max_tokens) == 2 and second.max_tokens == max(second.row_max_tokens)
    used = out.attention_mask[2:].sum(-1) - len(tokenizer.encode("408", add_special_tokens=False)) - 1
    assert list(second.row_max_tokens) == (200 - used).tolist()
    assert [c["num_turns"] for c in out.conversations] == [1, 1, 2, 2]


def test_the_later_turns_count_their_prompt_tokens_those_the_engine_had_cached_and_each_turn_its_time(tokenizer, tools):
    """multi_turn/later_turns/*: every call after the first turn adds the tokens it submitted and the engine's
    prefix_cached_tokens; the first turn's call (the batch's own prompts) adds nothing. Every call's seconds are
    kept (timing_s/gen_turn_max)."""
    submitted = []

    class CachingEngine(ScriptedEngine):
        def generate(self, prompt_ids, prompt_mask, sampling):
            out = super().generate(prompt_ids, prompt_mask, sampling)
            submitted.append(int(prompt_mask.sum()))
            out.prefix_cached_tokens = 7 * len(submitted)
            return out

    loop = MultiTurnRollout(CachingEngine(tokenizer, calculator_first), tokenizer, tools, loop_settings())
    ids, mask = prompts(tokenizer, ["What is 12*34?", "What is 5*6?"], {"tools": tools.schemas})
    loop.generate(ids, mask, SamplingParams(n=1, max_tokens=200, seed=3), tools_kwargs=[{}, {}])
    stats = loop.take_stats()
    assert len(submitted) == 2 and submitted[1] > submitted[0]  # the calls, then the answers on the whole contexts
    assert (stats.later_prompt_tokens, stats.later_cached_tokens) == (submitted[1], 14)
    assert len(stats.turn_seconds) == 2 and all(seconds > 0 for seconds in stats.turn_seconds)  # one a call
    assert (loop.take_stats().later_prompt_tokens, loop.take_stats().later_cached_tokens) == (0, 0)


def test_several_calls_in_one_turn_run_up_to_max_parallel_calls_and_a_bad_one_is_answered(tokenizer, tools):
    def two_calls_and_a_broken_one(text):
        if "tool" not in text.split("<|im_start|>assistant")[-1] and text.count("<|im_start|>assistant") == 1:
            return CALL.format("2+3") + CALL.format("4*5") + "<tool_call>\n{not json}\n</tool_call>"
        return "done"

    # budget: three <tool_response> blocks, one with the parse error's message, must fit
    out, loop, _, _, _ = run(
        tokenizer, tools, ["What is 2+3?"], reply=two_calls_and_a_broken_one, max_parallel_calls=3, budget=800
    )
    messages = out.conversations[0]["messages"]
    assert [m["content"] for m in messages[1:3]] == ["5", "20"]
    assert messages[3]["role"] == "tool" and messages[3]["content"] and "5" != messages[3]["content"]
    stats = loop.take_stats()
    assert (
        stats.calls["calculator"] == 2 and stats.failures["parse"] == 1 and out.conversations[0]["num_tool_calls"] == 3
    )
    out, loop, _, _, _ = run(
        tokenizer, tools, ["What is 2+3?"], reply=two_calls_and_a_broken_one, max_parallel_calls=1, budget=400
    )
    assert [m["role"] for m in out.conversations[0]["messages"]] == ["assistant", "tool", "assistant"]
    assert loop.take_stats().calls["calculator"] == 1


def test_the_turn_limits_end_a_conversation_without_running_its_last_calls(tokenizer, tools):
    def always_call(text):
        return CALL.format("1+1")

    for key in ("max_assistant_turns", "max_user_turns"):
        out, loop, _, _, _ = run(tokenizer, tools, ["What is 1+1?"], reply=always_call, budget=400, **{key: 2})
        talk = out.conversations[0]
        turns = 2 if key == "max_assistant_turns" else 3  # two rounds of tool outputs, then a third turn
        assert (talk["num_turns"], talk["stop"]) == (turns, "turn_limit")
        assert talk["num_tool_calls"] == turns - 1  # the last turn's call was not run
        assert out.response_mask[0, last_response_token(out.attention_mask)[0]] == 1


def test_the_length_budget_cuts_a_turn_or_drops_tool_outputs_that_leave_no_room(tokenizer, tools):
    call = len(tokenizer.encode(CALL.format("12*34"), add_special_tokens=False)) + 1
    out, *_ = run(tokenizer, tools, ["What is 12*34?"], budget=call - 5)
    assert out.conversations[0]["stop"] == "length" and out.finish_reasons == ["length"]
    assert out.attention_mask[0].all() and out.response_mask[0].all()  # the cut turn fills the budget
    out, loop, _, _, _ = run(tokenizer, tools, ["What is 12*34?"], budget=call + 3)  # the tool output does not fit
    assert out.conversations[0]["stop"] == "length" and out.conversations[0]["num_turns"] == 1
    assert int(out.attention_mask[0].sum()) == call and int(out.response_mask[0].sum()) == call


def test_the_loop_makes_no_collective_call_so_ranks_may_take_different_turns(tokenizer, tools, monkeypatch):
    import torch.distributed as dist

    def collective(*args, **kwargs):
        raise AssertionError("a collective inside the multi-turn loop: ranks with fewer turns would not reach it")

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, name, collective)
    out, *_ = run(
        tokenizer,
        tools,
        ["What is 7*8?", "What is 12*34?"],
        reply=lambda text: "56" if "7*8" in text else calculator_first(text),
    )
    assert [c["num_turns"] for c in out.conversations] == [1, 2]
