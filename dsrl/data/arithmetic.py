"""The synthetic arithmetic task: two-number addition, offline and deterministic.

A prompt is one user message ``"a+b="`` with ``a, b`` in ``0..99``; the answer is ``str(a + b)``
(1-3 characters), scored by ``dsrl.rewards.arithmetic`` (data_source ``"arithmetic"``). Short
answers keep generation cheap: with a character tokenizer a response is at most 4 tokens
including the end-of-turn token.

The 10,000 problems are split once, by a fixed permutation that does not depend on any seed, into
a test pool (1,000) and a train pool (9,000); ``seed`` only picks which problems of a pool a split
holds. So no seed ever puts a test problem in a training set, and ``scripts/make_tiny_model.py``
can warm-start on the train pool without touching the validation problems.
"""

import random

DATA_SOURCE = "arithmetic"
MAX_OPERAND = 99
TEST_POOL_SIZE = 1000
TRAIN_POOL_SIZE = (MAX_OPERAND + 1) ** 2 - TEST_POOL_SIZE
# What scripts/prepare_data.py writes by default; make_tiny_model.py reports accuracy on that test split.
DEFAULT_TRAIN_SIZE = 5000
DEFAULT_TEST_SIZE = 200
DEFAULT_SEED = 0


def operand_pool(split: str, max_operand: int, test_pool_size: int, key: str) -> list[tuple[int, int]]:
    """The ``split`` pool of the pairs ``(a, b)`` in ``0..max_operand``: a fixed permutation (``key`` seeds it)
    puts the first ``test_pool_size`` in the test pool and the rest in the train pool."""
    everything = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(key).shuffle(everything)
    if split == "test":
        return everything[:test_pool_size]
    if split == "train":
        return everything[test_pool_size:]
    raise ValueError(f"split={split!r}: must be 'train' or 'test'")


def _pool(split: str) -> list[tuple[int, int]]:
    return operand_pool(split, MAX_OPERAND, TEST_POOL_SIZE, "dsrl-arithmetic-pools")


def problems(split: str, size: int, seed: int) -> list[tuple[int, int]]:
    """``size`` distinct operand pairs ``(a, b)`` of the split's pool, in a seeded order."""
    pool = _pool(split)
    if not 0 < size <= len(pool):
        raise ValueError(
            f"{split} size={size}: the arithmetic {split} pool holds {len(pool)} problems; choose 1..{len(pool)}"
        )
    return random.Random(f"dsrl-arithmetic/{split}/{seed}").sample(pool, size)


def question(a: int, b: int) -> str:
    """The user message of a problem."""
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    """The exact expected response (and the ground truth)."""
    return str(a + b)


def rows(split: str, size: int, seed: int) -> list[dict]:
    """verl-schema rows (data_source, prompt, ability, reward_model, extra_info) of a split."""
    return verl_rows(split, problems(split, size, seed), DATA_SOURCE, question, answer)


def verl_rows(split: str, pairs, data_source: str, question, answer) -> list[dict]:
    """verl-schema rows of the problems ``pairs`` (a, b): ``question(a, b)`` asked, ``answer(a, b)`` the ground
    truth."""
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": answer(a, b)},
            "extra_info": {"split": split, "index": index},
        }
        for index, (a, b) in enumerate(pairs)
    ]
