"""DeepSpeed engines: the actor and critic train, the reference only scores."""

from dsrl.engines.actor import ActorEngine
from dsrl.engines.critic import CriticEngine
from dsrl.engines.deepspeed_setup import init_distributed
from dsrl.engines.reference import AdapterOffReference, ReferenceEngine

__all__ = ["ActorEngine", "AdapterOffReference", "CriticEngine", "ReferenceEngine", "init_distributed"]
