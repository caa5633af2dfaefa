"""The reward model: a frozen sequence-classification model under DeepSpeed that scores whole sequences, forward only.

Built from ``reward_model.model.path`` (an ``AutoModelForSequenceClassification`` checkpoint with one label, its head
named ``score``, as Llama, Qwen, Mistral and Gemma reward models and OpenRLHF's have it) with
``reward_model.deepspeed_config`` (default ``zero3_offload_inference``). The score of a sequence is the head at its last
token. transformers' own forward pools at the last token that is not the pad token, which misreads a response that
ends in the pad token's id; this engine reads the head at the last attended position instead, and only there.
What the sequences hold (the policy's tokens, or the conversation re-tokenised with the reward model's own chat
template) is ``dsrl.rewards.model_inputs``'.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import deepspeed
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from dsrl.data.batch import left_pad
from dsrl.engines.deepspeed_setup import DTYPES, build_ds_config, init_distributed, load_pretrained
from dsrl.engines.forward import PassTally
from dsrl.runtime.distributed import accelerator_device, all_reduce


class LastTokenScore(nn.Module):
    """A sequence-classification model whose head runs at the last column only (left-padded inputs end there)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """``[b, L]`` left-padded inputs -> float32 scores ``[b]``."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.model.score(hidden[:, -1]).squeeze(-1).float()


def last_token_inputs(sequences: list[list[int]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """``LastTokenScore``'s inputs for token sequences: left-padded ids, their mask, and positions counted from each
    sequence's first token."""
    ids, mask = left_pad(sequences, pad_token_id)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def score_head_problem(model: nn.Module, path: str) -> str | None:
    """Why ``model`` (loaded from ``path``) cannot score: no ``score`` head, or not one label; None when it can."""
    labels = model.config.num_labels
    head = getattr(model, "score", None)
    if isinstance(head, nn.Linear) and labels == 1:
        return None
    has = f"a score head with {labels} labels" if isinstance(head, nn.Linear) else "no score head"
    return (
        f"reward_model.model.path={path}: {type(model).__name__} has {has}; dsrl reads one score per sequence from a "
        "head named score with one label (Llama/Qwen/Mistral-style reward models). Fix: point it at such a checkpoint"
    )


def micro_batches(lengths: list[int], *, micro_batch_size: int, max_token_len: int | None) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by length (so each pads little), then ``micro_batch_size`` rows
    at a time, or with ``max_token_len`` as many as keep ``rows x longest`` within it."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if max_token_len is None:
        return [order[s : s + micro_batch_size] for s in range(0, len(order), micro_batch_size)]
    parts: list[list[int]] = []
    for i in order:  # ascending: the newest row is the longest of its part
        if parts and (len(parts[-1]) + 1) * lengths[i] <= max_token_len:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


class RewardModelEngine:
    """``score(sequences) -> [len(sequences)]`` float32 scores; never trains. Collective: every rank calls it the
    same number of times (with any number of rows, none included)."""

    def __init__(self, cfg: Any):
        init_distributed()
        self.cfg = cfg
        self.tallies: defaultdict[str, PassTally] = defaultdict(PassTally)  # the trainer takes them each step
        rm, model_cfg = cfg.reward_model, cfg.actor_rollout_ref.model
        self.ds_config = build_ds_config(
            rm.deepspeed_config,
            key="reward_model.deepspeed_config",
            micro_batch_size_per_gpu=rm.micro_batch_size_per_gpu,
            gradient_accumulation_steps=1,
            dtype=model_cfg.dtype,
            prefix="reward_model",
        )
        module = load_pretrained(
            self.ds_config,
            lambda: AutoModelForSequenceClassification.from_pretrained(
                rm.model.path, dtype=DTYPES[model_cfg.dtype], trust_remote_code=rm.model.trust_remote_code
            ),
        )
        problem = score_head_problem(module, rm.model.path)
        if problem is not None:
            raise ValueError(problem)
        module.requires_grad_(False)
        self.engine, *_ = deepspeed.initialize(model=LastTokenScore(module), config=self.ds_config)
        self.engine.eval()

    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """The score of each token sequence (each at least one token) at its last token, in order, on the CPU."""
        rm = self.cfg.reward_model
        parts = micro_batches(
            [len(s) for s in sequences],
            micro_batch_size=rm.micro_batch_size_per_gpu,
            max_token_len=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
        )
        # ZeRO-3 gathers every layer collectively in each forward: every rank runs as many (a rank short of parts
        # runs one token for each)
        count = int(all_reduce(torch.tensor(float(len(parts))), "max"))
        scores = torch.zeros(len(sequences), dtype=torch.float32)
        device, tally = accelerator_device(), self.tallies["reward_model"]
        with torch.no_grad():
            for k in range(count):
                rows = parts[k] if k < len(parts) else []
                inputs = last_token_inputs([sequences[i] for i in rows] if rows else [[0]])
                out = self.engine(**{name: tensor.to(device) for name, tensor in inputs.items()})
                if rows:
                    scores[rows] = out.cpu()
                    tally.add(inputs["input_ids"].numel(), int(inputs["attention_mask"].sum()))
        return scores
