"""A client of a SandboxFusion server (https://github.com/bytedance/SandboxFusion): code runs there, not here.

verl posts each run to the server's ``/run_code`` endpoint (its ``reward.sandbox_fusion.url`` and its former
``SandboxFusionTool``'s ``sandbox_fusion_url`` are that endpoint's full URL) as JSON::

    {"code": ..., "language": "python", "stdin": str | null, "compile_timeout": s, "run_timeout": s,
     "memory_limit_MB": mb, "files": {}, "fetch_files": []}

and the server answers ``{"status": "Success" | "Failed" | "SandboxError", "message": ..., "compile_result":
{...} | null, "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time", "return_code",
"stdout", "stderr"} | null}``: ``Failed`` is the code's fault (a non-zero exit, a time limit, a failed compile),
``SandboxError`` the server's. :meth:`SandboxFusionClient.run_code` returns a :class:`SandboxRun` for the first two
and raises :class:`SandboxFusionError` whenever the server gives no verdict: unreachable, an HTTP error, no answer
in time, an answer that is not SandboxFusion's JSON, or ``SandboxError``. dsrl calls it from the reward and tool
worker processes (``dsrl.workers.pool``), where that exception is a counted failure, never the trainer's.

Retries: a refused or dropped connection and HTTP 429, 502, 503 and 504 (a gateway, a busy or restarting server)
are tried again, 3 attempts in all, 1 s and 2 s apart, as verl waits between its retries of a 504; any other HTTP
error and a request past its time are not (the server may have run the code already, and a server that hangs
would cost three times as long). A request may take ``compile_timeout + run_timeout + 10`` s (verl's bound); no
single wait on the socket is longer. The connection goes through the ``http(s)_proxy`` the environment names, as
``requests`` (verl's client) does.

Concurrency: ``max_concurrent`` bounds the requests in flight of all the clients of one trainer process and its
worker processes that share a ``name`` (the reward workers of a rank, the workers running one tool). Each request
holds one of ``max_concurrent`` slot files (``<tmp>/dsrl_sandbox_fusion_<uid>/<trainer pid>-<name>/``) under an
``flock``: the kernel releases it when the holder ends, even when a pool kills it in the middle of a request (a
semaphore would stay taken). While every slot is held, one waiter polls for a free one (every 20 ms) and the others
wait for it in the kernel, on the lock of the folder's ``queue`` file. The empty files stay behind.

Torch-free and standard library only: it runs inside the worker processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from dsrl.workers import process

# The server's ``language`` values (SandboxFusion's ``Language`` enum; verl's list is the same).
LANGUAGES = (
    "python",
    "cpp",
    "nodejs",
    "go",
    "go_test",
    "java",
    "php",
    "csharp",
    "bash",
    "typescript",
    "sql",
    "rust",
    "cuda",
    "lua",
    "R",
    "perl",
    "D_ut",
    "ruby",
    "scala",
    "julia",
    "pytest",
    "junit",
    "kotlin_script",
    "jest",
    "verilog",
    "python_gpu",
    "lean",
    "swift",
    "racket",
)
DEFAULT_RUN_TIMEOUT_S = 10.0  # verl's limit of a run and of its compilation (what its code rewards use)
ATTEMPTS = 3
RETRY_DELAY_S = 1.0  # before the second attempt; twice that before the third
REQUEST_SLACK_S = 10.0  # a request may take compile_timeout + run_timeout + this (verl's bound)
_RETRIED_HTTP = (429, 502, 503, 504)
_MAX_RESPONSE_BYTES = 32 * 2**20  # an answer larger than this (an enormous print) is not read
_SLOT_POLL_S = 0.02
_QUOTED = 300  # characters of a server's text a message quotes


class SandboxFusionError(Exception):
    """The server gave no verdict on the code. ``kind``: ``connection`` (refused, dropped, no such host; after
    every attempt), ``http`` (an error status), ``timeout`` (no answer in time), ``response`` (not SandboxFusion's
    JSON) or ``sandbox`` (its own ``SandboxError``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class SandboxRun:
    """The server's verdict: ``status`` ``Success`` (every step finished with exit code 0) or ``Failed``;
    ``run_status`` ``Finished`` or ``TimeLimitExceeded``, None when the code did not run (its compilation failed);
    the ``compile_*`` fields None for a language without a compile step."""

    status: str
    run_status: str | None
    stdout: str
    stderr: str
    return_code: int | None
    execution_time: float | None
    compile_status: str | None
    compile_stderr: str | None
    compile_return_code: int | None

    @property
    def output(self) -> str:
        """What the run printed: stdout, then stderr (verl's tool shows the two so)."""
        return self.stdout + self.stderr


def url_problem(url: object) -> str | None:
    """What is wrong with ``url`` as a server's ``/run_code`` URL (not http or https, no host), or None."""
    if not isinstance(url, str) or not url:
        return "must be the URL of the server's /run_code endpoint, e.g. http://localhost:8080/run_code"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host, e.g. http://localhost:8080/run_code"
    try:
        parts.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as exc:
        return f"has a bad port ({exc})"
    return None


class SandboxFusionClient:
    """Runs code on the SandboxFusion server at ``url`` (its ``/run_code`` endpoint).

    Args:
        url: the endpoint, e.g. ``http://localhost:8080/run_code``.
        max_concurrent: requests in flight at most, over every client of this trainer and its worker
            processes with the same ``name``.
        memory_limit_mb: the memory the server gives each run (``memory_limit_MB``).
        name: what the bound is shared by (the module doc); letters, digits, ``_ . -``.

    Picklable, holds no connection: each request opens its own.
    """

    def __init__(self, url: str, *, max_concurrent: int, memory_limit_mb: int, name: str):
        problem = url_problem(url)
        if problem:
            raise ValueError(f"SandboxFusion url {url!r} {problem}")
        if max_concurrent < 1:
            raise ValueError(f"SandboxFusion max_concurrent={max_concurrent}: must be >= 1")
        if memory_limit_mb < 1:
            raise ValueError(f"SandboxFusion memory_limit_mb={memory_limit_mb}: must be >= 1")
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"SandboxFusion client name {name!r}: letters, digits, _ . - only")
        self.url, self.max_concurrent, self.memory_limit_mb, self.name = url, max_concurrent, memory_limit_mb, name

    def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        stdin: str | None = None,
        run_timeout: float = DEFAULT_RUN_TIMEOUT_S,
    ) -> SandboxRun:
        """Run ``code`` once, with ``stdin``, under ``run_timeout`` seconds (its compilation, if any, under as
        many). SandboxFusionError when the server gives no verdict (the module doc)."""
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r}: SandboxFusion runs {', '.join(LANGUAGES)}")
        body = json.dumps(
            {
                "code": code,
                "language": language,
                "stdin": stdin,
                "compile_timeout": run_timeout,
                "run_timeout": run_timeout,
                "memory_limit_MB": self.memory_limit_mb,
                "files": {},
                "fetch_files": [],
            }
        ).encode()
        request_timeout = 2 * run_timeout + REQUEST_SLACK_S
        with self._slot():
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    return _verdict(self._post(body, request_timeout), self.url)
                except _Retry as retry:
                    failure = retry
                if attempt < ATTEMPTS:
                    time.sleep(RETRY_DELAY_S * attempt)
        raise SandboxFusionError(failure.kind, f"{self.url}: {failure} (after {ATTEMPTS} attempts)")

    def _post(self, body: bytes, timeout: float) -> bytes:
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json", "Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                data = response.read(_MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            message = f"HTTP {exc.code} {exc.reason}: {_quoted(_body(exc))}"
            if exc.code in _RETRIED_HTTP:
                raise _Retry("http", message) from None
            if exc.code in (404, 405):
                message += " (is the URL the server's /run_code endpoint, e.g. http://host:8080/run_code?)"
            raise SandboxFusionError("http", f"{self.url}: {message}") from None
        except (OSError, http.client.HTTPException) as exc:  # URLError and TimeoutError are OSErrors
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                raise SandboxFusionError(
                    "timeout", f"{self.url}: no answer within {timeout:g} s (the request's limit)"
                ) from None
            raise _Retry("connection", f"{type(reason).__name__}: {reason}") from None
        if len(data) > _MAX_RESPONSE_BYTES:
            raise SandboxFusionError(
                "response", f"{self.url}: the answer is larger than {_MAX_RESPONSE_BYTES // 2**20} MiB; not read"
            )
        return data

    @contextlib.contextmanager
    def _slot(self) -> Iterator[None]:
        """Hold one of the ``max_concurrent`` slot files of this client's name until the block ends. One waiter at
        a time (the holder of the ``queue`` file's lock) looks for a free slot; the others wait in the kernel."""
        folder = os.path.join(
            tempfile.gettempdir(), f"dsrl_sandbox_fusion_{os.getuid()}", f"{process.trainer_pid()}-{self.name}"
        )
        os.makedirs(folder, mode=0o700, exist_ok=True)
        with _locked(os.path.join(folder, "queue")):
            while (slot := self._free_slot(folder)) is None:
                time.sleep(_SLOT_POLL_S)
        try:
            yield
        finally:
            os.close(slot)  # releases its lock

    def _free_slot(self, folder: str) -> int | None:
        """The descriptor of a slot file this process now locks, or None when every slot is held."""
        for i in range(self.max_concurrent):
            fd = os.open(os.path.join(folder, f"slot-{i}"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd
        return None


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold the ``flock`` of the file ``path`` (created if need be), waiting for it, until the block ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _Retry(Exception):
    """A failure worth another attempt."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _verdict(data: bytes, url: str) -> SandboxRun:
    """The SandboxRun of an answer; SandboxFusionError for one that is not SandboxFusion's or a SandboxError."""
    try:
        answer = json.loads(data)
    except ValueError:
        raise SandboxFusionError(
            "response", f"{url}: the answer is not JSON: {_quoted(data.decode('utf-8', errors='replace'))}"
        ) from None
    if not isinstance(answer, dict):
        answer = {}
    status, compile_result, run_result = (answer.get(k) for k in ("status", "compile_result", "run_result"))
    if status == "SandboxError":
        raise SandboxFusionError("sandbox", f"{url}: SandboxError: {_quoted(str(answer.get('message') or ''))}")
    compile_result, run_result = compile_result or {}, run_result or {}
    ran = run_result or (status == "Failed" and compile_result)  # a failed compilation leaves no run
    if (
        status not in ("Success", "Failed")
        or not isinstance(compile_result, dict)
        or not isinstance(run_result, dict)
        or not ran
    ):
        shown = _quoted(data.decode("utf-8", errors="replace"))
        raise SandboxFusionError("response", f"{url}: not a SandboxFusion answer: {shown}")
    return SandboxRun(
        status=status,
        run_status=run_result.get("status"),
        stdout=run_result.get("stdout") or "",
        stderr=run_result.get("stderr") or "",
        return_code=run_result.get("return_code"),
        execution_time=run_result.get("execution_time"),
        compile_status=compile_result.get("status"),
        compile_stderr=compile_result.get("stderr"),
        compile_return_code=compile_result.get("return_code"),
    )


def _body(error: urllib.error.HTTPError) -> str:
    """The text of an HTTP error's answer; empty when it cannot be read."""
    try:
        return error.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return ""


def _quoted(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _QUOTED else text[:_QUOTED] + "..."
