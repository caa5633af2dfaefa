"""A sandbox for code a model writes: one command at a time under bubblewrap (``bwrap``, from the OS packages), in
a scratch folder of its own, with a time limit and bounds on memory, processes, CPU and disk. The python tool
(``dsrl:python``) runs its calls here; a reward that executes code can too (docs/tools.md).

The layers, and what each buys:

- bubblewrap's namespaces. Mount: the code sees ``/usr``, the interpreter running this module (its prefixes, not
  the folders an editable install adds) and the few ``/etc`` files the dynamic loader needs, all read-only, and
  writes only to a ``/tmp`` of its own that holds its scratch folder: no home, no checkpoints, no data, no
  package to rewrite. Pid: a ``/proc`` of its own, so no other process's ``environ``, ``cwd`` or ``fd`` and no
  signal to the trainer or the workers; the first process is the namespace's init, so whatever it starts
  (``setsid`` and double forks included) is killed when it ends. Network (unless ``network``): a loopback of its
  own. IPC, UTS, cgroup: its own. No capabilities, a session of its own (``--new-session``), killed with its
  parent (``--die-with-parent``).
- An unprivileged uid. As root, bwrap makes the namespaces and ``setpriv`` drops the code to a uid of its own
  (``UID_BASE`` + this process's id), with no capabilities and no way to gain any (``no_new_privs``); run by
  another user, bwrap makes a user namespace and the code runs there as that user, with no capabilities.
- rlimits, set inside by ``prlimit``: address space per process (``memory_limit_mb``), processes and threads of
  the code's uid (``max_processes``; as root the uid is this worker's alone; in a user namespace the kernel
  counts per namespace since Linux 5.14, before that all of the user's processes count), file size
  (``disk_limit_mb``), no core dumps.
- A cgroup of its own per call where this process can make one (cgroup v1 hierarchies it may write: root on a
  v1 host): memory of all its processes together (``/tmp`` and ``/dev/shm`` included, no swap), processes, CPU
  time (``cpus``). On cgroup v2 none is made: the trainer's own cgroup holds processes, and v2 gives controllers
  only to the children of a cgroup without any.
- Size-bounded tmpfs for ``/tmp`` and ``/dev/shm`` (``disk_limit_mb`` each), so the disk is never written.

The interpreter is bound at its own path: ``[sys.executable, ...]`` runs inside as outside, and imports what is
installed (numpy, ...). This module imports nothing of dsrl: tool and reward workers use it without torch.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import select
import shutil
import site
import subprocess
import sys
import time
from dataclasses import dataclass

UID_BASE = 1_900_000_000  # + a worker's pid: far above the uids of people, services and container ranges
MIN_BWRAP = (0, 8, 0)  # --size (a bounded tmpfs) and --perms on a tmpfs
KEEP_BYTES = 2**20  # of a command's output, the first and the last MiB are kept
_MB = 2**20
_CGROUP_PREFIX = "dsrl_sandbox_"
_CGROUP_CONTROLLERS = ("memory", "pids", "cpu")
_PROBE_TIMEOUT_S = 60.0  # a first Python start-up on a loaded machine
_FIX = (
    "install bubblewrap from the OS packages (apt-get install bubblewrap, dnf install bubblewrap) or a newer "
    "build on PATH; where it is installed but cannot make namespaces, allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, a seccomp "
    "profile that allows them) or run the trainer as root"
)


class SandboxUnavailable(RuntimeError):
    """No sandbox works here: ``reason``, and ``fix``, what to install or enable."""

    def __init__(self, reason: str, fix: str = _FIX):
        super().__init__(f"{reason}; fix: {fix}")
        self.reason, self.fix = reason, fix


@dataclass(frozen=True)
class SandboxResult:
    """``output``: stdout and stderr together (of a long one the first and the last MiB). ``returncode``: the
    command's exit status, 128 + N when signal N killed it, None when it ran past the time limit
    (``timed_out``). ``out_of_memory``: the call's cgroup killed a process at ``memory_limit_mb``."""

    output: bytes
    returncode: int | None
    timed_out: bool
    out_of_memory: bool = False


class Sandbox:
    """Runs commands in bubblewrap namespaces (the module doc). Built once per process: finds bwrap, setpriv and
    prlimit on ``PATH``, the cgroups it may make, and runs a probe; raises :class:`SandboxUnavailable` when
    none of that works. One call at a time.

    Args:
        memory_limit_mb: address space of each process and, with a cgroup, memory of all together; 0 = none.
        max_processes: processes and threads at once.
        disk_limit_mb: size of ``/tmp`` (the scratch folder is in it) and of ``/dev/shm``, and of any file.
        cpus: CPU time per wall second, with a cgroup.
        network: share the host's network (and read its DNS and TLS settings) instead of a loopback of its own.
        gpus: bind the NVIDIA device nodes and ``/sys``, pass ``CUDA_VISIBLE_DEVICES``; no address-space bound.
    """

    def __init__(
        self,
        *,
        memory_limit_mb: int = 1024,
        max_processes: int = 128,
        disk_limit_mb: int = 256,
        cpus: float = 1.0,
        network: bool = False,
        gpus: bool = False,
    ):
        self.memory_limit_mb = memory_limit_mb
        self.max_processes = max_processes
        self.disk_limit_mb = disk_limit_mb
        self.cpus = cpus
        self.network, self.gpus = network, gpus
        self._bwrap, self.version = _find_bwrap()
        self._setpriv, self._prlimit, self._env = _find_tools()
        self._mounts = _mounts(network, gpus, [self._setpriv, self._prlimit, self._env])
        self._cgroup_parents = _writable_cgroup_parents()
        _remove_stale_cgroups(self._cgroup_parents.values())
        self._calls = itertools.count()
        failures = []
        # As root the code gets a uid of its own; where root cannot make the namespaces itself (a container
        # without CAP_SYS_ADMIN) or cannot switch to that uid, a user namespace may still work.
        for uid in ([UID_BASE + os.getpid()] if os.geteuid() == 0 else []) + [None]:
            self.uid = uid
            probe = self.run([sys.executable, "-I", "-c", "print('ok')"], {}, timeout_s=_PROBE_TIMEOUT_S)
            if probe.output == b"ok\n" and probe.returncode == 0:
                return
            failures.append(f"{self._how()}: {probe.output.decode(errors='replace').strip() or probe.returncode}")
        raise SandboxUnavailable(f"bubblewrap cannot run a command here ({'; '.join(failures)})")

    def describe(self) -> str:
        """How calls run: the mechanism, the uid, the cgroup controllers (or their absence)."""
        bounds = (
            f"cgroup v1 {'+'.join(self._cgroup_parents)} per call"
            if self._cgroup_parents
            else "no cgroup it may write: memory bounded per process only, no CPU bound"
        )
        return f"bubblewrap {'.'.join(map(str, self.version))}, {self._how()}, {bounds}"

    def _how(self) -> str:
        return f"in a user namespace as uid {os.getuid()}" if self.uid is None else f"as uid {self.uid} (setpriv)"

    def run(self, command: list[str], files: dict[str, str], *, timeout_s: float) -> SandboxResult:
        """Run ``command`` in a fresh scratch folder (its working directory and ``HOME``) holding ``files``
        (name -> text), with the environment ``PATH``, ``LANG`` and ``HOME`` only; stopped after ``timeout_s``
        seconds. Everything it started is gone when this returns."""
        name = f"{_CGROUP_PREFIX}{os.getpid()}_{next(self._calls)}"
        scratch = f"/tmp/{name}"
        fds = []
        try:
            for text in files.values():
                fd = os.memfd_create("sandbox_file")
                fds.append(fd)
                os.write(fd, text.encode())
                os.lseek(fd, 0, os.SEEK_SET)
            cgroups = self._make_cgroups(name)
            try:
                process = subprocess.Popen(
                    self._argv(command, scratch, dict(zip(files, fds, strict=True))),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=self._environment(scratch),
                    pass_fds=fds,
                    preexec_fn=_joiner(cgroups) if cgroups else None,
                )
                for fd in fds:
                    os.close(fd)
                fds = []
                deadline = time.monotonic() + timeout_s
                try:
                    output, timed_out = read_bounded(process.stdout.fileno(), deadline)
                    if not timed_out:  # the code may close its output and go on
                        process.wait(max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    # bwrap's init dies with bwrap (--die-with-parent), and the kernel kills every process of
                    # its pid namespace with it.
                    if process.poll() is None:
                        process.kill()
                    process.wait()
                    process.stdout.close()
                return SandboxResult(
                    output, None if timed_out else process.returncode, timed_out, _out_of_memory(cgroups)
                )
            finally:
                _remove_cgroups(cgroups)
        finally:
            for fd in fds:
                os.close(fd)

    def _argv(self, command: list[str], scratch: str, files: dict[str, int]) -> list[str]:
        disk = str(self.disk_limit_mb * _MB)
        argv = [self._bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        if not self.network:
            argv.append("--unshare-net")
        if self.uid is None:
            argv.append("--unshare-user")
        else:
            # For setpriv, which drops them with the rest.
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        argv += self._mounts
        argv += ["--perms", "1777", "--size", disk, "--tmpfs", "/tmp", "--perms", "1777", "--size", disk]
        argv += ["--tmpfs", "/dev/shm", "--perms", "0777", "--dir", scratch]
        for file_name, fd in files.items():
            argv += ["--file", str(fd), f"{scratch}/{file_name}"]
        argv += ["--chdir", scratch, "--"]
        if self.uid is not None:
            argv += [self._setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
            argv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        argv += [self._env, "-u", "PWD", "--"]  # bwrap sets it
        argv += [self._prlimit, f"--nproc={self.max_processes}", f"--fsize={disk}", "--core=0"]
        if self.memory_limit_mb and not self.gpus:  # CUDA reserves address space far past any such bound
            argv.append(f"--as={self.memory_limit_mb * _MB}")
        return argv + ["--", *command]

    def _environment(self, scratch: str) -> dict[str, str]:
        environment = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": scratch}
        if self.gpus and "CUDA_VISIBLE_DEVICES" in os.environ:
            environment["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        return environment

    def _make_cgroups(self, name: str) -> list[str]:
        made = []
        try:
            for controller, parent in self._cgroup_parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                made.append(path)
                if controller == "memory" and self.memory_limit_mb:
                    limit = str(self.memory_limit_mb * _MB)
                    _write(path, "memory.limit_in_bytes", limit)
                    if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):  # no swap past it
                        _write(path, "memory.memsw.limit_in_bytes", limit)
                elif controller == "pids":
                    _write(path, "pids.max", str(self.max_processes))
                elif controller == "cpu":
                    period = int(open(os.path.join(path, "cpu.cfs_period_us")).read())
                    _write(path, "cpu.cfs_quota_us", str(int(self.cpus * period)))
        except BaseException:
            _remove_cgroups(made)
            raise
        return made


def read_bounded(fd: int, deadline: float) -> tuple[bytes, bool]:
    """``(output, timed_out)``: what ``fd`` gives until its end of file or ``deadline``; past 2 x
    ``KEEP_BYTES`` the middle is dropped (and marked) as it is read."""
    head, tail, skipped = bytearray(), bytearray(), 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return _joined(head, tail, skipped), True
        chunk = os.read(fd, 65536)
        if not chunk:
            return _joined(head, tail, skipped), False
        room = KEEP_BYTES - len(head)
        head += chunk[:room]
        tail += chunk[room:] if room > 0 else chunk
        if len(tail) > KEEP_BYTES:
            skipped += len(tail) - KEEP_BYTES
            del tail[: len(tail) - KEEP_BYTES]


def _joined(head: bytearray, tail: bytearray, skipped: int) -> bytes:
    middle = f"\n...({skipped} bytes of output skipped)...\n".encode() if skipped else b""
    return bytes(head + middle + tail)


# ---------------------------------------------------------------- what the sandbox is made of


def _find_bwrap() -> tuple[str, tuple[int, ...]]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("no bwrap on PATH")
    text = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    version = tuple(int(part) for part in match.groups()) if match else (0, 0, 0)
    if version < MIN_BWRAP:
        raise SandboxUnavailable(
            f"{bwrap} is bubblewrap {'.'.join(map(str, version))}, older than "
            f"{'.'.join(map(str, MIN_BWRAP))}, the first that bounds the size of a tmpfs (--size)",
            "bubblewrap >= 0.8 (Debian 12, Ubuntu 24.04 and later ship it; or build it from "
            "https://github.com/containers/bubblewrap and put it on PATH)",
        )
    return bwrap, version


def _find_tools() -> tuple[str, str, str]:
    found = {name: shutil.which(name) for name in ("setpriv", "prlimit", "env")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise SandboxUnavailable(
            f"no {' or '.join(missing)} on PATH", "install util-linux and coreutils from the OS packages"
        )
    return found["setpriv"], found["prlimit"], found["env"]


def _mounts(network: bool, gpus: bool, tools: list[str]) -> list[str]:
    """bwrap's arguments for what the sandbox sees of the host, all read-only: ``/usr`` and the top-level
    links or folders beside it, the loader's and the clock's ``/etc`` files (and the resolver's and TLS's with
    ``network``), the interpreter's folders, ``setpriv`` and ``prlimit``; its own ``/dev`` and ``/proc``."""
    argv = ["--ro-bind", "/usr", "/usr"]
    bound = ["/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
            bound.append(top)
    etc = ["ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives"]
    if network:
        etc += ["resolv.conf", "hosts", "nsswitch.conf", "host.conf", "gai.conf", "ssl", "ca-certificates", "pki"]
    argv += ["--dir", "/etc"]  # 0755: bwrap would make it 0700
    for entry in etc:
        argv += ["--ro-bind-try", f"/etc/{entry}", f"/etc/{entry}"]
    made = set()
    for folder in _outside(_interpreter_folders() + [os.path.realpath(tool) for tool in tools], bound):
        # Make its parents readable to any uid: bwrap would copy the host's modes (/root is 0700).
        parents = [p for p in _parents(folder) if p not in made]
        for parent in parents:
            argv += ["--dir", parent]
        made.update(parents)
        argv += ["--ro-bind", folder, folder]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    if gpus:
        nvidia = sorted(os.path.join("/dev", name) for name in os.listdir("/dev") if name.startswith("nvidia"))
        for node in nvidia:
            argv += ["--dev-bind", node, node]
        argv += ["--ro-bind", "/sys", "/sys"]
    return argv


def _interpreter_folders() -> list[str]:
    """Where the running interpreter and its packages live: its prefixes (a venv's and its base's), the prefix
    its executable's real path is in, the site-packages folders. Not what ``.pth`` files add: an editable
    install's source tree may hold data and checkpoints."""
    executable_prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, executable_prefix}
    folders.update(site.getsitepackages())
    folders = {os.path.realpath(folder) for folder in folders if os.path.exists(folder)}
    if "/" in folders:
        raise SandboxUnavailable(
            f"{sys.executable} is installed at /, which the sandbox would have to bind whole",
            "run dsrl from a Python installed in a folder of its own (a venv, conda, pyenv)",
        )
    return sorted(folders)


def _outside(paths: list[str], bound: list[str]) -> list[str]:
    """``paths`` that no other path (or a ``bound`` one) contains, in order."""
    kept: list[str] = []
    for path in sorted(set(paths)):
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound + kept):
            kept.append(path)
    return kept


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


# ---------------------------------------------------------------- cgroups (v1)


def _writable_cgroup_parents() -> dict[str, str]:
    """``{controller: folder}`` for the cgroup v1 controllers of ``_CGROUP_CONTROLLERS`` whose hierarchy this
    process may add a child to, under its own cgroup (so that a job's or container's bound still holds)."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
    parents = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, filesystem = line.partition(" - ")
            root, mount_point = fields.split()[3:5]
            fs_type, _, options = filesystem.split()[:3]
            if fs_type != "cgroup":
                continue
            for controller in options.split(","):
                if controller in _CGROUP_CONTROLLERS and controller in own and own[controller].startswith(root):
                    folder = os.path.join(mount_point, own[controller][len(root) :].lstrip("/"))
                    if _can_make_child(folder):
                        parents[controller] = folder
    return {controller: parents[controller] for controller in _CGROUP_CONTROLLERS if controller in parents}


def _can_make_child(folder: str) -> bool:
    probe = os.path.join(folder, f"{_CGROUP_PREFIX}{os.getpid()}_probe")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError:
        return False
    return True


def _remove_stale_cgroups(parents) -> None:
    """Remove the calls' cgroups that a killed worker left (its pid gone); a cgroup with processes stays."""
    for parent in parents:
        for entry in os.listdir(parent):
            if entry.startswith(_CGROUP_PREFIX) and not _alive(int(entry[len(_CGROUP_PREFIX) :].split("_")[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _write(folder: str, name: str, value: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(value)


def _joiner(cgroups: list[str]):
    """The child's first step, between fork and exec: join the call's cgroups (plain system calls only)."""
    procs = [os.path.join(folder, "cgroup.procs").encode() for folder in cgroups]

    def join() -> None:
        for path in procs:
            fd = os.open(path, os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)

    return join


def _out_of_memory(cgroups: list[str]) -> bool:
    for folder in cgroups:
        control = os.path.join(folder, "memory.oom_control")
        if os.path.exists(control):
            return bool(re.search(r"^oom_kill [1-9]", open(control).read(), re.M))
    return False


def _remove_cgroups(cgroups: list[str]) -> None:
    """rmdir each once its processes are gone (the pid namespace is torn down just after bwrap exits)."""
    deadline = time.monotonic() + 5
    for folder in cgroups:
        while True:
            try:
                os.rmdir(folder)
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    break  # a later Sandbox removes it once this process is gone
                time.sleep(0.005)
