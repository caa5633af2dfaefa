"""``python -m dsrl ...`` (and ``deepspeed --module dsrl ...``): the ``dsrl-train`` command."""

from dsrl.commands.train import run

run()
