"""The weights' checkpoint format (``dsrl.engines.weight_sync``): what a push and an export carry is what
``save_pretrained`` writes to disk, name for name and shape for shape (a Qwen3-MoE's fused expert tensors one tensor
per expert and projection again), and ``CheckpointTargets`` writes such a stream back into a model's own
parameters exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dsrl.checkpoint.save import export_hf_model
from dsrl.engines.weight_sync import CheckpointTargets, checkpoint_format, iter_full_parameters


def on_disk(folder: Path) -> dict[str, tuple[int, ...]]:
    """The names and shapes of a model directory's safetensors files."""
    shapes = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})  # noqa: SIM118
    return shapes


@pytest.fixture(params=["dense", "moe"])
def model_dir(request, tiny_model_dir, moe_model_dir) -> Path:
    return {"dense": tiny_model_dir, "moe": moe_model_dir}[request.param]


def test_the_pushed_names_and_shapes_are_save_pretrained_s(model_dir, moe_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.save_pretrained(tmp_path)
    pushed = {name: tuple(t.shape) for name, t in checkpoint_format(model, iter_full_parameters(model))}
    assert pushed == on_disk(tmp_path) == on_disk(model_dir)
    own = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if model_dir == moe_model_dir:  # 4 layers x 8 experts x (gate, up, down) for 4 x 2 fused tensors
        assert len(pushed) == len(own) - 8 + 4 * 8 * 3
        assert "model.layers.0.mlp.experts.7.up_proj.weight" in pushed
    else:
        assert pushed == own


def test_a_checkpoint_format_stream_lands_in_the_models_own_parameters_exactly(model_dir):
    source, target = (AutoModelForCausalLM.from_pretrained(model_dir) for _ in range(2))
    with torch.no_grad():
        for param in source.parameters():
            param.add_(torch.randn_like(param))
    targets = CheckpointTargets(target)
    stream = list(checkpoint_format(source, ((name, p.detach().clone()) for name, p in source.named_parameters())))
    assert {name for name, _ in stream} == targets.names()
    for name, tensor in stream:
        targets.write(name, tensor)
    for (name, expected), (_, got) in zip(source.named_parameters(), target.named_parameters(), strict=True):
        assert torch.equal(got, expected), name


def test_a_tensor_of_another_shape_is_refused_by_name(moe_model_dir):
    targets = CheckpointTargets(AutoModelForCausalLM.from_pretrained(moe_model_dir))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    with pytest.raises(ValueError, match=f"{name} has shape \\(1, 2\\)"):
        targets.write(name, torch.zeros(1, 2))


def test_an_exported_mixture_of_experts_is_save_pretrained_s_and_loads_back_equal(moe_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(moe_model_dir)
    out = export_hf_model(model, AutoTokenizer.from_pretrained(moe_model_dir), tmp_path / "export")
    assert on_disk(out) == on_disk(moe_model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, expected), (_, got) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(got, expected), name


def test_a_conversion_the_rollout_cannot_write_back_is_refused_with_the_fix(moe_model_dir, monkeypatch):
    """A checkpoint tensor made of two parameters (no slice of one) has no place to be written in place."""
    from dsrl.engines import weight_sync

    def joined(model, group):
        return {"joined": torch.cat([t.reshape(-1) for t in group.values()])} if len(group) > 1 else group

    monkeypatch.setattr(weight_sync, "revert_weight_conversion", joined)
    with pytest.raises(ValueError, match="checkpoint tensor joined is not a slice of one of its parameters .*; fix: "):
        CheckpointTargets(AutoModelForCausalLM.from_pretrained(moe_model_dir))
