"""The python tool's sandbox through dsrl's own tool path (``ToolSet`` -> tool worker -> ``dsrl:python``), one
test per escape class of the security review (security_3.md, cases A1-A22): the trainer's secrets through
``/proc``, files outside the scratch folder, the network, signals to the trainer, processes that outlive the
call, memory of all the processes together, their count, the disk. Then the refusal where bubblewrap is
missing, and the two opt-ins (``config.sandbox: none``, ``config.network: true``) doing what their help says.

This process stands in for the trainer: the tool workers are its children, as in a run."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dsrl.rollout.tools import ToolCall, ToolRequest, ToolSet, ToolSpec, check_tool_files
from dsrl.rollout.tools.builtin import PythonInterpreter
from dsrl.workers.sandbox import Sandbox
from tests.helpers.processes import live, wait_gone, with_argument
from tests.helpers.tools import tool_run_config

TOOL_TIMEOUT = 10.0
SECRET = "hf_FAKEsecretTOKEN1234567890"
MEMORY_LIMIT_MB = 512


def tool_config(tmp_path, python_config: str = "", **multi_turn):
    (tmp_path / "tools.yaml").write_text(f"tools:\n  - class_name: dsrl:python\n    config: {{{python_config}}}\n")
    limits = dict(tool_timeout=TOOL_TIMEOUT, max_tool_response_length=4000, tool_memory_limit_mb=4096)
    return tool_run_config(tmp_path / "tools.yaml", **{**limits, **multi_turn})


@pytest.fixture(scope="module")
def toolset(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sandboxed")
    os.environ["DSRL_TEST_HF_TOKEN"] = SECRET  # in the "trainer's" environment, so in its workers' too
    try:
        cfg = tool_config(tmp_path, f"memory_limit_mb: {MEMORY_LIMIT_MB}")
        with ToolSet.from_config(cfg, log_file=tmp_path / "tool_workers.log") as tools:
            yield tools
    finally:
        del os.environ["DSRL_TEST_HF_TOKEN"]


def python(toolset, code: str) -> str:
    [result] = toolset.run([ToolRequest(ToolCall("python", {"code": textwrap.dedent(code)}))])
    assert result.failure is None, result.text
    return result.text


def test_the_trainers_secrets_are_out_of_reach(toolset):
    # A2, A22: every /proc/<pid>/environ and cmdline the code can open, its parent's first, searched for tokens.
    text = python(
        toolset,
        """
        import os
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        for pid in [os.getppid()] + pids:
            for name in ("environ", "cmdline"):
                try:
                    entries = open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace").split("\\0")
                except OSError:
                    continue
                print("\\n".join(entry for entry in entries if "TOKEN" in entry))
        print("pids:", sorted(pids))
        """,
    )
    assert "pids:" in text and SECRET not in text, text


def test_files_outside_the_scratch_folder_are_out_of_reach(toolset, tmp_path):
    # A1, A3, A4, A17, A19: read the labels, write beside them, rewrite the installed packages, list the home.
    labels = tmp_path / "train_labels.txt"
    labels.write_text("gt:144869")
    text = python(
        toolset,
        f"""
        import os, sys, sysconfig
        for path in [{str(labels)!r}, "/etc/shadow", os.path.expanduser("~root/.bashrc")]:
            try:
                print("READ", open(path).read()[:40])
            except OSError as exc:
                print("no read:", type(exc).__name__)
        try:
            open({str(tmp_path / "written_by_model_code.txt")!r}, "w").write("planted")
            print("WROTE beside the labels")
        except OSError as exc:
            print("no write:", type(exc).__name__)
        for path in [sysconfig.get_paths()["purelib"], sys.executable]:  # asked, not written: they are real
            print("WRITABLE" if os.access(path, os.W_OK) else "read-only:", path)
        print("root folders:", sorted(os.listdir("/")))
        """,
    )
    assert "READ" not in text and "WROTE" not in text and "WRITABLE" not in text and "gt:144869" not in text, text
    assert text.count("no read:") == 3 and text.count("no write:") == 1 and text.count("read-only:") == 2, text
    assert not (tmp_path / "written_by_model_code.txt").exists()
    assert re.search(r"root folders: \[.*'tmp'.*'usr'.*\]", text) and "'home'" not in text and "'work'" not in text


def test_the_network_is_out_of_reach(toolset):
    # A5: a listener of this host, and an address outside.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    text = python(
        toolset,
        f"""
        import socket
        for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
            try:
                socket.create_connection(address, timeout=3).sendall(b"EXFIL")
                print("CONNECTED", address)
            except OSError as exc:
                print("no connection:", type(exc).__name__)
        """,
    )
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert "CONNECTED" not in text and text.count("no connection:") == 2, text


def test_signals_do_not_reach_the_trainer_or_its_processes(toolset):
    # A10-A13, A21: kill a process of the host, probe the trainer (signal 0), write to its console.
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        text = python(
            toolset,
            f"""
            import os, signal
            for pid, sig in [({victim.pid}, signal.SIGKILL), ({os.getpid()}, 0)]:
                try:
                    os.kill(pid, sig)
                    print("SIGNALLED", pid)
                except OSError as exc:
                    print("no signal:", type(exc).__name__)
            try:
                open("/proc/{os.getpid()}/fd/1", "w").write("spoofed by the tool\\n")
                print("WROTE to the trainer's console")
            except OSError as exc:
                print("no write:", type(exc).__name__)
            """,
        )
        assert "SIGNALLED" not in text and "WROTE" not in text, text
        assert live([victim.pid]) == [victim.pid]
    finally:
        victim.kill()
        victim.wait()


def test_what_the_code_starts_ends_with_the_call(toolset):
    # A6: a double fork into a session of its own, and a process group of its own; the script itself ends at once.
    marker = f"outlive-{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    try:
        text = python(
            toolset,
            f"""
            import os, subprocess, sys
            sleeper = [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"]
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv(sys.executable, sleeper)
                os._exit(0)
            subprocess.Popen(sleeper, process_group=0)
            print("started")
            """,
        )
        assert text == "started\n" and time.monotonic() - start < 5  # the escaped ones held no pipe open
        assert wait_gone(with_argument(marker)) == []
    finally:
        for pid in with_argument(marker):
            os.kill(pid, signal.SIGKILL)


def test_memory_of_all_processes_together_is_bounded(toolset):
    # A8: four processes of 300 MB each, each under the per-process bound; together past memory_limit_mb. Each
    # holds its block until every one holds its own or is gone, so the count is of blocks held at one time (a
    # child that sleeps and exits would let the next allocate after it: CI's loaded machine did that once).
    if "cgroup v1" not in Sandbox().describe():
        pytest.skip("no cgroup this process may write: the sandbox bounds memory per process only here")
    text = python(
        toolset,
        """
        import os, select
        report_r, report_w = os.pipe()
        release_r, release_w = os.pipe()
        children = []
        for i in range(4):
            children.append(os.fork())
            if children[-1] == 0:
                os.close(report_r), os.close(release_w)
                block = b"\\x01" * (300 * 2**20)
                os.write(report_w, b"%d" % i)
                os.read(release_r, 1)  # returns once the parent closes its end
                print("held together", i, flush=True)
                os._exit(0)
        os.close(report_w), os.close(release_r)
        holding, gone = set(), set()
        while len(holding | gone) < 4:
            if select.select([report_r], [], [], 0.05)[0]:
                holding |= {int(c) for c in os.read(report_r, 16).decode()}
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid:
                gone.add(children.index(pid))
        os.close(release_w)
        for i in set(range(4)) - gone:
            os.waitpid(children[i], 0)
        """,
    )
    assert text.count("held together") <= MEMORY_LIMIT_MB // 300, text
    assert f"config.memory_limit_mb={MEMORY_LIMIT_MB}" in text


def test_the_number_of_processes_is_bounded(toolset):
    # A7: a fork bomb, its children sleeping until the call ends.
    text = python(
        toolset,
        """
        import os, time
        started, refused = 0, 0
        for _ in range(300):
            try:
                if os.fork() == 0:
                    time.sleep(5)
                    os._exit(0)
                started += 1
            except OSError:
                refused += 1
        print("started", started, "refused", refused)
        """,
    )
    started, refused = map(int, re.search(r"started (\d+) refused (\d+)", text).groups())
    assert started < 128 and refused == 300 - started


def test_the_disk_is_bounded(toolset, tmp_path):
    # A9: 400 MB into the scratch folder; a file on the host's disk.
    text = python(
        toolset,
        f"""
        written = 0
        try:
            with open("big", "wb") as f:
                for _ in range(400):
                    f.write(b"x" * 2**20)
                    f.flush()
                    written += 1
        except OSError as exc:
            print("stopped:", exc.strerror)
        print("written MB", written)
        try:
            open({str(tmp_path / "outside")!r}, "wb").write(b"x")
        except OSError as exc:
            print("no write outside:", type(exc).__name__)
        """,
    )
    assert int(re.search(r"written MB (\d+)", text).group(1)) <= 256, text
    assert "no write outside" in text and not (tmp_path / "outside").exists()


# ---------------------------------------------------------------- without a sandbox


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    """A PATH with python and nothing else: no bwrap."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_without_bubblewrap_the_python_tool_is_refused_with_the_fix(tmp_path, no_bwrap):
    cfg = tool_config(tmp_path)
    [problem] = check_tool_files(cfg)
    assert problem.startswith(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}: ")
    assert "dsrl:python runs model-written code in a sandbox, and none works here: no bwrap on PATH" in problem
    assert "; fix: install bubblewrap from the OS packages" in problem
    assert "or set config.sandbox: none to run the code without one (the code then runs as the trainer's" in problem
    # Past the check (a worker on a machine the check did not run on): the worker refuses to build the tool.
    spec = ToolSpec("python", "class", "dsrl:python", PythonInterpreter.SCHEMA, {"timeout": 8.0})
    with pytest.raises(ValueError, match=r"could not be built in a worker(.|\n)*no bwrap on PATH; fix: install"):
        ToolSet([spec], tool_timeout=TOOL_TIMEOUT, max_tool_response_length=200, tool_response_truncate_side="left")


def test_sandbox_none_runs_the_code_unsandboxed_as_its_help_says(tmp_path, no_bwrap, monkeypatch):
    monkeypatch.setenv("DSRL_TEST_HF_TOKEN", SECRET)
    cfg = tool_config(tmp_path, "sandbox: none")
    assert check_tool_files(cfg) == []
    with ToolSet.from_config(cfg) as tools:
        # "reads ... the tokens in /proc/<pid>/environ of the trainer's processes"
        text = python(tools, "import os; print(open(f'/proc/{os.getppid()}/environ').read())")
    assert SECRET in text


def test_network_true_shares_the_hosts_network(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TOOL_TIMEOUT)
    port = listener.getsockname()[1]
    with ToolSet.from_config(tool_config(tmp_path, "network: true")) as tools:
        text = python(tools, f"import socket; socket.create_connection(('127.0.0.1', {port})).sendall(b'hi')")
        connection, _ = listener.accept()
        assert connection.recv(2) == b"hi" and text == ""
        connection.close()
    listener.close()
