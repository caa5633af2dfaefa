"""The tools of multi-turn rollouts without worker processes: hermes parsing, truncation, the calculator,
schemas from functions, argument checks and the tool files' problems (tests/rollout/test_tool_pool.py runs them)."""

from __future__ import annotations

import textwrap

import pytest

from dsrl.rollout.tools import ToolCall, check_tool_files, function_schema, load_tool_specs, parse_tool_calls, truncate
from dsrl.rollout.tools.builtin import Calculator
from dsrl.rollout.tools.specs import argument_problem
from tests.helpers.tools import tool_run_config

KEY = "actor_rollout_ref.rollout.multi_turn"


def config(tool_config_path=None, function_tool_path=None, **multi_turn):
    """A run config with what the tools read."""
    limits = dict(function_tool_path=function_tool_path, tool_timeout=5.0, max_tool_response_length=256)
    return tool_run_config(tool_config_path, **{**limits, **multi_turn})


# ---------------------------------------------------------------- hermes


def test_one_call_with_text_around_it():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "123*456"})], [])


def test_several_calls_in_one_turn_in_order_whitespace_optional():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>  {"name": "b", "arguments": {}}\n\n</tool_call>\n<tool_call>{"name": "c"}</tool_call>'
    )
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {})] and errors == []


def test_no_call_is_no_call():
    assert parse_tool_calls("The answer is 42.") == ([], [])


@pytest.mark.parametrize(
    "block, message",
    [
        ('{"name": "a", "arguments": {"x": 1}', "is not valid JSON"),
        ('["a"]', "must hold a JSON object, got list"),
        ('{"arguments": {}}', 'has no "name" string'),
        ('{"name": "a", "arguments": "x=1"}', "\"arguments\" of tool call 'a' must be a JSON object"),
    ],
)
def test_each_malformed_block_gives_one_message_and_the_good_calls_stay(block, message):
    text = f'<tool_call>{block}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("ok", {})]
    assert len(errors) == 1 and message in errors[0]


def test_an_unclosed_block_is_an_error():
    calls, errors = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}')
    assert calls == [] and errors == ["the <tool_call> block is not closed: write </tool_call> after the JSON object"]


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match=r"multi_turn.format='xml': known formats: \['hermes'\]"):
        parse_tool_calls("", format="xml")


# ---------------------------------------------------------------- truncation (verl's marks)


def test_truncation_sides():
    text = "abcdefghij"
    assert truncate(text, 10, "left") == text
    assert truncate(text, 4, "left") == "(truncated)...ghij"
    assert truncate(text, 4, "right") == "abcd...(truncated)"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, output",
    [
        ("123*456", "56088"),
        ("7/2", "3.5"),
        ("6/3", "2.0"),
        ("(2+3)**2 - -1", "26"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("0.1+0.2", "0.30000000000000004"),
        ("2**-1", "0.5"),
        (" 10 ", "10"),
    ],
)
def test_calculator_values(expression, output):
    assert Calculator({}, {}).execute({"expression": expression}) == output


@pytest.mark.parametrize(
    "expression, error, match",
    [
        ("__import__('os')", ValueError, "is not allowed"),
        ("abs(-1)", ValueError, "is not allowed"),
        ("x + 1", ValueError, "is not allowed"),
        ("'a' * 3", ValueError, "is not allowed"),
        ("9**9**9", ValueError, "digits"),
        ("(10**3000) * (10**3000)", ValueError, "digits"),
        ("1/0", ZeroDivisionError, "division by zero"),
        ("2 +", ValueError, "not an arithmetic expression"),
        ("10.0**400", OverflowError, "too large|out of range"),
    ],
)
def test_calculator_refuses(expression, error, match):
    with pytest.raises(error, match=match):
        Calculator({}, {}).execute({"expression": expression})


# ---------------------------------------------------------------- schemas and arguments


def test_function_schema_from_signature_and_google_docstring():
    def search(query: str, limit: int = 5, exact: bool | None = None, tags: list[str] = (), extra: dict = None):
        """Search the notes.

        Finds notes whose text matches.

        Args:
            query: what to look for,
                in plain words.
            limit (int): at most this many.

        Returns:
            the notes.
        """

    assert function_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for, in plain words."},
                    "limit": {"type": "integer", "description": "at most this many."},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "extra": {"type": "object"},
                },
                "required": ["query"],
            },
        },
    }


SCHEMA = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "s": {"type": "string"}},
            "required": ["n"],
        },
    },
}


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"n": 1}, None),
        ({"n": 1, "x": 2.5, "s": "a"}, None),
        ({"n": 1, "x": None}, None),
        ({}, "tool 'f' needs the argument(s) ['n']; it takes (n: integer, x: ['number', 'null'], s: string)"),
        ({"n": 1, "m": 2}, "tool 'f' takes no argument(s) ['m']"),
        ({"n": True}, "tool 'f': argument 'n' must be integer, got true"),
        ({"n": 1.5}, "tool 'f': argument 'n' must be integer, got 1.5"),
        ({"n": 1, "s": 3}, "tool 'f': argument 's' must be string, got 3"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments, problem):
    found = argument_problem(SCHEMA, arguments)
    assert found == problem if problem is None else found.startswith(problem), found


# ---------------------------------------------------------------- check_tool_files


def write(path, text):
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


def test_good_files_have_no_problems(tmp_path):
    write(
        tmp_path / "my_tools.py",
        """
        class Echo:
            def __init__(self, config, tool_schema):
                self.prefix = config.get("prefix", "")

            def execute(self, parameters, **kwargs):
                return self.prefix + parameters["text"]
        """,
    )
    yaml_path = write(
        tmp_path / "tools.yaml",
        """
        tools:
          - class_name: dsrl:calculator
          - class_name: dsrl:python
            config: {timeout: 2}
          - class_name: my_tools.py:Echo
            config: {prefix: "> "}
            tool_schema:
              type: function
              function:
                name: echo
                description: Echo the text.
                parameters: {type: object, properties: {text: {type: string}}, required: [text]}
        """,
    )
    functions = write(
        tmp_path / "fns.py",
        '''
        import os
        from os.path import join

        def add(a: int, b: int) -> str:
            """Add two integers."""
            return str(a + b)

        def _helper(x):
            return x
        ''',
    )
    assert check_tool_files(config(yaml_path, functions)) == []


@pytest.mark.parametrize(
    "yaml_text, line, what, fix",
    [
        ("tools: [\n  {class_name: a\n", 3, "not valid YAML", "correct the YAML syntax"),
        ("tool: []\n", 1, "no 'tools' list at the top", "write tools: [{class_name: dsrl:calculator}"),
        ("tools:\n  - class_name: dsrl:calculator\n  - config: {}\n", 3, "tool 1 has no class_name", "write tools:"),
        (
            "tools:\n  - class_name: dsrl:shell\n",
            2,
            "unknown built-in tool 'dsrl:shell'",
            "use one of ['dsrl:calculator', 'dsrl:python', 'dsrl:sandbox_fusion']",
        ),
        (
            "tools:\n  - class_name: no_such_module_xyz.Tool\n  ",
            2,
            "cannot import 'no_such_module_xyz'",
            "put its folder on PYTHONPATH, or write path/to/file.py:Class",
        ),
        (
            "tools:\n  - class_name: dsrl:python\n    config: {timeout: 5}\n",
            2,
            "dsrl:python config.timeout=5 must be a number of seconds below multi_turn.tool_timeout=5",
            "lower it, or leave it out for 0.8 x tool_timeout",
        ),
        (
            "tools:\n  - class_name: dsrl:python\n    config: {sandbox: docker}\n",
            2,
            "dsrl:python config.sandbox='docker' must be bubblewrap or none",
            "leave it out for bubblewrap",
        ),
        (
            "tools:\n  - class_name: dsrl:python\n    config: {memory_limit_mb: 100}\n",
            2,
            "dsrl:python config.memory_limit_mb=100 must be a whole number of MB, 0 (no limit) or >= 256",
            "set it to 1024, or leave it out for 1024",
        ),
        (
            "tools:\n  - class_name: dsrl:python\n    config: {network: 'yes'}\n",
            2,
            "dsrl:python config.network='yes' must be true or false",
            "set network: true, or remove it",
        ),
        (
            "tools:\n  - class_name: dsrl:python\n    config: {sandbox: none, gpus: false}\n",
            2,
            "dsrl:python config.gpus is a setting of the sandbox; with config.sandbox: none the code has",
            "remove config.gpus, or the sandbox: none",
        ),
        (
            "tools:\n  - class_name: dsrl:python\n    config: {timeout: 2, sandbx: none}\n",
            2,
            "dsrl:python config has no key(s) ['sandbx']",
            "correct or remove them",
        ),
        (
            "tools:\n  - class_name: dsrl:calculator\n  - class_name: dsrl:calculator\n",
            None,
            "two tools are named 'calculator'",
            "rename one",
        ),
    ],
)
def test_tool_yaml_problems_name_the_file_line_and_fix(tmp_path, yaml_text, line, what, fix):
    path = write(tmp_path / "tools.yaml", yaml_text)
    [problem] = check_tool_files(config(path))
    if line is not None:
        assert problem.startswith(f"{KEY}.tool_config_path={path}: {path}:{line}: "), problem
    assert what in problem and f"; fix: {fix}" in problem, problem


def test_a_class_without_schema_and_one_whose_file_fails_to_import(tmp_path):
    write(
        tmp_path / "broken.py",
        """
        import os

        raise RuntimeError("no API key")
        """,
    )
    write(
        tmp_path / "fine.py",
        """
        class Tool:
            def execute(self, parameters):
                return ""
        """,
    )
    path = write(
        tmp_path / "tools.yaml",
        """
        tools:
          - class_name: broken.py:Tool
          - class_name: fine.py:Tool
        """,
    )
    broken, no_schema = check_tool_files(config(path))
    assert broken.startswith(
        f"{KEY}.tool_config_path={path}: {tmp_path / 'broken.py'}:3: importing it raised "
        "RuntimeError: no API key; fix: "
    ), broken
    assert no_schema.startswith(f"{KEY}.tool_config_path={path}: {path}:3: tool 'fine.py:Tool': no tool_schema; fix:")


def test_a_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    [problem] = check_tool_files(config(missing))
    assert problem.startswith(
        f"{KEY}.tool_config_path={missing}: {missing}: cannot read it (No such file or directory); fix:"
    )
    [problem] = check_tool_files(config(function_tool_path=str(tmp_path / "nope.py")))
    assert "no such file" in problem and "; fix: correct the path" in problem


@pytest.mark.parametrize(
    "source, line, what",
    [
        ("def f(x: int) -> str:\n    return x +\n", 2, "importing it raised SyntaxError"),
        ("import os\nimport no_such_module_xyz\n", 2, "importing it raised ModuleNotFoundError"),
        ("def f(x: int):\n    return ''\n", 1, "function f has no docstring"),
        ('\n\ndef f(x, y: int):\n    """F."""\n', 3, "function f: parameter 'x' has no type annotation"),
        ('def f(*xs: int):\n    """F."""\n', 1, "function f: *xs has no place in a JSON schema"),
        ('def f(x: set):\n    """F."""\n', 1, "function f: parameter 'x': <class 'set'> has no JSON type"),
        ("import os\n", None, "defines no public function"),
    ],
)
def test_function_file_problems_name_the_line(tmp_path, source, line, what):
    path = str(tmp_path / "fns.py")
    (tmp_path / "fns.py").write_text(source)
    [problem] = check_tool_files(config(function_tool_path=path))
    where = f"{path}:{line}" if line else path
    assert problem.startswith(f"{KEY}.function_tool_path={path}: {where}: {what}"), problem
    assert "; fix: " in problem


def test_a_function_named_like_a_yaml_tool(tmp_path):
    path = write(tmp_path / "tools.yaml", "tools:\n  - class_name: dsrl:calculator\n")
    functions = write(
        tmp_path / "fns.py",
        '''
        def calculator(expression: str) -> str:
            """Mine."""
        ''',
    )
    [problem] = check_tool_files(config(path, functions))
    assert problem.startswith(f"{KEY}: two tools are named 'calculator' (dsrl:calculator and {functions})")


# ---------------------------------------------------------------- dsrl:sandbox_fusion's config (verl's keys)

SANDBOX = "http://localhost:8080/run_code"


def test_sandbox_fusion_takes_verls_keys_and_fills_the_defaults(tmp_path):
    path = write(
        tmp_path / "tools.yaml",
        f"""
        tools:
          - class_name: dsrl:sandbox_fusion
            config: {{sandbox_fusion_url: {SANDBOX}, type: native, enable_global_rate_limit: false}}
          - class_name: dsrl:sandbox_fusion
            config:
              sandbox_fusion_url: {SANDBOX}
              default_timeout: 4
              default_language: cpp
              memory_limit_mb: 512
              rate_limit: 3
            tool_schema:
              type: function
              function:
                name: run_cpp
                description: Run C++.
                parameters: {{type: object, properties: {{code: {{type: string}}}}, required: [code]}}
        """,
    )
    (default, cpp), problems = load_tool_specs(config(path).actor_rollout_ref.rollout.multi_turn)
    assert problems == []
    assert default.name == "code_interpreter" and default.schema["function"]["parameters"]["required"] == ["code"]
    assert default.config == {
        "sandbox_fusion_url": SANDBOX,
        "type": "native",
        "enable_global_rate_limit": False,
        "default_timeout": 4.0,  # 0.8 x tool_timeout (5 s here)
        "default_language": "python",
        "memory_limit_mb": 1024,
        "rate_limit": 10,
    }
    assert cpp.name == "run_cpp"
    assert (cpp.config["default_timeout"], cpp.config["default_language"], cpp.config["rate_limit"]) == (4, "cpp", 3)


@pytest.mark.parametrize(
    "settings, what, fix",
    [
        ("{}", "config.sandbox_fusion_url=None must be the URL of the server's /run_code endpoint", "set it to"),
        (
            "{sandbox_fusion_url: localhost:8080}",
            "config.sandbox_fusion_url='localhost:8080' must be an http:// or https:// URL with a host",
            "set it to the server's /run_code URL",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, default_timeout: 30}}",
            "config.default_timeout=30 must be a number of seconds below multi_turn.tool_timeout=5",
            "lower it, or leave it out for 0.8 x tool_timeout",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, num_workers: 10}}",
            "config.num_workers is the size of verl's Ray thread pool for the tool; dsrl runs each call in a tool "
            "worker",
            "remove it; rate_limit bounds the calls in flight",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, enable_global_rate_limit: true}}",
            "config.enable_global_rate_limit=True: verl counts rate_limit over the whole cluster; dsrl counts it "
            "per rank",
            "set it to false (or leave it out)",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, rate_limit: 0}}",
            "config.rate_limit=0 must be an integer >= 1",
            "set it to 10",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, memory_limit_mb: 1.5}}",
            "config.memory_limit_mb=1.5 must be an integer >= 1",
            "set it to 1024",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, default_language: Python}}",
            "config.default_language='Python' is not one the sandbox runs",
            "use one of python, cpp,",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, type: mcp}}",
            "config.type='mcp': this is a native tool",
            "set type: native",
        ),
        (
            f"{{sandbox_fusion_url: {SANDBOX}, timeout: 5}}",
            "config.timeout is not a key of this tool",
            "remove it; the keys are default_language, default_timeout, enable_global_rate_limit, memory_limit_mb",
        ),
    ],
)
def test_sandbox_fusion_refuses_what_it_does_not_do(tmp_path, settings, what, fix):
    path = write(tmp_path / "tools.yaml", f"tools:\n  - class_name: dsrl:sandbox_fusion\n    config: {settings}\n")
    [problem] = check_tool_files(config(path))
    assert problem.startswith(f"{KEY}.tool_config_path={path}: {path}:2: dsrl:sandbox_fusion {what}"), problem
    assert f"; fix: {fix}" in problem, problem


def test_verls_class_path_names_the_built_in(tmp_path):
    path = write(
        tmp_path / "tools.yaml",
        f"""
        tools:
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {{sandbox_fusion_url: {SANDBOX}}}
        """,
    )
    [problem] = check_tool_files(config(path))
    assert problem == (
        f"{KEY}.tool_config_path={path}: {path}:2: verl.tools.sandbox_fusion_tools.SandboxFusionTool is verl's tool, "
        "which dsrl has built in; fix: write class_name: dsrl:sandbox_fusion (it reads the same config keys)"
    )
