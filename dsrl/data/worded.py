"""The worded-sums task: two-number addition asked in words, for pretrained chat models.

A prompt is one user message ``"What is a+b? Answer with just the number."`` with ``a, b`` in ``0..19``;
the answer is ``str(a + b)``, scored by ``dsrl.rewards.worded`` (data_source ``"worded_arithmetic"``): the
last integer of the response. A small instruct model (SmolLM2-135M-Instruct) answers the arithmetic task's
bare ``"a+b="`` in prose and scores nothing there; asked in words it answers briefly, right on about half
of these problems (one-digit sums mostly, teens less often): groups of samples with reward spread, which
GRPO learns from.

As in ``dsrl.data.arithmetic``, the 400 problems are split once, by a fixed permutation, into a test
pool (100) and a train pool (300); ``seed`` only orders a split's problems. The train split repeats the
pool's problems when asked for more than it holds (every problem once before any twice).
"""

import random

from dsrl.data import arithmetic

DATA_SOURCE = "worded_arithmetic"
MAX_OPERAND = 19
TEST_POOL_SIZE = 100
TRAIN_POOL_SIZE = (MAX_OPERAND + 1) ** 2 - TEST_POOL_SIZE
DEFAULT_TRAIN_SIZE = 1200
DEFAULT_TEST_SIZE = TEST_POOL_SIZE
DEFAULT_SEED = 0


def _pool(split: str) -> list[tuple[int, int]]:
    return arithmetic.operand_pool(split, MAX_OPERAND, TEST_POOL_SIZE, "dsrl-worded-pools")


def problems(split: str, size: int, seed: int) -> list[tuple[int, int]]:
    """``size`` operand pairs ``(a, b)`` of the split's pool in a seeded order: the test split distinct ones
    (at most its pool), the train split passes over its pool, each in a new order."""
    pool = _pool(split)
    if size <= 0 or (split == "test" and size > len(pool)):
        most = len(pool) if split == "test" else "any number"
        raise ValueError(f"{split} size={size}: the worded {split} pool holds {len(pool)} problems; choose 1..{most}")
    rng = random.Random(f"dsrl-worded/{split}/{seed}")
    picked: list[tuple[int, int]] = []
    while len(picked) < size:
        picked += rng.sample(pool, len(pool))
    return picked[:size]


def question(a: int, b: int) -> str:
    """The user message of a problem."""
    return f"What is {a}+{b}? Answer with just the number."


def answer(a: int, b: int) -> str:
    """The ground truth: the sum as an integer string."""
    return str(a + b)


def rows(split: str, size: int, seed: int) -> list[dict]:
    """verl-schema rows (data_source, prompt, ability, reward_model, extra_info) of a split."""
    return arithmetic.verl_rows(split, problems(split, size, seed), DATA_SOURCE, question, answer)
