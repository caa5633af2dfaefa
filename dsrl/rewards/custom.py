"""Loading a user's reward function from a Python file (``custom_reward_function.path/name``, as in verl).

The function replaces the built-in dispatcher for every data source and is called with keyword
arguments ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``; it returns a
float or a dict with a ``"score"`` key (other keys are logged as extras).
"""

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

_SIGNATURE = "def {name}(data_source, solution_str, ground_truth, extra_info=None) -> float | dict"


def load_custom_reward_function(path: str, name: str) -> Callable:
    """Import the file at ``path`` as a fresh module and return its callable ``name``.

    ValueError (naming ``custom_reward_function.path`` / ``.name``) when the file or the function is
    missing; exceptions raised while importing the file propagate with their traceback.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(
            f"custom_reward_function.path={path!r}: no such file. "
            f"Fix: point it at a Python file that defines {_SIGNATURE.format(name=name)}, or set it to null."
        )
    module_name = f"dsrl_custom_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    # Registered before execution so dataclasses and pickling inside the user's file find the module.
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(
            f"custom_reward_function.name={name!r}: {path} defines no function of that name "
            f"(callables found: {defined}). Fix: set custom_reward_function.name to one of them, or add "
            f"{_SIGNATURE.format(name=name)} to the file."
        )
    return fn
