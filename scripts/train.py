"""Train a policy with dsrl from a source checkout; the same as the installed ``dsrl-train`` command
(see ``dsrl/commands/train.py`` for the arguments and exit codes).

    python scripts/train.py configs/grpo.yaml configs/cpu.yaml data.train_batch_size=16   # one process, CPU
    deepspeed --num_gpus 8 scripts/train.py configs/opo.yaml                              # an 8-GPU node
    python scripts/train.py configs/otb.yaml --validate-only                              # print the resolved config
    python scripts/train.py configs/otb.yaml --validate-only --world-size 8               # ... checked for 8 ranks
    python scripts/train.py --show-keys actor_rollout_ref.actor.optim                     # keys: type, default, meaning
"""

from dsrl.commands.train import main, run  # noqa: F401 -- main: what tests and embedders call

if __name__ == "__main__":
    run()
