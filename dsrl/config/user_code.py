"""``algorithm.import_modules``: the user's own Python modules, imported before validation checks the estimator and
policy-loss names and again by the trainer on every rank, so that what they register with
``dsrl.algorithms.register_estimator`` / ``register_policy_loss`` is known by name everywhere.

This module imports nothing heavy itself; a user module that registers something imports ``dsrl.algorithms`` (and
with it torch), and ``registered_names`` then reads that registry. A config without user modules never loads it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path

from dsrl.config.files import not_regular
from dsrl.config.names import ESTIMATOR_NEEDS
from dsrl.config.problems import violation

# The registries of dsrl.algorithms by the config key that names their entries: (module, function listing the names).
REGISTRIES = {
    "algorithm.adv_estimator": ("dsrl.algorithms.estimators", "estimator_names"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("dsrl.algorithms.losses", "policy_loss_names"),
}


def import_user_modules(entries: Iterable[str]) -> list[str]:
    """Import each entry of ``algorithm.import_modules`` once per process; one violation line (key, entry, what
    failed and where, fix) for each that did not import."""
    fix = "fix that module, or remove it from algorithm.import_modules (a .py path or an importable module name)"
    problems = ((entry, _import(entry)) for entry in entries)
    return [
        violation("algorithm.import_modules", entry, f"import failed: {problem}", fix)
        for entry, problem in problems
        if problem
    ]


def _import(entry: str) -> str | None:
    """Import ``entry`` (a path to a .py file, or an importable module name) once per process; None when it
    imported, else what went wrong (the exception, and the file and line it was raised at). A module that calls
    ``sys.exit`` while imported fails like any other (it would end the run with nothing trained, exit code 0
    included); a ``KeyboardInterrupt`` is the user's, and propagates."""
    if entry.endswith(".py") or "/" in entry:
        path = Path(entry).expanduser().resolve()
        if problem := not_regular(path):
            return f"{path} is {problem}"
        if not path.exists():
            return f"no such file {path}"
        try:
            import_file_once(path, f"dsrl_user_{path.stem}_")
        except (Exception, SystemExit) as err:  # noqa: BLE001  (user code: reported, not raised)
            return _failure(err)
        return None
    try:
        importlib.import_module(entry)
    except (Exception, SystemExit) as err:  # noqa: BLE001
        return _failure(err)
    return None


def import_file_once(path: Path, prefix: str):
    """The module of the .py file at ``path`` (absolute), executed once per process under a name of its own,
    ``prefix`` + a digest of the path: a second import (validation, then the trainer) finds it in sys.modules
    instead of running the file, and registering its names, twice. An import that raises leaves no module."""
    name = f"{prefix}{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling inside the file look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _failure(err: BaseException) -> str:
    """``ExcType: message at file:line`` (``called sys.exit(0) while being imported at file:line``), the line being
    the innermost frame of the traceback outside the import machinery (the user's code, or a library it called)."""
    machinery = (str(Path(importlib.__file__).parent), __file__)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(("<", *machinery))]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if isinstance(err, SyntaxError):  # raised while compiling: the file and line are the error's own
        where = f" at {err.filename}:{err.lineno}"
    if isinstance(err, SystemExit):
        code = "" if err.code is None else repr(err.code)
        return f"called sys.exit({code}) while being imported{where}"
    message = " ".join(str(err).split())
    return f"{type(err).__name__}: {message}{where}"


def registered_names(key: str, builtin: tuple[str, ...]) -> tuple[str, ...]:
    """The names ``key`` accepts: dsrl's ``builtin`` ones, then those user modules registered (sorted), read from
    the registry only if something imported it already."""
    module_name, function = REGISTRIES[key]
    module = sys.modules.get(module_name)
    extra = [] if module is None else [name for name in getattr(module, function)() if name not in builtin]
    return builtin + tuple(sorted(extra))


def registered_policy_loss_params(mode: str) -> tuple[str, ...]:
    """The parameter names the policy loss ``mode`` declares, read from the registry (a user module that registered
    ``mode`` imported it); () when the registry is not loaded or does not know ``mode``."""
    module = sys.modules.get(REGISTRIES["actor_rollout_ref.actor.policy_loss.loss_mode"][0])
    if module is None or mode not in module.policy_loss_names():
        return ()
    return tuple(module.policy_loss_params(mode))


def estimator_needs(name: str) -> frozenset[str]:
    """What the estimator ``name`` needs of a step (``dsrl.algorithms.register_estimator``'s ``needs``): a built-in's
    from ``ESTIMATOR_NEEDS``, a user's as its module registered them (read from the registry, which that module
    imported); empty for a name nothing registered."""
    if name in ESTIMATOR_NEEDS:
        return frozenset(ESTIMATOR_NEEDS[name])
    module = sys.modules.get(REGISTRIES["algorithm.adv_estimator"][0])
    if module is None or name not in module.estimator_names():
        return frozenset()
    return frozenset(module.estimator_needs(name))
