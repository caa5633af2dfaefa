"""Seeding of this process's global generators, without importing transformers for it (``transformers.set_seed``
seeds the same three; importing transformers' top level costs a run seconds of start-up)."""

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python's ``random``, numpy's global generator and torch's (CPU and every accelerator device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
