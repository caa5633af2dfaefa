"""The tools a run declares: read from ``tool_config_path`` (verl's YAML) and ``function_tool_path`` (a
.py file of functions), each problem with its file, line and fix; the JSON schema of a function from its
signature and docstring; the arguments of a call checked against a schema."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dsrl.config.loading import tool_config_file
from dsrl.config.user_code import import_file_once
from dsrl.rollout.tools.builtin import BUILTINS, python_sandbox, sandbox_fusion_config
from dsrl.workers.sandbox import SandboxUnavailable

MULTI_TURN_KEY = "actor_rollout_ref.rollout.multi_turn"
# A built-in named by its module path is the built-in: the same config rules, the same worker code.
_BUILTIN_PATHS = {f"{tool.__module__}.{tool.__name__}": name for name, tool in BUILTINS.items()}
# The config keys each built-in reads; ``type`` is verl's (``native``), accepted and unread. dsrl:sandbox_fusion's
# are verl's tool's, each checked by ``sandbox_fusion_config``.
_BUILTIN_CONFIG = {
    "dsrl:calculator": ("type",),
    "dsrl:python": ("type", "timeout", "memory_limit_mb", "sandbox", "network", "gpus"),
}
PYTHON_MEMORY_FLOOR_MB = 256  # of address space: importing numpy alone reserves about 200 MB
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_ARGS_ENTRY = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
# verl's tool classes dsrl has built in (verl 0.8.0 removed them from its own tree)
_VERL_BUILTINS = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": "dsrl:sandbox_fusion"}


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the workers build it: ``source`` is ``dsrl:<built-in>``, ``module.Class``,
    ``file.py:Class`` (``kind="class"``) or the function file (``kind="function"``)."""

    name: str
    kind: str  # "class" | "function"
    source: str
    schema: dict
    config: dict = field(default_factory=dict)


class ToolFileError(ValueError):
    """The problems of the tool files, one line each (``check_tool_files``)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def check_tool_files(cfg) -> list[str]:
    """The problems of ``multi_turn.tool_config_path`` and ``multi_turn.function_tool_path`` (only those
    set), each ``actor_rollout_ref.rollout.multi_turn.<key>=<path>: <file>:<line>: <what>; fix: <how>``.
    Imports the user's tool files (as the workers will), no torch; an empty list when all is well."""
    return load_tool_specs(cfg.actor_rollout_ref.rollout.multi_turn)[1]


def load_tool_specs(multi_turn) -> tuple[list[ToolSpec], list[str]]:
    """The tools of ``multi_turn`` (a MultiTurnConfig) in file order, YAML first, and the problems."""
    specs, problems = [], []
    if multi_turn.tool_config_path:
        found, problems = _yaml_tools(tool_config_file(multi_turn.tool_config_path), multi_turn.tool_timeout)
        specs += found
    if multi_turn.function_tool_path:
        found, more = _function_tools(multi_turn.function_tool_path)
        specs += found
        problems += more
    seen: dict[str, ToolSpec] = {}
    for spec in specs:
        if spec.name in seen:
            problems.append(
                f"{MULTI_TURN_KEY}: two tools are named {spec.name!r} ({seen[spec.name].source} and {spec.source}); "
                "fix: rename one (tool_schema.function.name, or the function)"
            )
        seen[spec.name] = spec
    return specs, problems


def _problem(key: str, path: str, file: str, line: int | None, what: str, fix: str) -> str:
    where = f"{file}:{line}" if line else file
    return f"{MULTI_TURN_KEY}.{key}={path}: {where}: {what}; fix: {fix}"


# ---------------------------------------------------------------- tool_config_path


def _yaml_tools(path: str, tool_timeout: float) -> tuple[list[ToolSpec], list[str]]:
    def problem(line, what, fix):
        return _problem("tool_config_path", path, path, line, what, fix)

    try:
        text = open(path).read()
    except OSError as exc:
        return [], [problem(None, f"cannot read it ({exc.strerror})", "point tool_config_path at the tool YAML")]
    try:
        root, node = yaml.safe_load(text), yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        what = f"not valid YAML: {getattr(exc, 'problem', None) or exc}"
        return [], [problem(mark.line + 1 if mark else None, what, "correct the YAML syntax")]
    shape = "tools: [{class_name: dsrl:calculator}, {class_name: my_module.MyTool, config: {}, tool_schema: {...}}]"
    if not isinstance(root, dict) or not isinstance(root.get("tools"), list):
        return [], [problem(1, "no 'tools' list at the top", f"write {shape}")]
    lines = _item_lines(node)
    specs, problems = [], []
    for i, entry in enumerate(root["tools"]):
        line = lines[i] if i < len(lines) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            problems.append(problem(line, f"tool {i} has no class_name", f"write {shape}"))
            continue
        source, config, schema = entry["class_name"], entry.get("config") or {}, entry.get("tool_schema")
        if not isinstance(config, dict):
            problems.append(
                problem(
                    line,
                    f"tool {source!r}: config must be a mapping, got {type(config).__name__}",
                    "write config: {key: value, ...}, or leave it out",
                )
            )
            continue
        source = _BUILTIN_PATHS.get(source, source)
        if source.startswith("dsrl:"):
            if source not in BUILTINS:
                problems.append(problem(line, f"unknown built-in tool {source!r}", f"use one of {sorted(BUILTINS)}"))
                continue
            schema = schema or BUILTINS[source].SCHEMA
            if source == "dsrl:python":
                # Its own limit ends the script (and counts a timeout) before the pool's kills the worker.
                config = {"timeout": 0.8 * tool_timeout, **config}
            wrong = []
            if source == "dsrl:sandbox_fusion":  # verl's keys, with their defaults
                config, refused = sandbox_fusion_config(config, tool_timeout)
                wrong = [(f"dsrl:sandbox_fusion {what}", fix) for what, fix in refused]
            wrong += _builtin_problems(source, config, schema, tool_timeout)
            if wrong:
                problems += [problem(line, what, fix) for what, fix in wrong]
                continue
        elif source in _VERL_BUILTINS:
            problems.append(
                problem(
                    line,
                    f"{source} is verl's tool, which dsrl has built in",
                    f"write class_name: {_VERL_BUILTINS[source]} (it reads the same config keys)",
                )
            )
            continue
        else:
            try:
                _check_class(source, path)
            except _UserCodeError as exc:  # at the line of the user's file where it failed, if any
                where = (exc.file, exc.line) if exc.file else (path, line)
                problems.append(_problem("tool_config_path", path, *where, str(exc), exc.fix))
                continue
        error = _schema_problem(schema)
        if error:
            problems.append(
                problem(
                    line,
                    f"tool {source!r}: {error}",
                    _SCHEMA_FIX,
                )
            )
            continue
        specs.append(ToolSpec(schema["function"]["name"], "class", source, schema, dict(config)))
    return specs, problems


_SCHEMA_FIX = (
    "give it a tool_schema: {type: function, function: {name, description, parameters: {type: object, properties, "
    "required}}}"
)


def _builtin_problems(source: str, config: dict, schema, tool_timeout: float) -> list[tuple[str, str]]:
    """``(what, fix)`` for each setting of the built-in ``source`` it would not honour: a config key it does not
    read, a ``dsrl:python`` limit out of range, a ``tool_schema`` without the parameters it reads."""
    problems = []
    unknown = sorted(set(config) - set(_BUILTIN_CONFIG[source])) if source in _BUILTIN_CONFIG else []
    if unknown:
        problems.append(
            (
                f"{source} config has no key(s) {unknown}; it reads {list(_BUILTIN_CONFIG[source])}",
                "correct or remove them",
            )
        )
    if source == "dsrl:python":
        timeout, memory = config["timeout"], config.get("memory_limit_mb", 1024)
        if not (_is_number(timeout) and 0 < timeout < tool_timeout):
            problems.append(
                (
                    f"dsrl:python config.timeout={timeout!r} must be a number of seconds below "
                    f"multi_turn.tool_timeout={tool_timeout:g} (past that the worker is killed, not the script)",
                    "lower it, or leave it out for 0.8 x tool_timeout",
                )
            )
        whole = isinstance(memory, int) and not isinstance(memory, bool)
        if not (whole and (memory == 0 or memory >= PYTHON_MEMORY_FLOOR_MB)):
            problems.append(
                (
                    f"dsrl:python config.memory_limit_mb={memory!r} must be a whole number of MB, 0 (no limit) or "
                    f">= {PYTHON_MEMORY_FLOOR_MB} (the script's address space, RLIMIT_AS; a negative one is none)",
                    "set it to 1024, or leave it out for 1024",
                )
            )
        if not problems:  # the sandbox is built with these limits
            problems += _sandbox_problems(config)
    malformed = _schema_problem(schema)
    if malformed:
        problems.append((f"tool {source!r}: {malformed}", _SCHEMA_FIX))
    elif wrong := _reads_problem(source, schema):
        problems.append(
            (f"tool {source!r}: {wrong}", f"keep {source}'s parameters: {_parameters(BUILTINS[source].SCHEMA)}")
        )
    return problems


def _sandbox_problems(config: dict) -> list[tuple[str, str]]:
    """``(what, fix)`` for a ``dsrl:python`` config's sandbox settings. With ``sandbox: bubblewrap`` (the default)
    the sandbox is built here, so that one that cannot run fails before any model loads."""
    sandbox = config.get("sandbox", "bubblewrap")
    if sandbox not in ("bubblewrap", "none"):
        return [(f"dsrl:python config.sandbox={sandbox!r} must be bubblewrap or none", "leave it out for bubblewrap")]
    for key in ("network", "gpus"):
        if key in config and sandbox == "none":
            return [
                (
                    f"dsrl:python config.{key} is a setting of the sandbox; with config.sandbox: none the code has "
                    "the trainer's network and GPUs whatever it says",
                    f"remove config.{key}, or the sandbox: none",
                )
            ]
        if not isinstance(config.get(key, False), bool):
            return [
                (f"dsrl:python config.{key}={config[key]!r} must be true or false", f"set {key}: true, or remove it")
            ]
    if sandbox == "bubblewrap":
        try:
            python_sandbox(config)
        except SandboxUnavailable as exc:
            return [(exc.reason, exc.fix)]
    return []


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _reads_problem(source: str, schema: dict) -> str | None:
    """What a built-in's ``tool_schema`` lacks of the parameters its code reads (the model writes what the schema
    says: a renamed parameter fails every call)."""
    builtin = BUILTINS[source].SCHEMA["function"]["parameters"]
    parameters = schema["function"].get("parameters") or {}
    properties, required = parameters.get("properties") or {}, parameters.get("required") or []  # checked: well formed
    for name in builtin["required"]:
        expected = builtin["properties"][name]["type"]
        if (properties.get(name) or {}).get("type") != expected or name not in required:
            return (
                f"tool_schema.function.parameters must require {name!r} ({expected}), which {source} reads; "
                f"it has {_parameters(schema)}"
            )
    return None


def _parameters(schema: dict) -> str:
    parameters = schema["function"].get("parameters") or {}
    properties, required = parameters.get("properties") or {}, parameters.get("required") or []
    shown = [
        f"{k}: {v.get('type', 'any') if isinstance(v, dict) else v}{'' if k in required else ' (optional)'}"
        for k, v in properties.items()
    ]
    return "(" + ", ".join(shown) + ")"


def _item_lines(node) -> list[int]:
    """The line of each entry of the top-level ``tools`` list (1-based)."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == "tools" and isinstance(value, yaml.SequenceNode):
                return [item.start_mark.line + 1 for item in value.value]
    return []


def _schema_problem(schema) -> str | None:
    if not isinstance(schema, dict):
        return "no tool_schema"
    function = schema.get("function")
    if schema.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return "tool_schema must be {type: function, function: {name: ..., ...}}"
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return "tool_schema.function.parameters must be a JSON schema of type object"
    # What the trainer reads of it for every call (argument_problem): a malformed one would fail there.
    properties, required = parameters.get("properties") or {}, parameters.get("required") or []
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        return "tool_schema.function.parameters.properties must map each parameter's name to its JSON schema"
    for name, prop in properties.items():
        kind = prop.get("type")
        if not (
            kind is None or isinstance(kind, str) or (isinstance(kind, list) and all(isinstance(k, str) for k in kind))
        ):
            return (
                f"tool_schema: the type of parameter {name!r} must be a JSON type name or a list of them, got {kind!r}"
            )
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        return "tool_schema.function.parameters.required must be a list of parameter names"
    return None


def _check_class(source: str, yaml_path: str) -> None:
    if not callable(getattr(load_tool_class(source, yaml_path), "execute", None)):
        raise _UserCodeError(
            f"{source} has no execute method", "define execute(self, parameters: dict, **kwargs) -> str"
        )


# ---------------------------------------------------------------- importing the user's code


class _UserCodeError(Exception):
    def __init__(self, what: str, fix: str, file: str | None = None, line: int | None = None):
        super().__init__(what)
        self.fix, self.file, self.line = fix, file, line


def load_tool_class(source: str, yaml_path: str) -> type:
    """The class of ``module.Class`` (importable) or ``file.py:Class`` (relative to the YAML's folder
    when not absolute)."""
    if ":" in source:
        file, name = source.rsplit(":", 1)
        if not os.path.isabs(file):
            file = os.path.join(os.path.dirname(os.path.abspath(yaml_path)), file)
        module = import_file(file)
    else:
        module_name, _, name = source.rpartition(".")
        if not module_name:
            raise _UserCodeError(
                f"class_name {source!r} names no module", "write module.Class or path/to/file.py:Class"
            )
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name.split(".")[0] and exc.name != module_name:
                raise _import_error(exc, _module_file(module_name)) from None
            raise _UserCodeError(
                f"cannot import {module_name!r} ({exc})", "put its folder on PYTHONPATH, or write path/to/file.py:Class"
            ) from None
        except BaseException as exc:  # noqa: BLE001 -- whatever the user's module does on import
            raise _import_error(exc, _module_file(module_name)) from None
    tool_class = getattr(module, name, None)
    if not isinstance(tool_class, type):
        raise _UserCodeError(f"{source}: no class {name!r} in {module.__name__}", f"define class {name} there")
    return tool_class


def _module_file(module_name: str) -> str | None:
    try:
        return importlib.util.find_spec(module_name).origin
    except Exception:  # noqa: BLE001 -- only for the line of an error message
        return None


def import_file(path: str) -> types.ModuleType:
    """The module of the .py file ``path``, imported once per process under a name of its own."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise _UserCodeError(f"{path} is a directory, not a .py file", "name the .py file in it")
    if not os.path.isfile(path):
        raise _UserCodeError(f"no such file {path}", "correct the path")
    if not path.endswith(".py"):
        raise _UserCodeError(f"{path} is not a .py file", "name a Python file ending in .py")
    try:
        return import_file_once(Path(path), "_dsrl_tools_")
    except BaseException as exc:  # noqa: BLE001 -- SystemExit included
        raise _import_error(exc, path) from None


def _import_error(exc: BaseException, path: str | None) -> _UserCodeError:
    """The error of importing ``path``, at its line in that file (a SyntaxError's own, else the innermost
    frame in it)."""
    line = None
    if isinstance(exc, SyntaxError) and exc.filename == path:
        line = exc.lineno
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        line = frames[-1].lineno if frames else None
    what = f"importing it raised {type(exc).__name__}: {exc}"
    return _UserCodeError(what, "make the file import without errors (python -c 'import ...')", path, line)


# ---------------------------------------------------------------- function_tool_path


def _function_tools(path: str) -> tuple[list[ToolSpec], list[str]]:
    try:
        module = import_file(path)
    except _UserCodeError as exc:
        return [], [_problem("function_tool_path", path, exc.file or path, exc.line, str(exc), exc.fix)]
    specs, problems = [], []
    for fn in public_functions(module):
        try:
            schema = function_schema(fn)
        except _UserCodeError as exc:
            problems.append(_problem("function_tool_path", path, path, exc.line, str(exc), exc.fix))
            continue
        specs.append(ToolSpec(fn.__name__, "function", os.path.abspath(path), schema))
    if not specs and not problems:
        problems.append(
            _problem(
                "function_tool_path",
                path,
                path,
                None,
                "defines no public function",
                "define def my_tool(x: int) -> str with a docstring; names starting with _ are not tools",
            )
        )
    return specs, problems


def public_functions(module: types.ModuleType) -> list[types.FunctionType]:
    """The functions ``module`` defines (not imports), not starting with ``_``, in file order."""
    functions = [
        fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")
    ]
    return sorted(functions, key=lambda fn: fn.__code__.co_firstlineno)


def function_schema(fn: types.FunctionType) -> dict:
    """The OpenAI function schema of ``fn``: description = its docstring's first paragraph; a parameter
    per argument, its JSON type from the annotation (str, int, float, bool, list[...], dict[...],
    Optional[...]), its description from a Google-style ``Args:`` section; required = no default."""
    line = fn.__code__.co_firstlineno
    doc = inspect.getdoc(fn)
    if not doc:
        raise _UserCodeError(
            f"function {fn.__name__} has no docstring (the model reads it as the tool's description)",
            "add a docstring saying what the tool does, with an Args: section",
            line=line,
        )
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 -- a NameError in a string annotation, among others
        raise _UserCodeError(
            f"function {fn.__name__}: its annotations do not resolve ({exc})",
            "use str, int, float, bool, list or dict",
            line=line,
        ) from None
    described = _args_section(doc)
    properties, required = {}, []
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise _UserCodeError(
                f"function {fn.__name__}: *{name} has no place in a JSON schema", "name every parameter", line=line
            )
        if name not in hints:
            raise _UserCodeError(
                f"function {fn.__name__}: parameter {name!r} has no type annotation (the schema needs one)",
                f"annotate it, e.g. {name}: str",
                line=line,
            )
        try:
            properties[name] = _json_type(hints[name])
        except TypeError as exc:
            raise _UserCodeError(
                f"function {fn.__name__}: parameter {name!r}: {exc}",
                "use str, int, float, bool, list[...], dict[...] or Optional[...] of them",
                line=line,
            ) from None
        if name in described:
            properties[name]["description"] = described[name]
        if parameter.default is parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": " ".join(doc.split("\n\n")[0].split()),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _json_type(annotation) -> dict:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{annotation} is a union of several types")
        return _json_type(options[0])
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is list:
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    raise TypeError(f"{annotation} has no JSON type")


def _args_section(doc: str) -> dict[str, str]:
    """``{parameter: description}`` from a Google-style ``Args:`` section."""
    described: dict[str, str] = {}
    lines, inside, indent, current = doc.splitlines(), False, None, None
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            inside, indent, current = True, None, None
            continue
        if not inside:
            continue
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent or (depth == 0 and stripped.endswith(":")):
            break  # the next section
        match = _ARGS_ENTRY.match(stripped)
        if depth == indent and match:
            current = match.group(1)
            described[current] = match.group(2)
        elif current:
            described[current] = f"{described[current]} {stripped}".strip()
    return described


# ---------------------------------------------------------------- a call's arguments


def argument_problem(schema: dict, arguments: dict) -> str | None:
    """What is wrong with ``arguments`` for the tool of ``schema`` (a missing required parameter, one it
    does not take, a value of the wrong JSON type), or None."""
    function = schema["function"]
    parameters = function.get("parameters") or {}
    properties, required = parameters.get("properties") or {}, parameters.get("required") or []
    takes = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in properties.items()) or "no arguments"
    missing = [k for k in required if k not in arguments]
    if missing:
        return f"tool {function['name']!r} needs the argument(s) {missing}; it takes ({takes})"
    if properties and parameters.get("additionalProperties") is not True:
        unknown = [k for k in arguments if k not in properties]
        if unknown:
            return f"tool {function['name']!r} takes no argument(s) {unknown}; it takes ({takes})"
    for name, value in arguments.items():
        expected = (properties.get(name) or {}).get("type")
        if expected and not any(
            _is_json_type(value, t) for t in ([expected] if isinstance(expected, str) else expected)
        ):
            shown = json.dumps(value, ensure_ascii=False)
            shown = shown if len(shown) <= 60 else shown[:60] + "..."
            return f"tool {function['name']!r}: argument {name!r} must be {expected}, got {shown}"
    return None


def _is_json_type(value, json_type: str) -> bool:
    if json_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}.get(json_type)
    return python is None or isinstance(value, python)
