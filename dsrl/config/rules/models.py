"""The rules on the models that judge the policy's responses: the reward model (``reward_model.*``) and the
distillation teacher (``distillation.*``). Their paths are checked with the other models' (``paths``); their tokenizers
are compared with the policy's when the run loads them (``dsrl.rewards.model_inputs``)."""

from __future__ import annotations

from pathlib import Path

from dsrl.config.files import model_config, not_regular
from dsrl.config.names import DISTILLATION_LOSS_MODES
from dsrl.config.rules.need import Need
from dsrl.config.schema import Config, reward_model_length


def reward_model_rules(cfg: Config, need: Need) -> None:
    rm = cfg.reward_model
    if not rm.enable:
        return
    need(
        rm.model.path is not None,
        "reward_model.model.path",
        "reward_model.enable needs the reward model's checkpoint",
        "set reward_model.model.path to a sequence-classification checkpoint (one label), or reward_model.enable=false",
    )
    need(
        rm.micro_batch_size_per_gpu >= 1, "reward_model.micro_batch_size_per_gpu", "must be >= 1", "set it to 1 or more"
    )
    need(
        not rm.use_dynamic_bsz or rm.forward_max_token_len_per_gpu >= 1,
        "reward_model.forward_max_token_len_per_gpu",
        "must be >= 1 with reward_model.use_dynamic_bsz",
        "set it to at least data.max_prompt_length + data.max_response_length",
    )
    need(rm.max_length is None or rm.max_length >= 2, "reward_model.max_length", "must be >= 2 or null", "set null")
    partial = cfg.trainer.v1.trainer_mode == "colocate_async"
    need(
        not (partial and cfg.algorithm.filter_groups.enable),
        "reward_model.enable",
        "with trainer.v1.trainer_mode=colocate_async, dynamic sampling judges each rank's groups as they complete, "
        "a call the reward model's collective forward (ZeRO-3 gathers on every rank) cannot follow",
        "set algorithm.filter_groups.enable=false or trainer.v1.trainer_mode=sync",
    )
    folder = Path(rm.model.path).expanduser() if rm.model.path else None
    # read only a regular config.json: a FIFO there would block the read (the path rules report it)
    sound = folder is not None and folder.is_dir() and not_regular(folder / "config.json") is None
    config = model_config(folder) if folder is not None and sound else None
    if config is None:  # a hub id, or a directory the path rules find unsound
        return
    architectures = config.get("architectures") or []
    labels = config.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else config.get("num_labels", 2)
    classifier = any(str(name).endswith("ForSequenceClassification") for name in architectures)
    named = ", ".join(map(str, architectures)) or "a model without architectures"
    need(
        classifier and num_labels == 1,
        "reward_model.model.path",
        f"{rm.model.path} is {named}{f' with {num_labels} labels' if classifier else ''}, not a "
        "sequence-classification reward model with one label (a score head)",
        "point it at a reward model (AutoModelForSequenceClassification.from_pretrained(path, num_labels=1) saved "
        "after training); a causal LM is a teacher (distillation.*), not a reward model",
    )
    positions = config.get("max_position_embeddings")
    length = reward_model_length(cfg)
    key = "reward_model.max_length"
    need(
        not isinstance(positions, int) or length <= positions,
        key,
        f"the reward model reads {length} tokens at most "
        f"({'this key' if rm.max_length else 'null: data.max_prompt_length + max_response_length'}), more than its "
        f"max_position_embeddings={positions}",
        f"set {key} to {positions} or less (longer conversations lose their start), or shorten the data's lengths",
        value=rm.max_length,
    )


def distillation_rules(cfg: Config, need: Need) -> None:
    distill = cfg.distillation
    if not distill.enabled:
        return
    loss, prefix = distill.distillation_loss, "distillation.distillation_loss"
    need(
        distill.teacher_models.teacher_model.model_path is not None,
        "distillation.teacher_models.teacher_model.model_path",
        "distillation.enabled needs the teacher's checkpoint",
        "set it to a causal LM with the student's tokenizer, or distillation.enabled=false",
    )
    topk = loss.loss_mode == "forward_kl_topk"
    need(
        loss.loss_mode in DISTILLATION_LOSS_MODES,
        f"{prefix}.loss_mode",
        "verl's forward_kl_topk needs the student's logits inside the loss, which dsrl's loss does not hold"
        if topk
        else f"unknown loss mode; one of {', '.join(DISTILLATION_LOSS_MODES)}",
        "set k3 (the divergence as the loss) or k1 with use_policy_gradient=true",
    )
    need(
        loss.use_policy_gradient or loss.loss_mode not in ("k1", "kl"),
        f"{prefix}.loss_mode",
        "backpropagated directly (use_policy_gradient=false), k1's gradient does not depend on the teacher's "
        "log-probs (verl refuses it too)",
        f"set {prefix}.use_policy_gradient=true, or loss_mode=k3",
    )
    need(loss.policy_loss_mode == "vanilla", f"{prefix}.policy_loss_mode", "only vanilla (as verl)", "set vanilla")
    need(loss.distillation_loss_coef >= 0, f"{prefix}.distillation_loss_coef", "must be >= 0", "set it to 0 or more")
    need(
        loss.loss_max_clamp is None or loss.loss_max_clamp > 0,
        f"{prefix}.loss_max_clamp",
        "must be > 0 or null",
        "set null (no clamp) or a positive bound",
    )
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(loss, name)
        need(value is None or value > 0, f"{prefix}.{name}", "must be > 0", "set it above 0 (verl: 0.2)")
