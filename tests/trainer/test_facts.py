"""The start-up summary's facts of the reward model and the distillation teacher (``dsrl.trainer.facts``): their
checkpoints, micro-batches and the distillation loss from the config, their DeepSpeed setup and parameter count from
their engines, as ``reward_model_facts`` and ``distillation_facts`` hand them to ``startup_summary``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from dsrl import config as C
from dsrl.tracking.console import startup_summary
from dsrl.trainer.facts import distillation_facts, reward_model_facts
from tests.conftest import recipe, stub_file_overrides, write_model_stub

TEACHER = "distillation.teacher_models.teacher_model.model_path"


def engine(params: int, **extra) -> SimpleNamespace:
    """A forward-only engine as the facts read it: its DeepSpeed config (zero3_offload_inference's ZeRO section) and
    a module of ``params`` parameters."""
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    module = torch.nn.Linear(params, 1, bias=False)
    return SimpleNamespace(ds_config={"zero_optimization": zero}, engine=SimpleNamespace(module=module), **extra)


def test_the_reward_model_and_the_teacher_facts_come_from_the_config_and_their_engines(tmp_path):
    rm = write_model_stub(tmp_path / "rm")
    (rm / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1})
    )
    teacher = write_model_stub(tmp_path / "teacher")
    overrides = [*stub_file_overrides(tmp_path), "reward_model.enable=true", f"reward_model.model.path={rm}",
                 "reward_model.micro_batch_size_per_gpu=4", "reward_model.max_length=100", "distillation.enabled=true",
                 f"{TEACHER}={teacher}", "distillation.distillation_loss.loss_mode=k1",
                 "distillation.distillation_loss.use_policy_gradient=true",
                 "distillation.distillation_loss.distillation_loss_coef=0.25",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=6"]  # fmt: skip
    cfg, _ = C.load_and_validate(recipe("grpo"), overrides, 1)
    judged = reward_model_facts(cfg, engine(12))
    assert judged == {"zero_stage": 3, "offload_params": True, "offload_optimizer": False, "dtype": "float32",
                      "params": 12, "path": str(rm), "micro_batch_size": 4, "max_token_len": None,
                      "max_length": 100}  # fmt: skip
    distill = distillation_facts(cfg, engine(24, sp=None))
    assert distill == {
        "teacher": {"zero_stage": 3, "offload_params": True, "offload_optimizer": False, "dtype": "float32",
                    "params": 24, "path": str(teacher), "micro_batch_size": 6, "max_token_len": None},
        "loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": True, "coef": 0.25,
    }  # fmt: skip
    block = startup_summary({"reward_model": judged, "distillation": distill})
    assert (
        f"{rm}, ZeRO-3, offload params, float32, 12 params, micro-batches of 4 rows per rank, sequences up to 100 "
        in block
    )
    assert f"{teacher}, ZeRO-3, offload params, float32, 24 params, micro-batches of 6 rows per rank (the " in block
    assert "k1 as a policy-gradient reward (minus the divergence is each token's advantage), added x 0.25 to " in block


def test_a_token_budget_and_the_default_length_are_what_the_reward_model_reads(tmp_path):
    rm = write_model_stub(tmp_path / "rm")
    (rm / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1})
    )
    overrides = [*stub_file_overrides(tmp_path), "reward_model.enable=true", f"reward_model.model.path={rm}",
                 "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=4096"]  # fmt: skip
    cfg, _ = C.load_and_validate(recipe("grpo"), overrides, 1)
    facts = reward_model_facts(cfg, engine(12))
    assert facts["max_token_len"] == 4096
    assert facts["max_length"] == cfg.data.max_prompt_length + cfg.data.max_response_length
