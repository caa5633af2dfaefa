"""Prompts and checks shared by the rollout tests (hf and vLLM)."""

from __future__ import annotations

import torch

P = 6
PROMPT_LENGTHS = (6, 4, 2)


def prompts(lengths=PROMPT_LENGTHS, width=P, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded prompt ids and mask, ``[len(lengths), width]``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    return torch.randint(3, 100, (len(lengths), width), generator=g) * mask, mask


def sampled_batch(rollout, sampling):
    """A ``Batch`` of ``rollout``'s responses to two prompts (one left-padded), ``sampling.n`` each."""
    from dsrl.data.batch import Batch
    from dsrl.trainer.batches import with_responses

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    empty = torch.zeros(2, 0, dtype=torch.long)
    prompts = Batch(ids, mask, empty, empty, torch.arange(2))
    return with_responses(prompts, rollout.generate(ids, mask, sampling), sampling.n)


def assert_eos_and_length_handling(out, eos_token_ids, pad_token_id: int, max_tokens: int) -> None:
    """The rollout contract for how a response ends: the mask is one run from the start; a 'stop'
    response ends at its first EOS (included in the mask) and is padded after it; a 'length'
    response fills ``max_tokens`` without an EOS; both endings occur."""
    eos = torch.tensor(eos_token_ids)
    for ids, mask, reason in zip(out.response_ids, out.response_mask, out.finish_reasons, strict=True):
        valid = int(mask.sum())
        assert (mask[:valid] == 1).all() and (mask[valid:] == 0).all()
        is_eos = torch.isin(ids[:valid], eos)
        if reason == "stop":
            assert is_eos[-1] and not is_eos[:-1].any()
            assert (ids[valid:] == pad_token_id).all()
        else:
            assert reason == "length" and valid == max_tokens and not is_eos.any()
    assert set(out.finish_reasons) == {"stop", "length"}


def vllm_logprob_gap(model_dir, port: int, *flags: str) -> float:
    """Largest |vLLM - transformers| log-prob of sampled tokens for ``model_dir``, measured by
    ``tests/vllm/logprob_check.py`` in a process of its own (one vLLM engine per process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    result = subprocess.run(
        [sys.executable, str(repo / "tests" / "vllm" / "logprob_check.py"), str(model_dir), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("MAXDIFF")]
    return float(line.split()[1])
