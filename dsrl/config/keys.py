"""Every dotted key of the config tree (``SCHEMA``: its type, documentation and default, read off the dataclasses of
``dsrl.config.schema``), the leaves among them, and the value at a key of a loaded config."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, cast, get_type_hints

from omegaconf import DictConfig, OmegaConf

from dsrl.config.schema import Config


class KeyInfo(NamedTuple):
    type: Any  # resolved annotation; a dataclass for a section
    help: str
    default: Any  # the default value of a leaf (MISSING for required ones); None for a section


def _schema(cls: type = Config, prefix: str = "") -> dict[str, KeyInfo]:
    """Every dotted key of the tree, sections and leaves, with its type, documentation and default."""
    hints = get_type_hints(cls)
    keys: dict[str, KeyInfo] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            keys[prefix + f.name] = KeyInfo(tp, f.metadata["help"], None)
            keys.update(_schema(tp, f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
            keys[prefix + f.name] = KeyInfo(tp, f.metadata["help"], default)
    return keys


SCHEMA = _schema()
LEAF_KEYS = tuple(key for key, info in SCHEMA.items() if not dataclasses.is_dataclass(info.type))


def value_at(cfg: object, key: str, **select: Any) -> Any:
    """The value at dotted ``key`` of a loaded config (None where absent): ``OmegaConf.select`` on the DictConfig
    that a ``Config`` (or a section of one) is at run time; ``select``: its keyword arguments."""
    return OmegaConf.select(cast(DictConfig, cfg), key, **select)
