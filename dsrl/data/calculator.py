"""The calculator task: products of two 3-digit numbers, where a tool call is the way to the answer.

A prompt is one user message ``"What is a*b?"`` with ``a, b`` in ``100..999``; the answer is
``str(a * b)`` (5-6 digits), scored by ``dsrl.rewards.calculator`` (data_source ``"calculator"``):
the last integer after the last tool output. A tiny model cannot multiply, but it can call the
built-in ``calculator`` tool with ``{"expression": "a*b"}`` and copy the result, so the task tells
multi-turn rollouts (``actor_rollout_ref.rollout.multi_turn``) from single-turn ones.

As in ``dsrl.data.arithmetic``, the 810,000 problems are split once, independently of any seed,
into a test pool (1,000 problems) and a train pool (the rest); ``seed`` only picks which problems
of a pool a split holds, so no seed puts a test problem in a training set.
"""

import random

from dsrl.data import arithmetic

DATA_SOURCE = "calculator"
LOW, HIGH = 100, 999
NUM_PROBLEMS = (HIGH - LOW + 1) ** 2
TEST_POOL_SIZE = 1000
DEFAULT_TRAIN_SIZE = 5000
DEFAULT_TEST_SIZE = 200
DEFAULT_SEED = 0


def _pair(index: int) -> tuple[int, int]:
    a, b = divmod(index, HIGH - LOW + 1)
    return LOW + a, LOW + b


def _test_pool() -> list[int]:
    return random.Random("dsrl-calculator-pools").sample(range(NUM_PROBLEMS), TEST_POOL_SIZE)


def problems(split: str, size: int, seed: int) -> list[tuple[int, int]]:
    """``size`` distinct operand pairs ``(a, b)`` of the split's pool, in a seeded order."""
    test_pool = _test_pool()
    pool_size = {"test": TEST_POOL_SIZE, "train": NUM_PROBLEMS - TEST_POOL_SIZE}.get(split)
    if pool_size is None:
        raise ValueError(f"split={split!r}: must be 'train' or 'test'")
    if not 0 < size <= pool_size:
        raise ValueError(
            f"{split} size={size}: the calculator {split} pool holds {pool_size} problems; choose 1..{pool_size}"
        )
    rng = random.Random(f"dsrl-calculator/{split}/{seed}")
    if split == "test":
        return [_pair(i) for i in rng.sample(test_pool, size)]
    # Rejection sampling: the test pool is 0.1% of the problems, so drawing more than `size` is rarely needed.
    excluded, picked = set(test_pool), []
    for index in rng.sample(range(NUM_PROBLEMS), min(NUM_PROBLEMS, size + TEST_POOL_SIZE)):
        if index not in excluded:
            picked.append(_pair(index))
            if len(picked) == size:
                break
    return picked


def expression(a: int, b: int) -> str:
    """What a call to the calculator tool evaluates for the problem."""
    return f"{a}*{b}"


def question(a: int, b: int) -> str:
    """The user message of a problem."""
    return f"What is {expression(a, b)}?"


def answer(a: int, b: int) -> str:
    """The ground truth: the product as an integer string."""
    return str(a * b)


def rows(split: str, size: int, seed: int) -> list[dict]:
    """verl-schema rows (data_source, prompt, ability, reward_model, extra_info) of a split.

    extra_info has no ``tools_kwargs``: the calculator needs no per-row arguments, and parquet cannot store
    the empty struct ``{}``; a missing ``tools_kwargs`` means ``{}`` (as verl's dataset reads it)."""
    return arithmetic.verl_rows(split, problems(split, size, seed), DATA_SOURCE, question, answer)
