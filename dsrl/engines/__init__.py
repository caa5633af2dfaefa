"""DeepSpeed engines: the actor and critic train; the reference, the teacher and the reward model only score."""

from dsrl.engines.actor import ActorEngine
from dsrl.engines.critic import CriticEngine
from dsrl.engines.deepspeed_setup import init_distributed
from dsrl.engines.reference import AdapterOffReference, ReferenceEngine, teacher_engine
from dsrl.engines.reward_model import RewardModelEngine

__all__ = [
    "ActorEngine",
    "AdapterOffReference",
    "CriticEngine",
    "ReferenceEngine",
    "RewardModelEngine",
    "init_distributed",
    "teacher_engine",
]
