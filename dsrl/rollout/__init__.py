"""Rollout engines: the protocol (``base``), transformers ``generate`` (``hf``), vLLM (``vllm``), multi-turn
rollouts (``multi_turn``) and their tools (``tools``).

The engines are imported on first use (PEP 562), so that ``dsrl.rollout.tools`` imports no torch: its
worker processes and the config check load it."""

import importlib

_EXPORTS = {
    "RolloutEngine": "dsrl.rollout.base",
    "RolloutOutput": "dsrl.rollout.base",
    "SamplingParams": "dsrl.rollout.base",
    "HFRollout": "dsrl.rollout.hf",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsrl.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = ["HFRollout", "RolloutEngine", "RolloutOutput", "SamplingParams"]
