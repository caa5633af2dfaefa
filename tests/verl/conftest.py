"""The verl tier: dsrl's RL math against verl 0.9.1 itself, run only by ``.ci/verl_tier.sh``.

``tests/conftest.py`` leaves this folder out unless ``DSRL_VERL_TIER=1`` (which the tier sets); here verl
is imported unconditionally, so in the tier a missing or wrong verl fails instead of skipping.
"""

from __future__ import annotations

from pathlib import Path

try:
    import verl
except ImportError as err:
    raise ImportError("tests/verl needs verl 0.9.1 beside dsrl: run `bash .ci/verl_tier.sh`") from err

import dsrl

VERL_VERSION = "0.9.1"
REPO = Path(__file__).resolve().parents[2]


def pytest_sessionstart(session) -> None:
    if verl.__version__ != VERL_VERSION:
        raise RuntimeError(f"the verl tier compares with verl {VERL_VERSION}; this environment has {verl.__version__}")
    if Path(dsrl.__file__).resolve().parents[1] != REPO:
        raise RuntimeError(f"the verl tier must test this checkout ({REPO}); dsrl was imported from {dsrl.__file__}")
