"""The sandbox runner (dsrl/workers/sandbox.py) on its own: what a command gets and gives back, the refusals
(bwrap missing, too old, unable to make namespaces: each a real PATH, not a mock), the two fallbacks (run by
another user than root: a user namespace and no cgroup; root without a cgroup it may write) and the reward
example of docs/data-and-rewards.md. tests/rollout/test_python_sandbox.py covers each escape class through the
python tool."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from dsrl.workers import sandbox as sandbox_module
from dsrl.workers.sandbox import Sandbox, SandboxUnavailable
from tests.conftest import REPO

SANDBOX_SOURCE = Path(sandbox_module.__file__)
FORK_BOMB = """
import os, time
started = 0
for _ in range(100):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        started += 1
    except OSError:
        pass
print("started", started)
"""


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(memory_limit_mb=512, max_processes=32, disk_limit_mb=64)


def run_python(sandbox, code: str, timeout_s: float = 10.0):
    return sandbox.run([sys.executable, "-I", "main.py"], {"main.py": textwrap.dedent(code)}, timeout_s=timeout_s)


def test_a_command_gets_its_files_a_scratch_folder_and_three_variables(sandbox):
    result = sandbox.run(
        [sys.executable, "-I", "main.py"],
        {
            "main.py": "import os; print(os.getcwd() == os.environ['HOME'], sorted(os.listdir()), sorted(os.environ))",
            "data.txt": "1 2 3",
        },
        timeout_s=10,
    )
    assert result.output == b"True ['data.txt', 'main.py'] ['HOME', 'LANG', 'PATH']\n"
    assert result.returncode == 0 and not result.timed_out and not result.out_of_memory


def test_exit_status_signal_and_time_limit(sandbox):
    assert run_python(sandbox, "import sys; print('partial'); sys.exit(3)") == sandbox_module.SandboxResult(
        b"partial\n", 3, False
    )
    assert run_python(sandbox, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == 128 + 9
    start = time.monotonic()
    result = run_python(sandbox, "import time; print('before', flush=True); time.sleep(60)", timeout_s=1)
    assert result == sandbox_module.SandboxResult(b"before\n", None, True) and time.monotonic() - start < 5
    # A script that closes its output and goes on is still stopped at the limit.
    result = run_python(sandbox, "import os, time; os.close(1); os.close(2); time.sleep(60)", timeout_s=1)
    assert result.timed_out and time.monotonic() - start < 10


def test_a_stale_cgroup_of_a_dead_worker_is_removed(sandbox):
    parents = sandbox_module._writable_cgroup_parents()
    if not parents:
        pytest.skip("no cgroup this process may write")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [os.path.join(parent, f"dsrl_sandbox_{dead.pid}_0") for parent in parents.values()]
    for folder in stale:
        os.mkdir(folder)
    Sandbox()
    assert [folder for folder in stale if os.path.exists(folder)] == []


# ---------------------------------------------------------------- refusals


def bin_with(tmp_path, bwrap_script: str | None) -> str:
    """A PATH folder with setpriv, prlimit and env, and ``bwrap_script`` as bwrap (None: no bwrap)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("setpriv", "prlimit", "env"):
        (folder / tool).symlink_to(shutil.which(tool))
    if bwrap_script is not None:
        (folder / "bwrap").write_text(bwrap_script)
        (folder / "bwrap").chmod(0o755)
    return str(folder)


def test_no_bwrap_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", bin_with(tmp_path, None))
    with pytest.raises(SandboxUnavailable) as refused:
        Sandbox()
    assert refused.value.reason == "no bwrap on PATH"
    assert refused.value.fix.startswith("install bubblewrap from the OS packages (apt-get install bubblewrap")


def test_a_bubblewrap_without_size_bounds_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", bin_with(tmp_path, "#!/bin/sh\necho 'bubblewrap 0.6.1'\n"))
    with pytest.raises(SandboxUnavailable, match=r"is bubblewrap 0\.6\.1, older than 0\.8\.0, .*--size.*fix: "):
        Sandbox()


def test_a_bwrap_that_cannot_make_namespaces_is_refused_with_its_words(tmp_path, monkeypatch):
    # What bwrap says where user namespaces are off; the probe runs it as bwrap would be run.
    script = (
        '#!/bin/sh\n[ "$1" = --version ] && { echo "bubblewrap 0.8.0"; exit 0; }\n'
        'echo "bwrap: No permissions to creating new namespace, likely because the kernel does not allow '
        'non-privileged user namespaces." >&2\nexit 1\n'
    )
    monkeypatch.setenv("PATH", bin_with(tmp_path, script))
    with pytest.raises(SandboxUnavailable) as refused:
        Sandbox()
    assert refused.value.reason.startswith("bubblewrap cannot run a command here (")
    assert "in a user namespace as uid" in refused.value.reason
    assert "does not allow non-privileged user namespaces" in refused.value.reason
    assert "allow unprivileged user namespaces" in refused.value.fix


# ---------------------------------------------------------------- fallbacks

# Run in a fallback, each by the sandbox: secrets of other processes, the network, a fork bomb, the disk.
FALLBACK_CHECKS = [
    """
import os
for pid in os.listdir("/proc"):
    try:
        print("SECRET" if b"FAKE_SECRET" in open(f"/proc/{pid}/environ", "rb").read() else "", end="")
    except OSError:
        pass
""",
    """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError:
    print("no network")
""",
    FORK_BOMB,
    """
try:
    open("big", "wb").write(b"x" * 64 * 2**20)
except OSError as exc:
    print(exc.strerror)
""",
]
CHECKS = """
import sys
sys.path.insert(0, {module_folder!r})
from sandbox import Sandbox

sandbox = Sandbox(memory_limit_mb=256, max_processes=20, disk_limit_mb=32)
print(sandbox.describe())
for code in {checks!r}:
    result = sandbox.run([sys.executable, "-I", "main.py"], {{"main.py": code}}, timeout_s=20)
    print(result.output.decode().strip())
"""


def check_fallback(command_prefix: list[str], tmp_path) -> str:
    """Run CHECKS under ``command_prefix`` with this module copied to a folder any uid may read, and a listener
    for the network check; its output."""
    folder = Path(tempfile.mkdtemp(prefix="dsrl_sandbox_test_"))
    try:
        folder.chmod(0o755)
        shutil.copy(SANDBOX_SOURCE, folder / "sandbox.py")
        listener = socket.create_server(("127.0.0.1", 0))
        script = folder / "checks.py"
        checks = [code.replace("{port}", str(listener.getsockname()[1])) for code in FALLBACK_CHECKS]
        script.write_text(CHECKS.format(module_folder=str(folder), checks=checks))
        script.chmod(0o644)
        env = {"PATH": os.environ["PATH"], "FAKE": "FAKE_SECRET"}
        done = subprocess.run(command_prefix + [str(script)], env=env, capture_output=True, text=True, timeout=120)
        listener.close()
        assert done.returncode == 0, done.stderr
        return done.stdout
    finally:
        shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root to switch uid")
def test_run_by_another_user_a_user_namespace_still_bounds_processes_and_disk(tmp_path):
    # The GPU cluster's case: the trainer is not root and may write no cgroup. The interpreter must be one this
    # uid can run: the system's.
    setpriv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
    out = check_fallback(setpriv, tmp_path)
    assert re.match(r"bubblewrap \S+, in a user namespace as uid 65534, no cgroup it may write", out), out
    assert "SECRET" not in out and "CONNECTED" not in out and "no network" in out
    # In a user namespace the kernel counts the uid's processes per namespace (Linux >= 5.14).
    assert int(re.search(r"started (\d+)", out).group(1)) < 20
    assert "No space left on device" in out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_root_without_a_cgroup_still_bounds_processes_and_disk(tmp_path):
    # A container's root, /sys/fs/cgroup read-only or absent: here a mount namespace hides the hierarchies.
    hide = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /sys/fs/cgroup && exec "$@"', "sh"]
    out = check_fallback(hide + [sys.executable, "-I"], tmp_path)
    assert re.match(r"bubblewrap \S+, as uid \d+ \(setpriv\), no cgroup it may write", out), out
    assert "SECRET" not in out and "CONNECTED" not in out and "no network" in out
    assert int(re.search(r"started (\d+)", out).group(1)) < 20
    assert "No space left on device" in out


# ---------------------------------------------------------------- the reward of docs/data-and-rewards.md


def test_the_docs_code_reward_runs_the_solution_in_the_sandbox(tmp_path, monkeypatch):
    page = (REPO / "docs" / "data-and-rewards.md").read_text()
    [source] = re.findall(r"```python\n(# code_reward\.py\n.*?)```", page, re.S)
    (tmp_path / "code_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FAKE_API_KEY", "sk-FAKE0123456789")
    from code_reward import compute_score

    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    # A solution that would pass by reading the tests' answers or the trainer's keys from the host finds neither.
    snooping = (
        "```python\nimport os\nleaks = ''\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n        leaks += open(f'/proc/{pid}/environ').read()\n"
        "    except OSError:\n        pass\n"
        "assert 'sk-FAKE' not in leaks, 'found the key'\n"
        "def add(a, b):\n    return a + b\n```"
    )
    assert compute_score("my_code", right, tests) == 1.0
    assert compute_score("my_code", wrong, tests) == 0.0
    assert compute_score("my_code", "no code here", tests) == 0.0
    assert compute_score("my_code", snooping, tests) == 1.0
