"""Multi-turn rollouts with tool calls (``actor_rollout_ref.rollout.multi_turn``): the model calls tools while
it answers, and the tools' outputs join its response.

``MultiTurnRollout`` wraps any rollout engine (HF, vLLM). Each turn generates for every conversation still
going in one batched ``generate`` call -- the first turn n samples per prompt, the later ones one per
conversation -- until the model's end-of-turn token. A turn with tool calls (``dsrl.rollout.tools``: hermes
``<tool_call>{json}</tool_call>`` blocks, several per turn) has them run, all conversations' calls of the turn
together in the tool worker pool; the results become ``tool`` messages rendered by the model's own chat
template, and the next turn starts after them. A conversation ends when a turn has no call, at
``max_assistant_turns`` / ``max_user_turns`` (the calls of the last allowed turn are not run), or at the
length budget. Each later turn re-submits the conversation's whole context: an engine with a prefix cache (vLLM)
serves what the turn before computed, while its KV blocks are still cached; ``TurnStats`` counts these turns' prompt
tokens and the cached ones (``multi_turn/later_turns/*``).

The response of a row is all its turns and the tool outputs between them, ``data.max_response_length``
tokens at most: ``response_mask`` is 1 on the model's tokens (end-of-turn tokens included) and 0 on the tool
outputs and the template's text around them, which stay in the context (``attention_mask``). Rollout
log-probs are the model's on its tokens, 0 elsewhere. A turn cut by the budget ends the conversation
(finish reason "length"); tool outputs that would leave no room for another turn's first token are not
appended -- so every response ends on a token of the model's, and the score sits there.

What the template renders between turns is found by rendering once without and once with the tool
messages: the text after the model's end-of-turn token up to the next assistant header. The concatenation
of the prompt, the turns and these pieces is then what the template renders for the whole conversation
(``tests/rollout/test_multi_turn.py`` checks it on the tiny model's template).
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dsrl.data.batch import left_pad, right_pad
from dsrl.rollout.base import PartialRow, RolloutEngine, RolloutOutput, SamplingParams, StopCheck
from dsrl.rollout.tools import TOOL_FAILURE_KINDS, ToolRequest, ToolResult, ToolSet, parse_tool_calls

TURN_SEED_STRIDE = 7_000_003  # seeds of a batch's successive turns
STOP_REASONS = ("answered", "turn_limit", "length")  # why a conversation ended
_MARK = "\x00dsrl-turn\x00"  # an assistant message's content while finding what the template puts after it
_TURN = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
# Stands for the k-th of MultiTurnRollout._literals inside a tool output while the template renders it.
_LITERAL = re.compile("\x00dsrl-literal-([0-9]+)\x00")


@dataclass
class Conversation:
    """One row of a multi-turn batch while it is generated."""

    context: list[int]  # the prompt's tokens, then the response so far: what the next turn is generated from
    tools_kwargs: dict  # the row's extra_info["tools_kwargs"]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # response_mask
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the turns and tool messages, as the chat template takes them
    turns: int = 0  # assistant turns
    tool_rounds: int = 0  # rounds of tool messages (user turns)
    calls: int = 0  # tool calls run or answered with a parse error
    stop: str | None = None  # one of STOP_REASONS once ended
    pending: list = field(default_factory=list)  # this turn's calls (ToolCall) and unparsable blocks (their message)
    turn_start: int = 0  # where the current turn starts in response (generate_until continues a turn in chunks)

    def add(self, tokens: Sequence[int], *, model: bool, log_probs: Sequence[float] | None = None) -> None:
        self.context.extend(tokens)
        self.response.extend(tokens)
        self.mask.extend([int(model)] * len(tokens))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(tokens))


@dataclass
class TurnStats:
    """What the conversations generated on this rank since the last ``take_stats`` did."""

    calls: dict[str, int]  # tool calls by tool name (a call that did not parse has none)
    failures: dict[str, int]  # by TOOL_FAILURE_KINDS
    seconds: float = 0.0  # the tool calls' own wall time, summed
    turns: list[int] = field(default_factory=list)  # per conversation: assistant turns
    calls_per_row: list[int] = field(default_factory=list)  # per conversation: tool calls
    stops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STOP_REASONS, 0))
    # The turns after the first, which re-submit each conversation's context: their prompt tokens, and those the
    # engine's prefix cache served (RolloutOutput.prefix_cached_tokens; 0 without a prefix cache).
    later_prompt_tokens: int = 0
    later_cached_tokens: int = 0
    turn_seconds: list[float] = field(default_factory=list)  # per turn: the engine's generate call's wall time

    def record(self, name: str, result: ToolResult) -> None:
        if name in self.calls:
            self.calls[name] += 1
        if result.failure is not None:
            self.failures[result.failure] += 1
        self.seconds += result.seconds

    def finished(self, row: Conversation) -> None:
        self.turns.append(row.turns)
        self.calls_per_row.append(row.calls)
        self.stops[row.stop] += 1


class MultiTurnRollout:
    """``engine`` with the tool loop around its ``generate`` (see the module doc); the rest is the engine's."""

    def __init__(
        self, engine: RolloutEngine, tokenizer, tools: ToolSet, cfg, *, chat_template_kwargs: dict | None = None
    ):
        self.engine, self.tokenizer, self.tools = engine, tokenizer, tools
        self.cfg = cfg  # actor_rollout_ref.rollout.multi_turn
        self.template_kwargs = {"tools": tools.schemas, **(chat_template_kwargs or {})}
        self.eos_token_ids, self.pad_token_id = engine.eos_token_ids, engine.pad_token_id
        self.static_memory = engine.static_memory
        self.tool_names = [schema["function"]["name"] for schema in tools.schemas]
        # What the template renders after an assistant turn's end-of-turn token, found once (tool_turn_ids).
        self._closed = self._render(_TURN, add_generation_prompt=False)
        after_turn = self._closed[self._closed.index(_MARK) + len(_MARK) :]
        end = tokenizer.decode(self.eos_token_ids[:1])
        self._after_turn = after_turn[len(end) :] if after_turn.startswith(end) else after_turn
        # Texts a tool output holds as text only (tool_turn_ids): the tokenizer's added tokens, longest first (the
        # tokenizer matches the longest), and NUL, which _LITERAL's placeholders use.
        added = {token.content for token in tokenizer.added_tokens_decoder.values()}
        self._literals = sorted(added, key=len, reverse=True) + ["\x00"]
        self._literal_pattern = re.compile("|".join(re.escape(text) for text in self._literals))
        self._literal_index = {text: k for k, text in enumerate(self._literals)}
        added_ids = set(tokenizer.added_tokens_decoder)
        self._literal_ids = [_text_ids(tokenizer, text, added_ids) for text in self._literals]
        self.stats = self._new_stats()

    @classmethod
    def from_config(cls, engine: RolloutEngine, tokenizer, tools: ToolSet, cfg) -> MultiTurnRollout:
        return cls(
            engine,
            tokenizer,
            tools,
            cfg.actor_rollout_ref.rollout.multi_turn,
            chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs),
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags)

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: SamplingParams, *, tools_kwargs: list[dict]
    ) -> RolloutOutput:
        """``sampling.n`` conversations per left-padded prompt ``[B, P]`` (``tools_kwargs``: each prompt's
        ``extra_info["tools_kwargs"]``); a ``RolloutOutput`` with ``attention_mask`` and ``conversations`` set.
        Its counts are added to ``stats`` (``take_stats``)."""
        budget = sampling.max_tokens
        rows = [
            Conversation(ids[mask.bool()].tolist(), tools_kwargs[i // sampling.n])
            for i, (ids, mask) in enumerate(
                zip(
                    prompt_ids.repeat_interleave(sampling.n, 0),
                    prompt_mask.repeat_interleave(sampling.n, 0),
                    strict=True,
                )
            )
        ]
        stats = self.stats
        out = self._timed_generate(prompt_ids, prompt_mask, sampling)
        active = list(range(len(rows)))  # the rows of out, in order
        for turn in itertools.count(1):
            wanting = [i for k, i in enumerate(active) if self._take_turn(rows[i], out, k, budget)]
            self._answer_calls([rows[i] for i in wanting], budget, stats)
            active = [i for i in wanting if rows[i].stop is None]
            if not active:
                break
            room = [budget - len(rows[i].response) for i in active]
            ids, mask = left_pad([rows[i].context for i in active], self.pad_token_id)
            seed = None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE
            out = self._timed_generate(
                ids, mask, sampling.replace(n=1, max_tokens=max(room), row_max_tokens=tuple(room), seed=seed)
            )
            stats.later_prompt_tokens += int(mask.sum())
            stats.later_cached_tokens += out.prefix_cached_tokens
        for row in rows:
            stats.finished(row)
        return self._output(rows, budget)

    @torch.no_grad()
    def generate_until(
        self, rows: Sequence[Conversation], sampling: SamplingParams, *, chunk_tokens: int, stop: StopCheck
    ) -> None:
        """Partial rollout (``dsrl.trainer.partial_rollout``): go on with each conversation (one response each) in
        chunks of at most ``chunk_tokens`` tokens of its current turn, the engine's ``generate_until`` for one chunk at
        a time; a turn that ends in the chunk has its tool calls run before the next, all conversations' together.
        ``stop`` is asked after each chunk with every conversation's end; the conversations hold the progress (a turn
        cut mid-way goes on from its tokens at the next call). Ended conversations count in ``stats``."""
        budget = sampling.max_tokens
        for chunk in itertools.count():
            live = [row for row in rows if row.stop is None]
            if live:
                seed = None if sampling.seed is None else sampling.seed + chunk * TURN_SEED_STRIDE
                start = time.perf_counter()
                progress = self.engine.generate_until(
                    [PartialRow(tuple(row.context), (), budget - len(row.response)) for row in live],
                    sampling.replace(n=1, seed=seed),
                    chunk_tokens=chunk_tokens,
                    stop=lambda finished: True,
                )
                self.stats.turn_seconds.append(time.perf_counter() - start)
                wanting = []
                for row, p in zip(live, progress, strict=True):
                    row.add(p.tokens, model=True, log_probs=p.log_probs)
                    if p.finished and self._close_turn(row, row.response[row.turn_start :]):
                        wanting.append(row)
                self._answer_calls(wanting, budget, self.stats)
                for row in live:
                    if row.stop is not None:
                        self.stats.finished(row)
            if stop([row.stop is not None for row in rows]):
                return

    def _timed_generate(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingParams) -> RolloutOutput:
        start = time.perf_counter()
        out = self.engine.generate(ids, mask, sampling)
        self.stats.turn_seconds.append(time.perf_counter() - start)
        return out

    def _new_stats(self) -> TurnStats:
        return TurnStats(dict.fromkeys(self.tool_names, 0), dict.fromkeys(TOOL_FAILURE_KINDS, 0))

    def take_stats(self) -> TurnStats:
        """The counts of the conversations generated since the last call
        (``dsrl.trainer.metrics.multi_turn_metrics``)."""
        stats, self.stats = self.stats, self._new_stats()
        return stats

    def _take_turn(self, row: Conversation, out: RolloutOutput, index: int, budget: int) -> bool:
        """Append row ``index`` of ``out`` to ``row`` as its next turn; whether it asks for tools and may have them."""
        length = int(out.response_mask[index].sum())
        room = budget - len(row.response)
        tokens = out.response_ids[index, : min(length, room)].tolist()
        row.add(tokens, model=True, log_probs=out.log_probs[index, : len(tokens)].tolist())
        return self._close_turn(row, tokens)

    def _close_turn(self, row: Conversation, tokens: list[int]) -> bool:
        """``row``'s turn of ``tokens`` (already added) ends; whether it asks for tools and may have them."""
        row.turns += 1
        ended = bool(tokens) and tokens[-1] in self.eos_token_ids
        text = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
        row.messages.append({"role": "assistant", "content": text})
        if not ended:  # the budget, or the engine's max_tokens, cut the turn
            row.stop = "length"
            return False
        calls, errors = parse_tool_calls(text, self.cfg.format)
        if not calls and not errors:
            row.stop = "answered"
            return False
        turns, rounds = self.cfg.max_assistant_turns, self.cfg.max_user_turns
        if (turns is not None and row.turns >= turns) or (rounds is not None and row.tool_rounds >= rounds):
            row.stop = "turn_limit"
            return False
        row.pending = ([*calls, *errors])[: self.cfg.max_parallel_calls]
        return True

    def _answer_calls(self, rows: list[Conversation], budget: int, stats: TurnStats) -> None:
        """Run the pending calls of ``rows`` together; append each row's tool messages, or end it at the budget."""
        items = [(row, item) for row in rows for item in row.pending]
        requests = [ToolRequest(item, row.tools_kwargs) for row, item in items if not isinstance(item, str)]
        ran = iter(self.tools.run(requests) if requests else [])
        # A block that did not parse (a str: its message) goes back to the model without running anything.
        results = iter([ToolResult(item, "parse", 0.0) if isinstance(item, str) else next(ran) for _, item in items])
        for row in rows:
            messages = []
            for item in row.pending:
                result = next(results)
                stats.record("" if isinstance(item, str) else item.name, result)
                messages.append({"role": "tool", "content": valid_utf8(result.text)})
            row.calls += len(messages)
            row.pending = []
            piece = self.tool_turn_ids(messages)
            if len(row.response) + len(piece) >= budget:  # no room for the next turn's first token
                row.stop = "length"
                continue
            row.add(piece, model=False)
            row.messages.extend(messages)
            row.tool_rounds += 1
            row.turn_start = len(row.response)

    def tool_turn_ids(self, messages: list[dict]) -> list[int]:
        """The tokens between an assistant turn's end-of-turn token and the next turn: what the chat template
        renders after the turn, the tool ``messages``, and the next assistant header.

        A tool's output is text whatever it holds: it is made valid UTF-8 (a lone surrogate stops the
        tokenizer), and the text of an added token in it (``<|im_end|>``, ``<|im_start|>``: a forged turn
        boundary) becomes the tokens of its characters, not that token; the template's own tokens stay."""
        shown = [{**message, "content": self._placeholders(valid_utf8(message["content"]))} for message in messages]
        opened = self._render([*_TURN, *shown], add_generation_prompt=True)
        if not opened.startswith(self._closed):
            raise ValueError(
                "multi_turn: the chat template renders a conversation differently once tool messages follow it; "
                "dsrl appends tool outputs to the tokens generated so far and needs a template that only appends"
            )
        # Odd parts are the placeholders' numbers; without any, one part: the whole text, encoded as ever.
        parts = _LITERAL.split(self._after_turn + opened[len(self._closed) :])
        ids: list[int] = []
        for i, part in enumerate(parts):
            ids += self._literal_ids[int(part)] if i % 2 else self.tokenizer.encode(part, add_special_tokens=False)
        return ids

    def _placeholders(self, text: str) -> str:
        """``text`` with each of ``_literals`` in it replaced by its ``_LITERAL`` placeholder."""
        return self._literal_pattern.sub(lambda match: f"\x00dsrl-literal-{self._literal_index[match[0]]}\x00", text)

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
        )

    def _output(self, rows: list[Conversation], budget: int) -> RolloutOutput:
        return RolloutOutput(
            right_pad([row.response for row in rows], budget, self.pad_token_id, torch.long),
            right_pad([row.mask for row in rows], budget, 0, torch.long),
            right_pad([row.log_probs for row in rows], budget, 0.0, torch.float32),
            finish_reasons=["length" if row.stop == "length" else "stop" for row in rows],
            attention_mask=right_pad([[1] * len(row.response) for row in rows], budget, 0, torch.long),
            conversations=[
                {"messages": row.messages, "num_turns": row.turns, "num_tool_calls": row.calls, "stop": row.stop}
                for row in rows
            ],
        )


def valid_utf8(text: str) -> str:
    """``text`` as valid UTF-8: a lone surrogate (a JSON ``\\ud800`` a tool echoed back, a file name decoded with
    surrogateescape) becomes ``?``."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _text_ids(tokenizer, text: str, added_ids: set[int]) -> list[int]:
    """The ids of ``text`` read as ordinary characters, not as the added token it spells: split as a special
    token's text (``<|``, ``im``, ``_end``, ``|>``), else one character at a time (an added token not marked
    special, e.g. ``<tool_call>``, is matched even then)."""
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    if len(text) == 1 or added_ids.isdisjoint(ids):
        return ids
    return [i for char in text for i in tokenizer.encode(char, add_special_tokens=False)]
