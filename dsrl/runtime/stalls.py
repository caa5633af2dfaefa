"""What a rank that makes no progress waits on, said while it waits.

Start-up can wait long and silently. DeepSpeed builds its ops (CPU Adam, fused Adam, the shared-memory collectives)
with torch's ``cpp_extension`` on first use, minutes each, under torch's extension lock:
``<TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<python>_<accelerator>>/<op>/lock``
(``torch.utils.file_baton.FileBaton``: created with O_EXCL, held open by the building process, removed when the
build is done). A build that is killed leaves the file behind, and every later process that needs the op waits
for it to go (``FileBaton.wait``), forever, at 0% CPU, printing nothing. The lock holds no pid, but its builder
holds it open: a lock that no process on this machine holds open (``lock_holders``, from /proc) was left by an
interrupted build, and removing it frees the op.

- ``waiting_on``: what a thread's stack says it waits on: torch's extension lock (held by a build, or left behind:
  the file to remove) or the build of an op (``extension_wait``), the other ranks in a ``torch.distributed`` call;
  None otherwise.
- ``startup_watchdog``: while start-up runs, a thread that, once this rank has made no progress for a minute (its
  phase and the innermost line of dsrl it is at unchanged), says on every rank where it is and what it waits on,
  and again every minute it stays there.
- ``stale_extension_locks``: the extension locks no process holds open, for a check before ops are built.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from dsrl.runtime.phases import current_phase

logger = logging.getLogger(__name__)

STALL_REPORT_S = 60.0
_DSRL_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def extensions_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else its per-user cache (``~/.cache/torch_extensions``,
    one folder per Python and accelerator under it)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def lock_holders(path: Path) -> list[int]:
    """The processes on this machine that hold ``path`` open (their /proc/<pid>/fd), this one included. A process
    whose descriptors cannot be read (another user's) is not counted."""
    target = os.path.realpath(path)
    holders = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd.path) == target for fd in os.scandir(f"/proc/{entry.name}/fd")):
                holders.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return holders


def stale_extension_locks(root: Path | None = None) -> list[Path]:
    """The extension locks under ``root`` (default ``extensions_root()``; ``<op>/lock`` and ``<python>/<op>/lock``)
    that no process holds open: each was left by an interrupted build, and every process that needs its op waits on
    it forever. Checked twice, a second apart, so that a build releasing its lock (closed, not yet removed) is not
    taken for one."""
    root = extensions_root() if root is None else root
    found = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    if not found:
        return []
    unheld = [lock for lock in found if not lock_holders(lock)]
    if unheld:
        time.sleep(1.0)
    return [lock for lock in unheld if lock.exists() and not lock_holders(lock)]


def lock_report(lock: Path) -> str:
    """Waiting for torch's extension lock ``lock`` (``<op>/lock``), in words: who holds it, or, when no process
    does, the file to remove."""
    op = lock.parent.name
    holders = lock_holders(lock)
    if holders:
        return (
            f"waiting for torch's extension lock {lock}, which process {holders[0]} ({_command(holders[0])}) holds "
            f"while it builds DeepSpeed's op {op}: this process goes on when that build is done"
        )
    try:
        age = f", left {_duration(time.time() - lock.stat().st_mtime)} ago"
    except OSError:  # removed meanwhile: the next look says what comes next
        age = ""
    return (
        f"waiting for torch's extension lock {lock}, which no process on this machine holds open{age}: a build of "
        f"DeepSpeed's op {op} was interrupted and left it, and every process that needs {op} waits for it to go, "
        f"forever; fix: remove {lock} (unless a machine that shares this directory builds {op} now), and this run "
        "goes on"
    )


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().decode(errors="replace").split("\0")).strip()[:120] or "?"
    except OSError:
        return "?"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _frames(frame: FrameType | None) -> list[FrameType]:
    """``frame`` and its callers, innermost first."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    return stack


def _in(frame: FrameType, path: str, function: str) -> bool:
    return frame.f_code.co_name == function and frame.f_code.co_filename.endswith(path)


def waiting_on(frame: FrameType | None) -> str | None:
    """What the thread whose innermost frame is ``frame`` waits on, in words, when its stack says: torch's extension
    lock or the build of an op (``extension_wait``), the other ranks in a ``torch.distributed`` call; None
    otherwise."""
    if (what := extension_wait(frame)) is not None:
        return what
    distributed = os.sep + os.path.join("torch", "distributed") + os.sep
    call = next((f for f in reversed(_frames(frame)) if distributed in f.f_code.co_filename), None)  # the outermost
    if call is not None:
        return (
            f"waiting for the other ranks in torch.distributed's {call.f_code.co_name}: a rank that does not come "
            "says itself where it is"
        )
    return None


def extension_wait(frame: FrameType | None) -> str | None:
    """When the stack of ``frame`` waits for torch's extension lock (``lock_report``) or builds an op, that in words;
    else None."""
    for f in _frames(frame):
        if _in(f, os.path.join("torch", "utils", "file_baton.py"), "wait"):
            return lock_report(Path(f.f_locals["self"].lock_file_path))
        if _in(f, os.path.join("torch", "utils", "cpp_extension.py"), "_jit_compile"):
            name, directory = f.f_locals.get("name", "?"), f.f_locals.get("build_directory", "?")
            return (
                f"compiling (or loading) DeepSpeed's op {name} in {directory}: minutes the first time on a "
                "machine; later runs load it from there"
            )
    return None


def in_call(frame: FrameType) -> str:
    """``in function (file:line)`` of ``frame``: where a thread is when nothing on its stack says what it waits on."""
    return f"in {frame.f_code.co_name} ({_shown(frame.f_code.co_filename)}:{frame.f_lineno})"


def _shown(filename: str) -> str:
    """``filename`` from the package it belongs to (``dsrl/...``, ``torch/...``) when it is one's."""
    if filename.startswith(_DSRL_DIR):
        return "dsrl/" + filename[len(_DSRL_DIR) :]
    return filename.rpartition(f"site-packages{os.sep}")[2]


def _where(frame: FrameType) -> str:
    """``file:line in function`` of the innermost frame of dsrl's code on the stack (the innermost of all without)."""
    stack = _frames(frame)
    mine = next((f for f in stack if f.f_code.co_filename.startswith(_DSRL_DIR)), stack[0])
    return f"{_shown(mine.f_code.co_filename)}:{mine.f_lineno} in {mine.f_code.co_name}"


@contextmanager
def startup_watchdog(report_after_s: float = STALL_REPORT_S) -> Iterator[None]:
    """Within ``with``: when the thread that entered it has made no progress for ``report_after_s`` seconds (the same
    phase, ``dsrl.runtime.phases``, and the same innermost line of dsrl), say so on every rank: where it is and
    what it waits on (``waiting_on``, else the call it is in); again every ``report_after_s`` while it stays. A
    thread that looks every ``report_after_s / 6`` seconds (10 s)."""
    done = threading.Event()
    watched = threading.get_ident()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def watch() -> None:
        last, since, reports = None, time.monotonic(), 0
        while not done.wait(report_after_s / 6):
            frame = sys._current_frames().get(watched)
            if frame is None:
                return
            here = (current_phase(), _where(frame))
            now = time.monotonic()
            if here != last:
                last, since, reports = here, now, 0
            elif now - since >= report_after_s * (reports + 1):
                reports += 1
                what = waiting_on(frame) or f"{in_call(frame)}; nothing there says what it waits on"
                logger.warning(
                    f"rank {rank} on {socket.gethostname()}: no progress for {now - since:.0f} s in phase {here[0]!r} "
                    f"at {here[1]}: {what}",
                    extra={"all_ranks": True},
                )
            del frame  # a frame kept between looks would keep its locals alive

    threading.Thread(target=watch, name="dsrl-startup-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()
