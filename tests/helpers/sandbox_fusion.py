"""A stand-in SandboxFusion server on 127.0.0.1 for the tests: ``POST /run_code`` runs Python code for real (a
``python -I`` subprocess with the request's stdin and ``run_timeout``) and answers in SandboxFusion's JSON, or gives
what a test queued (an HTTP error, a broken answer), or waits (a server that hangs). It records every request and
the most requests it held at once.

    with SandboxStub() as stub:
        stub.url                          # http://127.0.0.1:<port>/run_code
        stub.queue(503, "busy")           # the next request gets this; later ones run their code
        stub.delay_s = 0.3                # each request takes at least this long
        stub.hang = True                  # requests wait until hang is false again (or the stub stops)
        stub.requests, stub.max_in_flight

Only ``python`` runs; any other language gets a ``SandboxError``, as a server without that runtime answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class SandboxStub:
    def __init__(self):
        self.requests: list[dict] = []
        self.delay_s = 0.0
        self.hang = False
        self.in_flight = self.max_in_flight = 0
        self._canned: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/run_code"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="sandbox-stub", daemon=True
        )

    def __enter__(self) -> SandboxStub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()

    def queue(self, status: int, body: str | dict) -> None:
        """The next request not yet answered gets this HTTP status and body (a dict is sent as JSON)."""
        with self._lock:
            self._canned.append((status, body if isinstance(body, str) else json.dumps(body)))

    def _answer(self, request: dict) -> tuple[int, str]:
        with self._lock:
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            canned = self._canned.pop(0) if self._canned else None
        try:
            time.sleep(self.delay_s)
            while self.hang and not self._stopped.wait(0.05):
                pass
            return canned or (200, json.dumps(run(request)))
        finally:
            with self._lock:
                self.in_flight -= 1


def run(request: dict) -> dict:
    """SandboxFusion's answer to ``request``: ``Success`` when the code exited with 0, ``Failed`` otherwise or past
    its ``run_timeout`` (``TimeLimitExceeded``, with what it printed until then)."""
    if request.get("language") != "python":
        return {"status": "SandboxError", "message": f"no runtime for {request.get('language')}", "run_result": None}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "main.py"
        script.write_text(request["code"])
        start = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(script)],
                input=(request.get("stdin") or "").encode(),
                capture_output=True,
                timeout=request["run_timeout"],
                cwd=folder,
            )
        except subprocess.TimeoutExpired as exc:
            return {
                "status": "Failed",
                "message": "",
                "compile_result": None,
                "run_result": {
                    "status": "TimeLimitExceeded",
                    "execution_time": time.monotonic() - start,
                    "return_code": None,
                    "stdout": (exc.stdout or b"").decode(),
                    "stderr": (exc.stderr or b"").decode(),
                },
            }
    return {
        "status": "Success" if done.returncode == 0 else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": "Finished",
            "execution_time": time.monotonic() - start,
            "return_code": done.returncode,
            "stdout": done.stdout.decode(),
            "stderr": done.stderr.decode(),
        },
        "executor_pod_name": None,
        "files": {},
    }


def _handler(stub: SandboxStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/run_code":
                self._send(404, '{"detail": "Not Found"}')
                return
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*stub._answer(request))

        def _send(self, status: int, body: str) -> None:
            data = body.encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up waiting

        def log_message(self, format, *args) -> None:  # noqa: A002 -- the stdlib's signature
            pass

    return Handler
