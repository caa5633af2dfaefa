"""What the trainer tests share: a Trainer for a shipped recipe on the tiny model and the digits reward, a run
of it with the parameters before and after, and the dynamic-sampling settings with a reward whose groups some
rounds drop."""

from __future__ import annotations

import torch

from tests.conftest import recipe


def trainer_for(name, tiny_model_dir, data, ds_test_config, out, *overrides):
    """A Trainer for configs/<name>.yaml (CPU overlay) on the tiny model and the digits reward, 2 steps, checkpoints in
    ``out``."""
    from dsrl.config import load_and_validate
    from dsrl.trainer.loop import Trainer

    ds_config = ds_test_config("zero3_offload")
    cfg, _ = load_and_validate(
        recipe(name),
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"custom_reward_function.path={data / 'digits_reward.py'}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_config}",
            "actor_rollout_ref.actor.optim.weight_decay=0",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={out}",
            *overrides,
        ],
        world_size=1,
    )
    return Trainer(cfg)


def run_config(name, tiny_model_dir, data, ds_test_config, out, *overrides):
    from dsrl.engines.weight_sync import iter_full_parameters

    trainer = trainer_for(name, tiny_model_dir, data, ds_test_config, out, *overrides)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))

    def snapshot(module):
        return {name: tensor.clone() for name, tensor in iter_full_parameters(module)}

    actor_before = snapshot(trainer.actor.module)
    critic_before = snapshot(trainer.critic.module) if trainer.critic else None
    trainer.fit()
    actor_after = snapshot(trainer.actor.module)
    critic_after = snapshot(trainer.critic.module) if trainer.critic else None
    return trainer, logged, (actor_before, actor_after), (critic_before, critic_after)


def changed_fraction(before, after):
    return sum(not torch.equal(before[k], after[k]) for k in before) / len(before)


PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    acc = 1.0 if int(ground_truth) % 2 == 0 else float(digits % 2)
    return {"score": digits / 4.0, "acc": acc}
"""

FILTERING = [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=0",
]
