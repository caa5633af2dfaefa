"""``python -m dsrl ...`` (and ``deepspeed --module dsrl ...``): the ``dsrl-train`` command."""

from dsrl.cli import run

run()
