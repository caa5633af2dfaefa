"""Rollout engines: the protocol (``base``), transformers ``generate`` (``hf``) and the weight
stream from the ZeRO actor (``weight_sync``)."""

from dsrl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from dsrl.rollout.hf import HFRollout
from dsrl.rollout.weight_sync import iter_full_parameters

__all__ = ["HFRollout", "RolloutEngine", "RolloutOutput", "SamplingParams", "iter_full_parameters"]
