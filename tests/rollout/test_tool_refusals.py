"""The built-in tools' limits and the tool files' refusals on the inputs of security_3 (sections C and D) and
more: the calculator's size guard is exact and speaks to the model, a built-in's config and schema are
checked at validation (also when it is named by its module path), a function file must be a .py file."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dsrl.rollout.tools.builtin import Calculator
from dsrl.rollout.tools.specs import load_tool_specs


def calculate(expression: str) -> str:
    return Calculator({}, {}).execute({"expression": expression})


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, digits",
    [
        ("2**9999", 3010),
        ("10**3009", 3010),
        ("(-2)**9999", 3010),  # and its sign
        ("9*10**3009 + (10**3009 - 1)", 3010),
        ("(-1)**(10**3000)", 1),
        ("2**-10000", None),  # a float
    ],
)
def test_the_calculator_computes_up_to_3010_digits(expression, digits):
    result = calculate(expression)
    if digits is not None:
        assert len(result.lstrip("-")) == digits


@pytest.mark.parametrize(
    "expression, message",
    [
        ("7**5000", "the result would have about 4225 digits; at most 3010 are allowed"),  # security_3 C2: 4226 digits
        ("3**6400", "the result would have about 3054 digits"),
        ("2**10000", "the result has more than 3010 digits; at most 3010 are allowed"),  # 3011 digits
        ("10**3010", "the result has more than 3010 digits"),
        ("10**3009 * 10", "the result has more than 3010 digits"),
        ("9*10**3009 + 10**3009", "the result has more than 3010 digits"),
        ("-(10**3009) * 10", "the result has more than 3010 digits"),
        ("1" + "0" * 3010, "a number in it has more than 3010 digits"),
        ("0x" + "f" * 3000, "a number in it has more than 3010 digits"),  # 3613 digits, written in hex
        ("9" * 5000, "a number in it has more than 3010 digits; at most 3010 are allowed"),  # security_3 C10
        ("1+" * 1500 + "1", "too deeply nested; write it with fewer operators in a row"),
        ("-" * 100_000 + "1", "too deeply nested"),
        ("1" + "**1" * 5000, "too deeply nested"),
    ],
)
def test_the_calculator_refuses_past_3010_digits_in_words_for_the_model(expression, message):
    with pytest.raises(ValueError) as refused:
        calculate(expression)
    assert message in str(refused.value)
    assert "set_int_max_str_digits" not in str(refused.value)


def test_the_size_guard_is_exact_at_the_boundary_for_every_base():
    """Each base from 2 to 99, at the largest exponent that fits and the one after: the first is computed, the
    second refused (the old guard, bit_length - 1 per power, let 7**5000's 4226 digits through)."""
    for base in range(2, 100):
        largest = math.floor(3009 / math.log10(base) + 1e-9)  # base**largest has at most 3010 digits
        while len(str(base ** (largest + 1))) <= 3010:
            largest += 1
        assert len(calculate(f"{base}**{largest}")) <= 3010
        with pytest.raises(ValueError, match="digits; at most 3010 are allowed"):
            calculate(f"{base}**{largest + 1}")


# ---------------------------------------------------------------- the tool YAML


def problems_of(tmp_path, yaml_text: str, tool_timeout: float = 10.0) -> list[str]:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml_text)
    multi_turn = SimpleNamespace(tool_config_path=str(path), function_tool_path=None, tool_timeout=tool_timeout)
    return load_tool_specs(multi_turn)[1]


def schema(name: str, parameter: str, kind: str = "string") -> str:
    return (
        f"{{type: function, function: {{name: {name}, description: d, parameters: {{type: object, "
        f"properties: {{{parameter}: {{type: {kind}}}}}, required: [{parameter}]}}}}}}"
    )


@pytest.mark.parametrize(
    "entry, what",
    [
        # security_3 D13: every call failed with KeyError: 'expression'
        (
            f"class_name: dsrl:calculator\n    tool_schema: {schema('calculator', 'expr')}",
            "tool 'dsrl:calculator': tool_schema.function.parameters must require 'expression' (string), which "
            "dsrl:calculator reads; it has (expr: string); "
            "fix: keep dsrl:calculator's parameters: (expression: string)",
        ),
        (
            f"class_name: dsrl:python\n    tool_schema: {schema('run', 'code', 'integer')}",
            "must require 'code' (string), which dsrl:python reads; it has (code: integer)",
        ),
        # D14: the built-in by its module path skipped the dsrl:python rules
        (
            "class_name: dsrl.rollout.tools.builtin.PythonInterpreter\n    config: {timeout: 100}",
            "dsrl:python config.timeout=100 must be a number of seconds below multi_turn.tool_timeout=10",
        ),
        # D15, D16
        (
            "class_name: dsrl:python\n    config: {memory_limit_mb: -5}",
            "dsrl:python config.memory_limit_mb=-5 must be a whole number of MB, 0 (no limit) or >= 256",
        ),
        ("class_name: dsrl:python\n    config: {memory_limit_mb: abc}", "config.memory_limit_mb='abc' must be"),
        ("class_name: dsrl:python\n    config: {memory_limit_mb: 10}", "config.memory_limit_mb=10 must be"),
        ("class_name: dsrl:python\n    config: {memory_limit_mb: 512.5}", "config.memory_limit_mb=512.5 must be"),
        ("class_name: dsrl:python\n    config: {memory_limit_mb: true}", "config.memory_limit_mb=True must be"),
        ("class_name: dsrl:python\n    config: {timeout: .nan}", "config.timeout=nan must be a number of seconds"),
        ("class_name: dsrl:python\n    config: {timeout: true}", "config.timeout=True must be a number of seconds"),
        # A key a built-in does not read (a typo) was ignored
        (
            "class_name: dsrl:python\n    config: {memory_limt_mb: 512}",
            "dsrl:python config has no key(s) ['memory_limt_mb']; it reads ['type', 'timeout', 'memory_limit_mb', "
            "'sandbox', 'network', 'gpus']",
        ),
        (
            "class_name: dsrl:calculator\n    config: {precision: 3}",
            "dsrl:calculator config has no key(s) ['precision']",
        ),
        # Schemas the trainer would fail to read at the first call (argument_problem)
        (
            "class_name: m.T\n    tool_schema: {type: function, function: {name: t, parameters: {type: object, "
            "properties: [a, b]}}}",
            "parameters.properties must map each parameter's name to its JSON schema",
        ),
        (
            "class_name: m.T\n    tool_schema: {type: function, function: {name: t, parameters: {type: object, "
            "properties: {a: {type: {x: 1}}}}}}",
            "the type of parameter 'a' must be a JSON type name or a list of them, got {'x': 1}",
        ),
        (
            "class_name: m.T\n    tool_schema: {type: function, function: {name: t, parameters: {type: object, "
            "properties: {a: {type: string}}, required: a}}}",
            "parameters.required must be a list of parameter names",
        ),
    ],
)
def test_a_built_in_s_config_and_any_tool_s_schema_are_checked_at_validation(tmp_path, monkeypatch, entry, what):
    (tmp_path / "m.py").write_text(
        "class T:\n    def __init__(self, config, schema): pass\n    def execute(self, p): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = problems_of(tmp_path, f"tools:\n  - {entry}\n")
    assert len(problems) == 1 and what in problems[0], problems
    assert problems[0].startswith(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}: ")
    assert "; fix: " in problems[0]


def test_a_built_in_named_by_its_module_path_is_the_built_in(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: dsrl.rollout.tools.builtin.PythonInterpreter\n"
        "  - class_name: dsrl.rollout.tools.builtin.Calculator\n    config: {type: native}\n"
    )
    multi_turn = SimpleNamespace(tool_config_path=str(path), function_tool_path=None, tool_timeout=10.0)
    specs, problems = load_tool_specs(multi_turn)
    assert not problems
    # the worker builds dsrl:python with its timeout (security_3 D14: KeyError 'timeout' in a worker without it)
    assert [(s.source, s.config) for s in specs] == [
        ("dsrl:python", {"timeout": 8.0}),
        ("dsrl:calculator", {"type": "native"}),
    ]


@pytest.mark.parametrize(
    "entry",
    [
        f"class_name: dsrl:calculator\n    tool_schema: {schema('calc', 'expression')}",  # renamed: fine
        "class_name: dsrl:python\n    config: {memory_limit_mb: 0, timeout: 5}",
        "class_name: dsrl:python\n    config: {memory_limit_mb: 256}",
    ],
)
def test_what_a_built_in_honours_is_accepted(tmp_path, entry):
    assert problems_of(tmp_path, f"tools:\n  - {entry}\n") == []


# ---------------------------------------------------------------- function_tool_path


@pytest.mark.parametrize(
    "target, what",
    [
        ("folder", "is a directory, not a .py file; fix: name the .py file in it"),  # security_3 D19
        ("/proc/self/environ", "/proc/self/environ is not a .py file; fix: name a Python file ending in .py"),
        ("/etc/hostname", "/etc/hostname is not a .py file"),
        ("tools.txt", "tools.txt is not a .py file"),
    ],
)
def test_a_function_file_must_be_a_py_file(tmp_path, target, what):
    (tmp_path / "folder").mkdir()
    (tmp_path / "tools.txt").write_text("def f(x: int) -> str:\n    '''f.'''\n    return ''\n")
    path = target if target.startswith("/") else str(tmp_path / target)
    multi_turn = SimpleNamespace(tool_config_path=None, function_tool_path=path, tool_timeout=10.0)
    (problem,) = load_tool_specs(multi_turn)[1]
    assert problem.startswith(f"actor_rollout_ref.rollout.multi_turn.function_tool_path={path}: ") and what in problem
    assert "importing it raised" not in problem
