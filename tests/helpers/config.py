"""A config's problems as validation reports them, for the config tests."""

from __future__ import annotations

from dsrl import config as C
from tests.conftest import recipe


def problems(overrides, name: str = "grpo") -> list[str]:
    """The violation lines of the shipped recipe ``name`` with ``overrides`` on one rank; [] when it loads."""
    try:
        C.load_and_validate(recipe(name), overrides, 1)
    except C.ConfigError as err:
        return err.violations
    return []
