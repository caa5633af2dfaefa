"""Checkpoints edited as anyone who hands one out can edit them (the security review's F7-F9): a pickled payload
in a DeepSpeed file, or other settings in ``trainer_state.json``, with the manifest's sizes and SHA-256 and the
state's checksums recomputed, so that only loading the files as data stands between the checkpoint and its code;
and a copy of a model whose ``config.json`` points at model code of its own that leaves a mark when imported."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from dsrl.checkpoint.save import STATE_CHECKSUM, STATE_FILE, config_hash, sha256_file, state_checksum


class Payload:
    """Pickles as a call of ``os.system``: unpickling it appends a line to ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo code ran in pid $PPID >> {self.marker}",)


def rewrite_state(checkpoint: Path, **changes) -> None:
    """``trainer_state.json`` with the state's fields updated by ``changes`` (``config`` merged key by key), the
    manifest entry of every file recomputed, and the config hash and state checksum recomputed."""
    path = checkpoint / STATE_FILE
    state = json.loads(path.read_text())
    state["config"].update(changes.pop("config", {}))
    state.update(changes)
    state["config_hash"] = config_hash(state["config"])
    for name in state["files"]:
        state["files"][name] = {"bytes": (checkpoint / name).stat().st_size, "sha256": sha256_file(checkpoint / name)}
    state[STATE_CHECKSUM] = state_checksum(state)
    path.write_text(json.dumps(state, indent=1, sort_keys=True))


def with_payload(checkpoint: Path, out: Path, marker: Path, file: str | None = None) -> Path:
    """A copy of ``checkpoint`` at ``out`` whose ``file`` (default: the actor's first DeepSpeed model states file)
    holds a ``Payload`` under an extra key, its manifest recomputed."""
    shutil.copytree(checkpoint, out)
    name = file or str(sorted((out / "actor" / "ds").glob("*model_states.pt"))[0].relative_to(out))
    content = torch.load(out / name, weights_only=False)  # the test's own file: it holds no payload yet
    content["payload"] = Payload(marker)
    torch.save(content, out / name)
    rewrite_state(out)
    return out


EVIL_MODELING = """
from pathlib import Path
from transformers import Qwen3ForCausalLM

with open({marker!r}, "a") as f:
    f.write("remote code imported\\n")


class EvilQwen3(Qwen3ForCausalLM):
    pass
"""


def model_with_code(model: Path, out: Path, marker: Path) -> Path:
    """A copy of ``model`` whose ``config.json`` maps ``AutoModelForCausalLM`` to ``evil_modeling.EvilQwen3`` in the
    directory, a module that appends to ``marker`` when imported (what ``trust_remote_code=True`` runs)."""
    shutil.copytree(model, out)
    (out / "evil_modeling.py").write_text(EVIL_MODELING.format(marker=str(marker)))
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil_modeling.EvilQwen3"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
