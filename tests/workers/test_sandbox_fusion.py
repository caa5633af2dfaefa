"""The SandboxFusion client against a stand-in server on 127.0.0.1 (tests/helpers/sandbox_fusion.py): the request
verl sends, the verdicts, what is retried and what is not, a server that hangs, and the bound on requests in
flight. The reward and tool workers' use of it: tests/rewards/test_rewards_code.py, tests/rollout/test_tool_pool.py."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dsrl.workers import sandbox_fusion
from dsrl.workers.sandbox_fusion import SandboxFusionClient, SandboxFusionError, SandboxRun
from tests.helpers.sandbox_fusion import SandboxStub


@pytest.fixture
def stub():
    with SandboxStub() as server:
        yield server


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(sandbox_fusion, "RETRY_DELAY_S", 0.01)


def client(url, max_concurrent=4, name="test"):
    return SandboxFusionClient(url, max_concurrent=max_concurrent, memory_limit_mb=512, name=name)


def test_the_request_is_verls_and_the_answer_is_read(stub):
    run = client(stub.url).run_code("print(input() * 2)", stdin="ab", run_timeout=3)
    assert stub.requests == [
        {
            "code": "print(input() * 2)",
            "language": "python",
            "stdin": "ab",
            "compile_timeout": 3,
            "run_timeout": 3,
            "memory_limit_MB": 512,
            "files": {},
            "fetch_files": [],
        }
    ]
    assert run.status == "Success" and run.run_status == "Finished" and run.return_code == 0
    assert run.stdout == "abab\n" and run.stderr == "" and run.output == "abab\n"
    assert run.compile_status is None and run.execution_time > 0


def test_a_failing_program_is_a_verdict_not_an_error(stub):
    run = client(stub.url).run_code("import sys\nprint('before')\nsys.exit(3)")
    assert (run.status, run.run_status, run.return_code, run.stdout) == ("Failed", "Finished", 3, "before\n")
    run = client(stub.url).run_code("1 / 0")
    assert run.status == "Failed" and "ZeroDivisionError" in run.stderr


def test_a_program_past_its_time_is_a_verdict_with_what_it_printed(stub):
    run = client(stub.url).run_code("import time\nprint('started', flush=True)\ntime.sleep(30)", run_timeout=0.5)
    assert (run.status, run.run_status, run.stdout) == ("Failed", "TimeLimitExceeded", "started\n")


def test_a_busy_server_is_tried_again(stub):
    stub.queue(503, "busy")
    stub.queue(502, "bad gateway")
    assert client(stub.url).run_code("print(1)").stdout == "1\n"
    assert len(stub.requests) == 3


def test_three_busy_answers_are_a_counted_failure(stub):
    for _ in range(3):
        stub.queue(504, "gateway timeout")
    with pytest.raises(
        SandboxFusionError, match=r"HTTP 504 Gateway Timeout: gateway timeout \(after 3 attempts\)"
    ) as err:
        client(stub.url).run_code("print(1)")
    assert err.value.kind == "http" and len(stub.requests) == 3


def test_a_server_error_is_not_tried_again(stub):
    stub.queue(500, "Internal Server Error: the runner crashed")
    with pytest.raises(
        SandboxFusionError, match="HTTP 500 Internal Server Error: Internal Server Error: the runner"
    ) as err:
        client(stub.url).run_code("print(1)")
    assert err.value.kind == "http" and len(stub.requests) == 1


def test_a_wrong_path_says_which_url_it_needs(stub):
    with pytest.raises(
        SandboxFusionError, match=r"HTTP 404 Not Found: .* \(is the URL the server's /run_code endpoint"
    ):
        client(stub.url.replace("/run_code", "/")).run_code("print(1)")


@pytest.mark.parametrize(
    "status, body, kind, message",
    [
        (200, "<html>proxy login</html>", "response", "the answer is not JSON: <html>proxy login</html>"),
        (200, {"detail": "ok"}, "response", 'not a SandboxFusion answer: {"detail": "ok"}'),
        (200, {"status": "Success", "run_result": "Finished"}, "response", "not a SandboxFusion answer"),
        (200, {"status": "SandboxError", "message": "no space left"}, "sandbox", "SandboxError: no space left"),
    ],
)
def test_answers_that_are_no_verdict(stub, status, body, kind, message):
    stub.queue(status, body)
    with pytest.raises(SandboxFusionError, match=message) as err:
        client(stub.url).run_code("print(1)")
    assert err.value.kind == kind and len(stub.requests) == 1


def test_a_refused_connection_is_tried_three_times():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        url = f"http://127.0.0.1:{s.getsockname()[1]}/run_code"
        with pytest.raises(SandboxFusionError, match=r"ConnectionRefusedError: .* \(after 3 attempts\)") as err:
            client(url).run_code("print(1)")
    assert err.value.kind == "connection"


def test_a_server_that_hangs_is_given_up_once(stub, monkeypatch):
    monkeypatch.setattr(sandbox_fusion, "REQUEST_SLACK_S", 0.5)
    stub.hang = True
    start = time.monotonic()
    with pytest.raises(SandboxFusionError, match=r"no answer within 0.9 s") as err:
        client(stub.url).run_code("print(1)", run_timeout=0.2)
    assert err.value.kind == "timeout" and len(stub.requests) == 1
    assert 0.8 < time.monotonic() - start < 5


def test_requests_in_flight_are_bounded_by_max_concurrent(stub):
    stub.delay_s = 0.3
    shared = client(stub.url, max_concurrent=2, name="bounded")
    results: list[SandboxRun] = []
    threads = [threading.Thread(target=lambda: results.append(shared.run_code("print(1)"))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.stdout for r in results] == ["1\n"] * 6
    assert stub.max_in_flight == 2


def test_clients_of_other_names_do_not_share_a_bound(stub):
    stub.delay_s = 0.3
    clients = [client(stub.url, max_concurrent=1, name=f"own-{i}") for i in range(3)]
    threads = [threading.Thread(target=c.run_code, args=("print(1)",)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stub.max_in_flight == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(url="localhost:8080/run_code"), "must be an http:// or https:// URL with a host"),
        (dict(url="http:///run_code"), "must be an http:// or https:// URL with a host"),
        (dict(url="http://host:port/run_code"), "has a bad port"),
        (dict(max_concurrent=0), "max_concurrent=0: must be >= 1"),
        (dict(memory_limit_mb=0), "memory_limit_mb=0: must be >= 1"),
        (dict(name="a/b"), "name 'a/b': letters, digits"),
    ],
)
def test_a_client_refuses_bad_settings(kwargs, message):
    settings = dict(url="http://localhost:8080/run_code", max_concurrent=1, memory_limit_mb=1, name="x") | kwargs
    with pytest.raises(ValueError, match=message):
        SandboxFusionClient(**settings)


def test_an_unknown_language_is_refused_before_sending(stub):
    with pytest.raises(ValueError, match="language 'klingon': SandboxFusion runs python, cpp"):
        client(stub.url).run_code("", language="klingon")
    assert stub.requests == []
