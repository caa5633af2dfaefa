"""dsrl's built-in tools, named ``dsrl:calculator``, ``dsrl:python`` and ``dsrl:sandbox_fusion`` in the tool YAML.

All follow the protocol of user tool classes (``dsrl.rollout.tools``): ``Tool(config, tool_schema)``
and ``execute(parameters) -> str``. They run in the tool workers, so they import no torch.
"""

from __future__ import annotations

import ast
import ctypes
import math
import operator
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time

from dsrl.workers.pool import kill_process_group
from dsrl.workers.sandbox import Sandbox, SandboxUnavailable, read_bounded
from dsrl.workers.sandbox_fusion import LANGUAGES, SandboxFusionClient, SandboxFusionError, url_problem

_MAX_DIGITS = 3010  # of an integer: far past any answer, well short of a number that stalls the worker
_MB = 2**20
_PR_SET_PDEATHSIG = 1


class ToolTimeout(Exception):
    """A built-in stopped its own work at its time limit: counted as a ``timeout``, not an ``exception``."""


# ---------------------------------------------------------------- calculator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """``calculator(expression)``: the value of an arithmetic expression, computed from its syntax tree
    (numbers, ``+ - * / // % **``, unary ``+``/``-``, parentheses; no names, no calls, no ``eval``). An
    integer result prints as an integer (``56088``), a float as Python's ``repr`` (``0.5``)."""

    SCHEMA = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression, e.g. 123*456"}},
                "required": ["expression"],
            },
        },
    }

    def __init__(self, config: dict, tool_schema: dict):
        pass  # nothing to configure

    def execute(self, parameters: dict, **kwargs) -> str:
        expression = parameters["expression"]
        try:
            value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
        except SyntaxError as exc:
            what = f"not an arithmetic expression: {exc.msg}"
            if "integer string conversion" in exc.msg:  # Python's advice (set_int_max_str_digits) means nothing here
                what = f"a number in it has more than {_MAX_DIGITS} digits; at most {_MAX_DIGITS} are allowed"
            raise ValueError(what) from None
        except (MemoryError, RecursionError):  # the parser's or _evaluate's stack: a thousand operators in a row
            raise ValueError("too deeply nested; write it with fewer operators in a row") from None
        return str(value) if isinstance(value, int) else repr(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value, "a number in it")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if type(node.op) is ast.Pow:
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    raise ValueError(f"{ast.unparse(node)[:60]!r} is not allowed; use only numbers, + - * / // % ** and parentheses")


def _check_power(base, exponent) -> None:
    """Refuse an integer power far past ``_MAX_DIGITS`` before computing it (``9**9**9`` would take minutes and
    gigabytes): its digits are about ``exponent * log10(|base|)``. One close to the limit is computed and
    checked exactly (``_checked``); float results overflow on their own (OverflowError)."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        digits = exponent * math.log10(abs(base))
        if digits > _MAX_DIGITS + 1:
            raise ValueError(f"the result would have about {digits:.0f} digits; at most {_MAX_DIGITS} are allowed")


def _checked(value: int | float, what: str = "the result") -> int | float:
    """``value``, or ValueError for an integer of more than ``_MAX_DIGITS`` digits (a product, a sum, a literal:
    each input is within the limit, so computing it cost nothing)."""
    if isinstance(value, int) and abs(value) >= _TOO_LARGE:
        raise ValueError(f"{what} has more than {_MAX_DIGITS} digits; at most {_MAX_DIGITS} are allowed")
    return value


_TOO_LARGE = 10**_MAX_DIGITS


# ---------------------------------------------------------------- python


class PythonInterpreter:
    """``python(code)``: runs ``code`` as a script by ``python -I`` and returns what it printed (stdout and
    stderr together), with the exit status when it is not 0.

    Each run has a fresh scratch folder (also its ``HOME``), an environment of ``PATH``, ``LANG`` and ``HOME``
    only, and a wall-time limit (``config.timeout`` seconds: a run past it is killed and counted as a timeout).
    It runs in dsrl's sandbox (``dsrl.workers.sandbox``; ``config.sandbox: bubblewrap``, the default): it
    sees the interpreter and its packages but none of the trainer's files, processes or network (unless
    ``config.network``) and no GPU (unless ``config.gpus``); ``config.memory_limit_mb`` (default 1024) bounds
    each process and, where a cgroup can be made, all of them together; what it starts ends with it. Where no
    sandbox runs, the tool refuses to start. ``config.sandbox: none`` runs the code as the trainer's user in a
    temporary folder instead, with ``RLIMIT_AS`` per process, in a process group of its own that is killed
    when the run ends. Of a long output the first and the last MiB are read; the rest is skipped, not held in
    memory.
    """

    SCHEMA = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python script and return what it prints. Use print() to see results.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the Python code to run"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict, tool_schema: dict):
        self.timeout_s = float(config["timeout"])
        self.memory_limit_mb = int(config.get("memory_limit_mb", 1024))
        self.sandbox = None
        if config.get("sandbox", "bubblewrap") == "bubblewrap":
            self.sandbox = python_sandbox(config)
            print(f"[dsrl tool worker {os.getpid()}] dsrl:python runs code in {self.sandbox.describe()}")

    def execute(self, parameters: dict, **kwargs) -> str:
        if self.sandbox is None:
            output, returncode, timed_out = self._run_unsandboxed(parameters["code"])
            out_of_memory = False
        else:
            command = [sys.executable, "-I", "-u", "main.py"]  # unbuffered: what it printed before a kill is kept
            result = self.sandbox.run(command, {"main.py": parameters["code"]}, timeout_s=self.timeout_s)
            output, returncode, timed_out, out_of_memory = (
                result.output,
                result.returncode,
                result.timed_out,
                result.out_of_memory,
            )
            if returncode is not None and returncode > 128:  # how bwrap reports a command a signal killed
                returncode = 128 - returncode
        text = output.decode("utf-8", errors="replace")
        if timed_out:
            raise ToolTimeout(f"the code ran past {self.timeout_s:g} s and was killed; its output until then:\n{text}")
        if out_of_memory:
            text += f"\n(out of memory: its processes together reached config.memory_limit_mb={self.memory_limit_mb})"
        if returncode < 0:
            return f"{text}\n(killed by {signal.Signals(-returncode).name})"
        if returncode:
            return f"{text}\n(exit status {returncode})"
        return text

    def _run_unsandboxed(self, code: str) -> tuple[bytes, int, bool]:
        with tempfile.TemporaryDirectory(prefix="dsrl_python_tool_") as workdir:
            with open(os.path.join(workdir, "main.py"), "w") as script:
                script.write(code)
            process = subprocess.Popen(
                [sys.executable, "-I", "-u", "main.py"],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": workdir},
                process_group=0,
                preexec_fn=self._limit_child,
            )
            try:
                output, timed_out = read_bounded(process.stdout.fileno(), time.monotonic() + self.timeout_s)
            finally:
                kill_process_group(process.pid)  # at once, on a timeout; else what the code left running
                process.wait()
                process.stdout.close()
        return output, process.returncode, timed_out

    def _limit_child(self) -> None:
        # In the child, between fork and exec: plain system calls only.
        if self.memory_limit_mb:
            limit = self.memory_limit_mb * _MB
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


PYTHON_UNSANDBOXED = (
    "the code then runs as the trainer's user: it reads and writes every file the trainer can (the tokens in "
    "/proc/<pid>/environ of the trainer's processes included), reaches the network, sees the GPUs and can "
    "signal the trainer"
)


def python_sandbox(config: dict) -> Sandbox:
    """The sandbox for a python tool ``config``; :class:`SandboxUnavailable` names the opt-out too."""
    try:
        return Sandbox(
            memory_limit_mb=int(config.get("memory_limit_mb", 1024)),
            network=bool(config.get("network", False)),
            gpus=bool(config.get("gpus", False)),
        )
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(
            f"dsrl:python runs model-written code in a sandbox, and none works here: {exc.reason}",
            f"{exc.fix}; or set config.sandbox: none to run the code without one ({PYTHON_UNSANDBOXED})",
        ) from None


_prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux; looked up here, not in the child after fork


class SandboxFusionTool:
    """``code_interpreter(code)``: runs ``code`` on a SandboxFusion server (``dsrl.workers.sandbox_fusion``), as
    verl's ``SandboxFusionTool`` did (verl 0.8.0 removed it from its tree), and returns what the run printed,
    stdout then stderr, with the exit status when it is not 0. A run past its limit counts as a timeout, with what it
    printed until then; a server that gives no verdict (unreachable after 3 attempts, an HTTP error, a
    ``SandboxError``) raises, counted as an exception with the reason, and one that does not answer in time as a
    timeout.

    ``config``: verl's keys, checked by :func:`sandbox_fusion_config`. The model may also pass ``language`` and a
    shorter ``timeout`` when the ``tool_schema`` declares them (verl's tool read both).
    """

    SCHEMA = {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "Run Python code and return what it prints. Use print() to see results.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the code to run"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict, tool_schema: dict):
        self.timeout_s = float(config["default_timeout"])
        self.language = config["default_language"]
        self.client = SandboxFusionClient(
            config["sandbox_fusion_url"],
            max_concurrent=config["rate_limit"],
            memory_limit_mb=config["memory_limit_mb"],
            name="tool-" + re.sub(r"[^\w.-]", "_", tool_schema["function"]["name"]),
        )

    def execute(self, parameters: dict, **kwargs) -> str:
        language, timeout = parameters.get("language", self.language), parameters.get("timeout", self.timeout_s)
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r} is not one the sandbox runs: {', '.join(LANGUAGES)}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= self.timeout_s:
            raise ValueError(f"timeout must be a number of seconds, more than 0 and at most {self.timeout_s:g}")
        try:
            run = self.client.run_code(str(parameters["code"]), language=language, run_timeout=timeout)
        except SandboxFusionError as exc:
            if exc.kind == "timeout":
                raise ToolTimeout(f"the sandbox did not answer in time: {exc}") from None
            raise
        if run.compile_status == "TimeLimitExceeded":
            raise ToolTimeout(f"the compilation ran past {timeout:g} s on the sandbox and was stopped")
        if run.run_status is None:
            return f"{run.compile_stderr or ''}\n(compilation failed, exit status {run.compile_return_code})"
        if run.run_status == "TimeLimitExceeded":
            raise ToolTimeout(
                f"the code ran past {timeout:g} s on the sandbox and was stopped; its output until then:\n{run.output}"
            )
        if run.return_code:
            return f"{run.output}\n(exit status {run.return_code})"
        return run.output


_SANDBOX_FUSION_DEFAULTS = {"default_language": "python", "memory_limit_mb": 1024, "rate_limit": 10}


def sandbox_fusion_config(config: dict, tool_timeout: float) -> tuple[dict, list[tuple[str, str]]]:
    """``dsrl:sandbox_fusion``'s config with its defaults, and its problems as ``(what, fix)``: verl's keys, each
    honoured or refused with the reason.

    - ``sandbox_fusion_url``: the server's ``/run_code`` URL; required.
    - ``default_timeout``: the run's limit on the server, in seconds; below ``multi_turn.tool_timeout`` (past it the
      worker is killed before the server answers); default 0.8 x ``tool_timeout`` (verl's 30 s is past dsrl's
      default tool_timeout of 10 s).
    - ``default_language`` (python), ``memory_limit_mb`` (1024): the run's language and memory on the server.
    - ``rate_limit`` (10): calls in flight at most, over the tool workers of one rank.
    - ``enable_global_rate_limit``: false only; verl's true counts ``rate_limit`` over the whole cluster.
    - ``num_workers``: refused; each call runs in a tool worker process of its own.
    - ``type``: native only (verl's tool registry reads it; ``mcp`` is another kind of tool).
    """
    config = {"default_timeout": 0.8 * tool_timeout, **_SANDBOX_FUSION_DEFAULTS, **config}
    keys = sorted(
        ["sandbox_fusion_url", "default_timeout", "enable_global_rate_limit", "type", *_SANDBOX_FUSION_DEFAULTS]
    )
    problems = []
    for key in sorted(set(config) - set(keys)):
        if key == "num_workers":
            problems.append(
                (
                    "config.num_workers is the size of verl's Ray thread pool for the tool; dsrl runs each call in a "
                    "tool worker process (one call a worker, as many workers as the rollout's tool pool has)",
                    "remove it; rate_limit bounds the calls in flight",
                )
            )
        else:
            problems.append((f"config.{key} is not a key of this tool", f"remove it; the keys are {', '.join(keys)}"))
    url = config.get("sandbox_fusion_url")
    problem = url_problem(url)
    if problem:
        problems.append((f"config.sandbox_fusion_url={url!r} {problem}", "set it to the server's /run_code URL"))
    timeout = config["default_timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < tool_timeout:
        problems.append(
            (
                f"config.default_timeout={timeout!r} must be a number of seconds below multi_turn.tool_timeout="
                f"{tool_timeout:g} (past that the worker is killed before the server answers)",
                "lower it, or leave it out for 0.8 x tool_timeout",
            )
        )
    if config["default_language"] not in LANGUAGES:
        problems.append(
            (
                f"config.default_language={config['default_language']!r} is not one the sandbox runs",
                f"use one of {', '.join(LANGUAGES)}",
            )
        )
    for key in ("memory_limit_mb", "rate_limit"):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(
                (f"config.{key}={value!r} must be an integer >= 1", f"set it to {_SANDBOX_FUSION_DEFAULTS[key]}")
            )
    if config.get("enable_global_rate_limit", False) is not False:
        problems.append(
            (
                f"config.enable_global_rate_limit={config['enable_global_rate_limit']!r}: verl counts rate_limit over "
                "the whole cluster; dsrl counts it per rank (R ranks may have R x rate_limit calls in flight)",
                "set it to false (or leave it out), with rate_limit the server's capacity divided by the ranks",
            )
        )
    if config.get("type", "native") != "native":
        problems.append(
            (
                f"config.type={config['type']!r}: this is a native tool (verl's mcp type talks to an MCP server)",
                "set type: native, or leave it out",
            )
        )
    return config, problems


BUILTINS = {"dsrl:calculator": Calculator, "dsrl:python": PythonInterpreter, "dsrl:sandbox_fusion": SandboxFusionTool}
