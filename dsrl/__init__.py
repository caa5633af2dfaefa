"""dsrl: DeepSpeed ZeRO-based RL post-training for LLMs."""
