"""Where dsrl's files are: the folders it ships beside its code and the names it gives inside a run folder."""

from __future__ import annotations

from pathlib import Path

# The final model's folder in trainer.default_local_dir (validation checks what is there; dsrl.checkpoint.save writes
# it).
FINAL_MODEL_DIR = "huggingface"
# A LoRA actor's adapter as a PEFT directory, inside each exported model's folder (verl's name for it).
ADAPTER_DIR = "lora_adapter"


def _shipped(folder: str) -> Path:
    """A folder dsrl ships beside its code: inside the package when installed from a wheel (dsrl/<folder>),
    at the top of the source checkout otherwise."""
    package = Path(__file__).resolve().parents[1]  # dsrl/ (this file is dsrl/config/layout.py)
    installed = package / folder
    return installed if installed.is_dir() else package.parent / folder


DS_CONFIG_DIR = _shipped("ds_configs")
RECIPE_DIR = _shipped("configs")
