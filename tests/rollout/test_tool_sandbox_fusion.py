"""``dsrl:sandbox_fusion`` through the tool pool (real worker processes) against a stand-in SandboxFusion server on
127.0.0.1 (tests/helpers/sandbox_fusion.py): what the model sees, each failure counted, the model's own language and
time limit, ``rate_limit`` over the worker processes, and a slot freed by a worker the pool killed. Its config keys:
tests/rollout/test_tools.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsrl.rollout.tools import ToolCall, ToolRequest, ToolSet, load_tool_specs
from tests.helpers.sandbox_fusion import SandboxStub

TOOL_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def stub():
    with SandboxStub() as server:
        yield server


@pytest.fixture(scope="module")
def toolset(stub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sandbox_tools")
    (folder / "tools.yaml").write_text(
        f"""
tools:
  - class_name: dsrl:sandbox_fusion
    config: {{sandbox_fusion_url: {stub.url}, rate_limit: 2, memory_limit_mb: 256}}
  - class_name: dsrl:sandbox_fusion
    config: {{sandbox_fusion_url: {stub.url}, rate_limit: 1, default_timeout: 2}}
    tool_schema:
      type: function
      function:
        name: run_code
        description: Run code in a language, under a time limit.
        parameters:
          type: object
          properties: {{code: {{type: string}}, language: {{type: string}}, timeout: {{type: number}}}}
          required: [code]
"""
    )
    multi_turn = SimpleNamespace(
        tool_config_path=str(folder / "tools.yaml"), function_tool_path=None, tool_timeout=TOOL_TIMEOUT
    )
    specs, problems = load_tool_specs(multi_turn)
    assert problems == []
    with ToolSet(
        specs,
        tool_timeout=TOOL_TIMEOUT,
        max_tool_response_length=200,
        tool_response_truncate_side="middle",
        num_workers=4,
        log_file=folder / "tool_workers.log",
    ) as tools:
        yield tools


@pytest.fixture(autouse=True)
def fresh(stub):
    stub.requests.clear()
    stub.delay_s, stub.hang, stub.max_in_flight = 0.0, False, 0


def call(tool, **arguments):
    return ToolRequest(ToolCall(tool, arguments))


def test_the_model_sees_what_the_code_printed_and_its_exit_status(toolset, stub):
    printed, failed, raised = toolset.run(
        [
            call("code_interpreter", code="print(6 * 7)"),
            call("code_interpreter", code="import sys\nprint('partial')\nsys.exit(2)"),
            call("code_interpreter", code="1 / 0"),
        ]
    )
    assert (printed.text, printed.failure) == ("42\n", None)
    assert (failed.text, failed.failure) == ("partial\n\n(exit status 2)", None)
    assert raised.failure is None and "ZeroDivisionError" in raised.text and raised.text.endswith("(exit status 1)")
    first = next(r for r in stub.requests if r["code"] == "print(6 * 7)")
    # default_timeout is 0.8 x tool_timeout, the compile limit the run's (as verl sends them)
    assert (first["language"], first["memory_limit_MB"]) == ("python", 256)
    assert first["run_timeout"] == first["compile_timeout"] == pytest.approx(0.8 * TOOL_TIMEOUT)


def test_a_run_past_its_limit_is_a_timeout_with_what_it_printed(toolset):
    [result] = toolset.run([call("run_code", code="import time\nprint('begun', flush=True)\ntime.sleep(9)")])
    assert result.failure == "timeout"
    assert result.text == (
        "Error executing tool 'run_code': the code ran past 2 s on the sandbox and was stopped; its output until "
        "then:\nbegun\n"
    )


def test_a_server_error_is_a_counted_exception_naming_the_server(toolset, stub):
    stub.queue(500, "Internal Server Error")
    [result] = toolset.run([call("code_interpreter", code="print(1)")])
    assert result.failure == "exception"
    assert result.text.startswith(
        f"Error executing tool 'code_interpreter': SandboxFusionError: {stub.url}: HTTP 500 Internal Server Error"
    )


def test_the_models_language_and_a_shorter_limit_are_honoured(toolset, stub):
    short, longer, cpp, unknown = toolset.run(
        [
            call("run_code", code="import time\ntime.sleep(5)", timeout=0.5),
            call("run_code", code="print(1)", timeout=100),
            call("run_code", code="int main() {}", language="cpp"),
            call("run_code", code="", language="klingon"),
        ]
    )
    assert short.failure == "timeout" and "ran past 0.5 s" in short.text
    assert (
        longer.failure == "exception"
        and "timeout must be a number of seconds, more than 0 and at most 2" in longer.text
    )
    assert cpp.failure == "exception" and "SandboxError: no runtime for cpp" in cpp.text  # the stub runs python only
    assert unknown.failure == "exception" and "language 'klingon' is not one the sandbox runs" in unknown.text
    assert sorted((r["language"], r["run_timeout"]) for r in stub.requests) == [("cpp", 2), ("python", 0.5)]


def test_rate_limit_bounds_the_calls_in_flight_over_the_workers(toolset, stub):
    stub.delay_s = 0.5
    results = toolset.run([call("code_interpreter", code=f"print({i})") for i in range(6)])
    assert [r.text for r in results] == [f"{i}\n" for i in range(6)]
    assert stub.max_in_flight == 2  # 4 workers, rate_limit 2


def test_a_worker_killed_in_a_call_frees_its_slot(toolset, stub):
    stub.hang = True
    [hung] = toolset.run([call("run_code", code="print(1)")])
    assert hung.failure == "timeout" and "tool_timeout=3" in hung.text  # the pool killed the worker
    stub.hang = False
    [after] = toolset.run([call("run_code", code="print(2)")])  # rate_limit 1: the slot the killed worker held
    assert (after.text, after.failure) == ("2\n", None)
