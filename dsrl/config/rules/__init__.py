"""The rules a loaded config must meet, one module per concern. Each group of rules is a function
``<group>_rules(cfg, ..., need)`` that ``dsrl.config.validate`` runs in turn; it records each violation with
``need(ok, key, rule, fix)`` (typed ``need.Need``, beside the questions several groups ask of a config).

- ``geometry``: the batch sizes against the world size, and each role's DeepSpeed JSON.
- ``algorithm``: the estimator and its options, the losses and their parameters, KL, the optimizers, group filtering.
- ``rollout``: the engine and vLLM's keys, rollout correction, the mismatch stop, multi-turn, LoRA.
- ``paths``: the data, reward and model files, and the run folder.
- ``run``: the reward workers, the reward manager, and the trainer.
"""
