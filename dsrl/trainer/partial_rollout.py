"""Partial rollout inside colocation: ``trainer.v1.trainer_mode: colocate_async`` (verl V1's names and rules).

In a synchronous step every rank waits for the longest response of the batch. Here each step keeps more prompt
groups in flight than it trains on, stops generating once ``data.train_batch_size`` groups are complete, and
carries the unfinished responses, tokens and behaviour log-probs so far, into the next step, where they go on
under the new weights. Each token keeps the policy version that sampled it (``global_step`` before the step's
update), so a response may span versions; the behaviour log-probs are per token, which is what rollout correction
(``algorithm.rollout_correction``, token level) and bypass mode weigh against.

The pool. Each rank holds its own groups (``InFlight.groups``), ``per_rank`` of them after the top-up at the start
of a step: ``(1 + num_warmup_batches) * train_batch_size / world_size`` (verl adds the warm-up batches once; the
pool then stays that full because every step admits what it trained on or dropped). The prompts come from the
sampler in whole batches, every rank drawing the same ones; those not admitted yet wait in ``reserve`` (the same
on every rank), so the sampler's position stays one number. Admission order gives each group its id, unique over
the run and the same on every rank.

The decision. After each chunk of ``trainer.v1.colocate_async.chunk_tokens`` tokens (``generate_until``), one
``all_gather_object`` of every rank's complete groups (admission version, id) tells every rank the same global
list: generation stops when it holds ``train_batch_size`` groups and (strategy ``wait``) no group at the staleness
threshold is still running. The step trains on the oldest complete groups by (admission version, id): kept group
``i`` goes to rank ``i // (train_batch_size / world_size)`` (``dynamic_sampling.transfer_plan``). One collective per
chunk, none per request; on the vLLM rollout every rank of a tensor-parallel group sees the same outputs.

Staleness. A group admitted at version ``a`` spans ``v - a + 1`` versions when trained at version ``v`` (verl's
count); with ``max_off_policy_threshold`` set, strategy ``drop`` evicts a group before the step in which it would
exceed it (verl evicts it once it is complete: the same groups never train, here without generating their rest)
and ``wait`` holds the step until every group at the threshold is complete. Evicted groups are replaced from the
sampler. Metrics: verl's ``training/off_policy/trajectory_spans|trajectory_staleness|trajectory_staleness_worst``
(mean, max, min over the trained responses) and ``evicted_samples``, plus the pool's sizes.

Multi-turn. A response holds its conversation (``dsrl.rollout.multi_turn.Conversation``), which
``MultiTurnRollout.generate_until`` continues turn by turn, tool calls run between chunks; a conversation may stop
mid-turn or between turns and go on in the next step.

Dynamic sampling. ``judge`` scores each group once complete (through the trainer); an uninformative group leaves
the pool, and the trainer generates on, filling the pool again when nothing is left to generate.

Resume. ``state_dict`` holds this rank's groups (tokens, float32 log-probs, versions and conversation of every
response), the reserve and the next id, as tensors a checkpoint loads as data; the sampling seed of a step comes from
``trainer.seed``, the step and the rank, so a resumed run generates exactly what the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsrl.data.batch import Batch, right_pad
from dsrl.rollout.base import PartialRow, RolloutEngine, RolloutOutput, SamplingParams
from dsrl.rollout.multi_turn import Conversation
from dsrl.trainer.balance import take_global_rows
from dsrl.trainer.batches import prompt_batch, with_responses
from dsrl.trainer.dynamic_sampling import KEPT, transfer_plan

OFF_POLICY = "training/off_policy"


@dataclass
class Response:
    """One response in flight: its tokens so far, their log-probs under the sampling policy and its versions."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    conversation: Conversation | None = None  # multi-turn: its turns and tool outputs (tokens is its response)


@dataclass
class Group:
    """The ``n`` responses to one prompt: ``record`` is the prompt's row in the training data, ``admitted`` the
    policy version at which it joined the pool."""

    group_id: int
    record: int
    admitted: int
    responses: list[Response]
    kept: bool | None = None  # dynamic sampling: True once judged informative (the uninformative leave the pool)

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)


@dataclass
class InFlight:
    """This rank's groups in flight and the shared admission state (module docstring)."""

    batch_size: int  # data.train_batch_size: groups a step trains on, over all ranks
    pool_size: int  # groups in flight over all ranks after the top-up
    n: int  # responses per group
    threshold: int | None  # max_off_policy_threshold: versions a trained group may span; None = no bound
    strategy: str  # max_off_policy_strategy: drop | wait
    groups: list[Group] = field(default_factory=list)
    reserve: list[int] = field(default_factory=list)  # drawn prompts not admitted yet (the same on every rank)
    next_group_id: int = 0

    def __post_init__(self):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()

    # ---- admission ------------------------------------------------------------------------------

    def refill(self, version: int, draw: Callable[[], list[int]]) -> dict[str, float]:
        """Before a step at ``version``: strategy ``drop`` evicts the groups that would span more than ``threshold``
        versions, then every rank's pool is filled to ``pool_size / world_size`` groups from the reserve, drawing
        whole sampler batches (``draw``, the same on every rank) as needed. Collective."""
        evicted = 0
        if self.threshold is not None and self.strategy == "drop":
            kept = [g for g in self.groups if version - g.admitted + 1 <= self.threshold]
            evicted, self.groups = len(self.groups) - len(kept), kept
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, (len(self.groups), evicted))
        wanted = [self.pool_size // self.world - size for size, _ in everyone]
        while len(self.reserve) < sum(wanted):
            self.reserve += draw()
        first = sum(wanted[: self.rank])
        for j, record in enumerate(self.reserve[first : first + wanted[self.rank]]):
            responses = [Response() for _ in range(self.n)]
            self.groups.append(Group(self.next_group_id + first + j, record, version, responses))
        self.reserve = self.reserve[sum(wanted) :]
        self.next_group_id += sum(wanted)
        carried = sum(size for size, _ in everyone)
        return {
            f"{OFF_POLICY}/evicted_samples": float(sum(e for _, e in everyone)),
            f"{OFF_POLICY}/groups_carried": float(carried),  # in flight from earlier steps
            f"{OFF_POLICY}/groups_admitted": float(sum(wanted)),
        }

    # ---- generation -----------------------------------------------------------------------------

    def generate(
        self,
        rollout: RolloutEngine,
        prompts: Callable[[list[int]], list[tuple[int, ...]]],
        sampling: SamplingParams,
        *,
        version: int,
        chunk_tokens: int,
        conversation_of: Callable[[int], Conversation] | None = None,
    ) -> int:
        """Continue every unfinished response (at most ``sampling.max_tokens`` tokens each) until enough groups are
        complete on all ranks; returns the chunks it took. ``prompts(records)``: the prompts' token ids;
        ``conversation_of(record)``: multi-turn, a new conversation of the prompt (``rollout`` is then a
        ``MultiTurnRollout``, its turns and tool calls going on across chunks). Collective (once per chunk)."""
        running = [(g, r) for g in self.groups for r in g.responses if not r.finished]
        chunks = 0

        def stop(finished: list[bool]) -> bool:
            nonlocal chunks
            chunks += 1
            done = {id(r) for (_, r), f in zip(running, finished, strict=True) if f}
            complete = [all(r.finished or id(r) in done for r in g.responses) for g in self.groups]
            waiting = self.strategy == "wait" and any(
                not c and self._at_threshold(g, version) for g, c in zip(self.groups, complete, strict=True)
            )
            everyone: list = [None] * self.world
            dist.all_gather_object(everyone, (sum(complete), waiting, not all(finished)))
            if not any(going for _, _, going in everyone):  # nothing left to generate anywhere
                return True
            return sum(c for c, _, _ in everyone) >= self.batch_size and not any(w for _, w, _ in everyone)

        sampling = sampling.replace(n=1)
        if conversation_of is not None:
            for g, r in running:
                r.conversation = r.conversation or conversation_of(g.record)
            talks = [r.conversation for _, r in running]
            before = [len(talk.response) for talk in talks]
            rollout.generate_until(talks, sampling, chunk_tokens=chunk_tokens, stop=stop)
            for (_, response), talk, start in zip(running, talks, before, strict=True):
                response.tokens, response.log_probs = list(talk.response), list(talk.log_probs)
                response.versions += [version] * (len(talk.response) - start)  # the tool outputs' too
                response.finished = talk.stop is not None
            return chunks
        tokens_of = prompts([g.record for g, _ in running]) if running else []
        rows = [
            PartialRow(p, tuple(r.tokens), sampling.max_tokens) for p, (_, r) in zip(tokens_of, running, strict=True)
        ]
        progress = rollout.generate_until(rows, sampling, chunk_tokens=chunk_tokens, stop=stop)
        for (_, response), p in zip(running, progress, strict=True):
            response.tokens += p.tokens
            response.log_probs += p.log_probs
            response.versions += [version] * len(p.tokens)
            response.finished = p.finished
        return chunks

    def judge(self, verdicts_of: Callable[[list[Group]], list[str]]) -> tuple[int, bool, list[str]]:
        """Dynamic sampling: ``verdicts_of`` judges this rank's newly complete groups (``dynamic_sampling``'s
        ``kept`` or a drop reason); the dropped leave the pool. Returns the informative complete groups and whether
        any response is unfinished, over all ranks, and this rank's verdicts. Collective."""
        fresh = [g for g in self.groups if g.complete and g.kept is None]
        verdicts = verdicts_of(fresh) if fresh else []
        for group, verdict in zip(fresh, verdicts, strict=True):
            group.kept = verdict == KEPT
        self.groups = [g for g in self.groups if g.kept is not False]
        everyone: list = [None] * self.world
        dist.all_gather_object(
            everyone, (sum(g.complete for g in self.groups), not all(g.complete for g in self.groups))
        )
        return sum(c for c, _ in everyone), any(going for _, going in everyone), verdicts

    def _at_threshold(self, group: Group, version: int) -> bool:
        """Trained at ``version``, ``group`` would span the most versions allowed (strategy ``wait`` holds for it)."""
        return self.threshold is not None and version - group.admitted + 1 >= self.threshold

    # ---- the step's batch -----------------------------------------------------------------------

    def take_batch(self, build: Callable[[list[Group]], Batch], version: int) -> tuple[Batch, dict[str, float]]:
        """This rank's share of the ``batch_size`` oldest complete groups of all ranks (``build``: their batch,
        ``batch_of``), and the spans and staleness of all of them (verl's metrics); they leave the pool. Collective."""
        complete = [(g.admitted, g.group_id, i) for i, g in enumerate(self.groups) if g.complete]
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, complete)
        order = sorted((admitted, gid, rank, i) for rank, part in enumerate(everyone) for admitted, gid, i in part)
        kept = [(0, rank, i) for _, _, rank, i in order[: self.batch_size]]
        shipped, width, rows = transfer_plan(kept, self.world, self.rank, self.n)
        mine = [self.groups[i] for _, i in shipped]
        metrics = self._version_metrics([r.versions for g in mine for r in g.responses], version)
        padding = (width - len(mine) * self.n) // self.n  # groups repeated to ship as many rows as every rank
        batch = build(mine + [mine[0] if mine else self.groups[0]] * padding)
        taken = {id(g) for g in mine}
        self.groups = [g for g in self.groups if id(g) not in taken]
        return take_global_rows(batch, rows), metrics

    def batch_of(self, groups: list[Group], records, prompt_pad: int, response_pad: int, max_tokens: int) -> Batch:
        """``groups`` as a batch of responses with their behaviour log-probs and versions (``records(rows)``: the
        prompts' records)."""
        prompts = prompt_batch(records([g.record for g in groups]), prompt_pad, first_group_id=0)
        prompts = prompts.replace(group_ids=torch.tensor([g.group_id for g in groups], dtype=torch.long))
        responses = [r for g in groups for r in g.responses]
        # response_mask: the model's tokens (a conversation's tool outputs are in its context only)
        masks = [[1] * len(r.tokens) if r.conversation is None else r.conversation.mask for r in responses]
        out = RolloutOutput(
            right_pad([r.tokens for r in responses], max_tokens, response_pad, torch.long),
            right_pad(masks, max_tokens, 0, torch.long),
            right_pad([r.log_probs for r in responses], max_tokens, 0.0, torch.float32),
            ["stop" if r.finished else "length" for r in responses],
        )
        if any(r.conversation is not None for r in responses):  # multi-turn: every response token in the context
            out.attention_mask = right_pad([[1] * len(r.tokens) for r in responses], max_tokens, 0, torch.long)
            out.conversations = [_turn_counts(r.conversation) for r in responses]
        versions = right_pad([r.versions for r in responses], max_tokens, 0, torch.long)
        return with_responses(prompts, out, self.n).replace(rollout_versions=versions)

    # ---- metrics and checkpoints ----------------------------------------------------------------

    def _version_metrics(self, versions: list[list[int]], version: int) -> dict[str, float]:
        """verl's spans and staleness over the trained responses of all ranks (``versions``: this rank's, the
        versions of each response's tokens). Collective."""
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, [(min(v), max(v)) for v in versions if v])
        pairs = torch.tensor([pair for part in everyone for pair in part], dtype=torch.float64).reshape(-1, 2)
        lowest, highest = pairs[:, 0], pairs[:, 1]
        metrics = {}
        for name, values in (
            ("trajectory_spans", highest - lowest + 1),
            ("trajectory_staleness", version - highest),
            ("trajectory_staleness_worst", version - lowest),
        ):
            for stat in ("mean", "max", "min"):
                metrics[f"{OFF_POLICY}/{name}/{stat}"] = float(getattr(values, stat)()) if len(values) else 0.0
        return metrics

    def state_dict(self) -> dict[str, object]:
        """This rank's pool as tensors (a checkpoint's ``in_flight/rank_<r>.pt``)."""
        responses = [r for g in self.groups for r in g.responses]
        judged = [[g.group_id, g.record, g.admitted, -1 if g.kept is None else int(g.kept)] for g in self.groups]
        return {
            "groups": torch.tensor(judged, dtype=torch.long).reshape(-1, 4),
            "lengths": torch.tensor([len(r.tokens) for r in responses], dtype=torch.long),
            "finished": torch.tensor([r.finished for r in responses], dtype=torch.bool),
            "tokens": torch.tensor([t for r in responses for t in r.tokens], dtype=torch.long),
            "log_probs": torch.tensor([x for r in responses for x in r.log_probs], dtype=torch.float32),
            "versions": torch.tensor([v for r in responses for v in r.versions], dtype=torch.long),
            "reserve": torch.tensor(self.reserve, dtype=torch.long),
            "next_group_id": self.next_group_id,
            "conversations": [None if r.conversation is None else _talk_state(r.conversation) for r in responses],
        }

    def load_state_dict(
        self, state: dict, records: int, conversation_of: Callable[[int], Conversation] | None = None
    ) -> None:
        """Put back what ``state_dict`` saved; ``records``: the rows of the training data; ``conversation_of``: as
        ``generate``'s, for a multi-turn run. Raises ``ValueError`` on a state whose parts do not fit together or the
        run (another ``rollout.n``, prompts the data does not have, conversations where the run has no tools)."""
        lengths = state["lengths"].tolist()
        rows = state["groups"][:, 1].tolist() + state["reserve"].tolist()
        sizes = {len(state[name]) for name in ("tokens", "log_probs", "versions")}
        if (
            len(state["finished"]) != len(lengths) or len(lengths) != self.n * len(state["groups"])
            or sizes != {sum(lengths)} or not all(0 <= row < records for row in rows)
        ):  # fmt: skip
            raise ValueError(
                f"the groups in flight do not fit this run ({len(state['groups'])} groups, {len(lengths)} responses "
                f"for n={self.n}, {sum(lengths)} tokens against {sorted(sizes)} log-probs and versions, prompt rows "
                f"up to {max(rows, default=0)} of {records})"
            )
        ends = torch.tensor(lengths).cumsum(0).tolist() if lengths else []
        cuts = [(end - length, end) for end, length in zip(ends, lengths, strict=True)]
        responses = [
            Response(
                state["tokens"][a:b].tolist(),
                state["log_probs"][a:b].tolist(),
                state["versions"][a:b].tolist(),
                bool(done),
            )
            for (a, b), done in zip(cuts, state["finished"].tolist(), strict=True)
        ]
        self.groups = [
            Group(gid, record, admitted, responses[i * self.n : (i + 1) * self.n], None if kept < 0 else bool(kept))
            for i, (gid, record, admitted, kept) in enumerate(state["groups"].tolist())
        ]
        self.reserve = state["reserve"].tolist()
        self.next_group_id = int(state["next_group_id"])
        talks = iter(state["conversations"])
        for group in self.groups:
            for response, saved in zip(group.responses, talks, strict=False):
                if (saved is None) != (conversation_of is None) and (saved is not None or response.tokens):
                    multi = "" if saved is not None else "out"
                    raise ValueError(
                        f"its responses were generated with{multi} multi-turn tool calls, unlike this run's"
                    )
                if saved is not None and conversation_of is not None:
                    response.conversation = _resumed_talk(conversation_of(group.record), response, saved)


TALK_FIELDS = ("messages", "turns", "tool_rounds", "calls", "stop", "turn_start")  # a checkpoint's, with the mask


def _talk_state(talk: Conversation) -> dict:
    """What a checkpoint holds of a conversation in flight beyond its response's tokens and log-probs (data only)."""
    return {"mask": torch.tensor(talk.mask, dtype=torch.long), **{name: getattr(talk, name) for name in TALK_FIELDS}}


def _resumed_talk(talk: Conversation, response: Response, saved: dict) -> Conversation:
    """``talk``, a new conversation of the prompt, as ``_talk_state`` saved it with ``response``."""
    talk.context += response.tokens
    talk.response, talk.log_probs, talk.mask = list(response.tokens), list(response.log_probs), saved["mask"].tolist()
    for name in TALK_FIELDS:
        setattr(talk, name, saved[name])
    return talk


def _turn_counts(talk: Conversation | None) -> dict:
    """A response's entry of ``RolloutOutput.conversations`` (none: it never ran, a padding row)."""
    if talk is None:
        return {"messages": [], "num_turns": 0, "num_tool_calls": 0, "stop": None}
    return {"messages": talk.messages, "num_turns": talk.turns, "num_tool_calls": talk.calls, "stop": talk.stop}
