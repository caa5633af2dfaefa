"""The process and its world: launcher variables, torch.distributed, signals, phases, seeding, redaction.

Imports nothing, so that config and worker processes can import its modules without torch."""
