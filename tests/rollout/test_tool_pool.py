"""ToolSet.run with real worker processes (the reward scorer's pool): each failure kind counted with an
error text, the python tool's limits, user tool classes and functions, no process left behind."""

from __future__ import annotations

import os
import re
import textwrap
import time

import pytest

from dsrl.rollout.tools import TOOL_FAILURE_KINDS, ToolCall, ToolRequest, ToolSet
from tests.helpers.processes import live, wait_gone, with_argument
from tests.helpers.tools import tool_run_config

TOOL_TIMEOUT = 3.0

FUNCTIONS = '''
import os
import subprocess
import sys
import time


def add(a: int, b: int = 2) -> str:
    """Add two integers."""
    return str(a + b)


def fails(x: int) -> str:
    """Raises."""
    return str(1 // x)


def exits() -> str:
    """Calls sys.exit inside the tool."""
    sys.exit(3)


def dies() -> str:
    """Kills its worker."""
    os._exit(7)


def hog() -> str:
    """Allocates past the workers' memory limit."""
    return str(len(bytearray(3 * 2**30)))


def number() -> str:
    """Returns no text."""
    return 42


def verl_style(text: str) -> str:
    """A (text, reward, metrics) tuple, as verl's function tools may return."""
    return (text, 1.0, {"m": 1})


def imported_torch() -> str:
    """Whether this worker imported torch."""
    return str("torch" in sys.modules)


def hangs(pid_file: str) -> str:
    """Starts a child, then sleeps past the pool's limit."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
'''

CLASSES = '''
import asyncio


class Greeter:
    """A user tool class; execute is async, as verl's are."""

    def __init__(self, config, tool_schema):
        self.greeting = config["greeting"]

    async def execute(self, parameters, **kwargs):
        await asyncio.sleep(0)
        return f"{self.greeting}, {parameters['name']}{kwargs.get('suffix', '')}"


class Response:
    def __init__(self, text):
        self.text = text


class Responder:
    def __init__(self, config, tool_schema):
        pass

    def execute(self, parameters, **kwargs):
        return Response("from .text")
'''

YAML = """
tools:
  - class_name: dsrl:calculator
  - class_name: dsrl:python
    config: {memory_limit_mb: 256}
  - class_name: classes.py:Greeter
    config: {greeting: Hello}
    tool_schema:
      type: function
      function:
        name: greet
        description: Greet someone.
        parameters: {type: object, properties: {name: {type: string}}, required: [name]}
  - class_name: classes.py:Responder
    tool_schema:
      type: function
      function: {name: respond, description: Respond., parameters: {type: object, properties: {}}}
"""


def run_config(tmp_path, **multi_turn):
    (tmp_path / "functions.py").write_text(FUNCTIONS)
    (tmp_path / "classes.py").write_text(CLASSES)
    (tmp_path / "tools.yaml").write_text(YAML)
    functions = dict(function_tool_path=str(tmp_path / "functions.py"), tool_timeout=TOOL_TIMEOUT)
    return tool_run_config(tmp_path / "tools.yaml", **{**functions, **multi_turn})


@pytest.fixture(scope="module")
def toolset(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tools")
    with ToolSet.from_config(run_config(tmp_path), log_file=tmp_path / "tool_workers.log") as tools:
        yield tools


def call(tool, **arguments):
    return ToolRequest(ToolCall(tool, arguments))


def test_schemas_are_the_yaml_ones_then_the_functions(toolset):
    names = [schema["function"]["name"] for schema in toolset.schemas]
    assert names == [
        "calculator",
        "python",
        "greet",
        "respond",
        "add",
        "fails",
        "exits",
        "dies",
        "hog",
        "number",
        "verl_style",
        "imported_torch",
        "hangs",
    ]


def test_the_workers_import_no_torch(toolset):
    assert toolset.run([call("imported_torch")])[0].text == "False"


def test_each_failure_kind_gives_an_error_text_and_the_others_go_on(toolset):
    requests = [
        call("calculator", expression="123*456"),
        call("nope"),
        call("add", a="1"),
        call("fails", x=0),
        call("exits"),
        call("number"),
        call("dies"),
        call("hog"),
        call("add", a=40),
    ]
    results = toolset.run(requests)
    assert [r.failure for r in results] == [
        None,
        "parse",
        "parse",
        "exception",
        "exception",
        "invalid",
        "crash",
        "exception",
        None,
    ]
    assert set(r.failure for r in results) - {None} <= set(TOOL_FAILURE_KINDS)
    assert results[0].text == "56088" and results[-1].text == "42"
    assert results[1].text.startswith("Unknown tool 'nope'; the tools are ['add', 'calculator', 'dies',")
    assert results[2].text == "tool 'add': argument 'a' must be integer, got \"1\""
    assert results[3].text == (
        "Error executing tool 'fails': ZeroDivisionError: integer division or modulo by zero (at functions.py:15 in "
        "fails)"
    )
    assert results[4].text == "Error executing tool 'exits': called sys.exit(3)"
    assert results[5].text.startswith(
        "Error executing tool 'number': tool 'number' returned int 42; it must return a str"
    )
    assert results[6].text.startswith("Error executing tool 'dies': the tool worker died (exit code 7) in this call")
    assert results[7].text.startswith("Error executing tool 'hog': MemoryError (at functions.py:")
    assert results[7].text.endswith("(actor_rollout_ref.rollout.multi_turn.tool_memory_limit_mb=2048)")
    assert all(r.seconds >= 0 for r in results)


def test_verl_style_results_and_user_classes(toolset):
    requests = [
        call("verl_style", text="tuple"),
        call("respond"),
        call("greet", name="Ada"),
        ToolRequest(ToolCall("greet", {"name": "Bo"}), {"greet": {"create_kwargs": {"suffix": "!"}}, "other": {}}),
    ]
    assert [r.text for r in toolset.run(requests)] == ["tuple", "from .text", "Hello, Ada", "Hello, Bo!"]


def test_a_call_past_tool_timeout_is_killed_with_what_it_started(toolset, tmp_path):
    pid_file = tmp_path / "child.pid"
    workers = set(toolset.worker_pids())
    start = time.monotonic()
    hung, fine = toolset.run([call("hangs", pid_file=str(pid_file)), call("add", a=1)])
    assert TOOL_TIMEOUT <= time.monotonic() - start < TOOL_TIMEOUT + 5
    assert hung.failure == "timeout" and fine.text == "3"
    assert hung.text == (
        f"Error executing tool 'hangs': ran past actor_rollout_ref.rollout.multi_turn.tool_timeout={TOOL_TIMEOUT:g} s "
        "and was stopped"
    )
    assert wait_gone([int(pid_file.read_text())]) == []
    assert toolset.run([call("add", a=2)])[0].text == "4"  # a new worker took the killed one's place
    assert set(toolset.worker_pids()) != workers


# ---------------------------------------------------------------- the python tool


def python(toolset, code):
    [result] = toolset.run([call("python", code=textwrap.dedent(code))])
    return result


def test_python_prints_and_exit_status(toolset):
    assert python(toolset, "print(6 * 7)").text == "42\n"
    result = python(toolset, "import sys\nprint('partial')\nsys.exit(2)")
    assert result.failure is None and result.text == "partial\n\n(exit status 2)"
    result = python(toolset, "1/0")
    assert result.failure is None and "ZeroDivisionError" in result.text and result.text.endswith("(exit status 1)")


def test_python_sees_none_of_the_trainers_environment(toolset):
    assert python(toolset, "import os; print(sorted(os.environ))").text == "['HOME', 'LANG', 'PATH']\n"


def test_python_runs_in_a_fresh_directory_removed_afterwards(toolset):
    first = python(toolset, "import os; open('x', 'w').write('1'); print(os.getcwd())").text.strip()
    second = python(toolset, "import os; print(os.getcwd(), os.listdir('.'))").text.strip()
    assert not os.path.exists(first) and first != second.split()[0] and second.endswith("['main.py']")


def test_python_past_its_limit_is_killed_with_its_children(toolset):
    # Its own limit (0.8 x tool_timeout) ends it first: counted as a timeout, no process left. The code's pids
    # are its pid namespace's, so the host finds its child by an argument.
    marker = f"child-of-{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    result = python(
        toolset,
        f"""
        import subprocess, sys, os, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
        print(os.getpid(), child.pid)
        time.sleep(600)
    """,
    )
    assert time.monotonic() - start < TOOL_TIMEOUT
    assert result.failure == "timeout"
    assert f"the code ran past {0.8 * TOOL_TIMEOUT:g} s and was killed; its output until then:" in result.text
    pids = [int(p) for p in re.findall(r"\b\d+\b", result.text.split("until then:")[1])]
    assert len(pids) == 2 and wait_gone(with_argument(marker)) == []


def test_python_memory_limit(toolset):
    result = python(toolset, "x = bytearray(512 * 2**20)\nprint('allocated')")
    assert "MemoryError" in result.text and "allocated" not in result.text


def test_python_megabytes_of_output_are_cut(toolset):
    start = time.monotonic()
    result = python(toolset, "import sys\nfor _ in range(50): sys.stdout.write('x' * 2**20)\nprint('END')")
    assert time.monotonic() - start < 5
    assert result.failure is None and len(result.text) < 300
    assert result.text.startswith("x" * 100) and "...(truncated)..." in result.text and result.text.endswith("END\n")


# ---------------------------------------------------------------- start and end


def test_close_leaves_no_process(tmp_path):
    tools = ToolSet.from_config(run_config(tmp_path))
    pids = tools.worker_pids()
    assert len(live(pids)) == len(pids) > 0
    tools.close()
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="after close"):
        tools.run([call("add", a=1)])


def test_a_tool_that_cannot_be_built_fails_at_start(tmp_path):
    cfg = run_config(tmp_path, function_tool_path=None)
    (tmp_path / "bad.py").write_text(
        "class Bad:\n    def __init__(self, config, tool_schema):\n        raise KeyError('url')\n"
        "    def execute(self, parameters):\n        return ''\n"
    )
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: bad.py:Bad\n    tool_schema: {type: function, function: {name: bad}}\n"
    )
    with pytest.raises(
        ValueError, match=r"tool 'bad' \(bad.py:Bad\) could not be built in a worker:(.|\n)*KeyError: 'url'"
    ):
        ToolSet.from_config(cfg)


def test_bad_tool_files_fail_before_any_worker_starts(tmp_path):
    cfg = run_config(tmp_path)
    (tmp_path / "functions.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(ValueError, match=r"function_tool_path=.*functions.py:1: function f has no docstring"):
        ToolSet.from_config(cfg)
