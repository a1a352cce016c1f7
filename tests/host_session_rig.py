"""What the host-session tests share: this run's processes found in /proc by PID, small trees and their checks,
and the rig (a run's pool of host sessions with a runtime directory of its own)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from staging_core import StagingOptions, fetch, send
from staging_core.far_side.host_session import HostSessions
from staging_core.testing import snapshot
from tests.servers import SSHServer

PARTIAL = ".pallet-partial"
DEADLINE_S = 60.0


# ---------------------------------------------------------------- processes, found in /proc by PID

def argvs() -> dict[int, list[bytes]]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    found[int(entry)] = handle.read().split(b"\0")
            except OSError:
                continue
    return found


def far_serves(tag: str) -> list[int]:
    """The far sides (``python -X TAG -m mpi_stager serve``) of this test's run (its own -X tag)."""
    return [pid for pid, argv in argvs().items() if tag.encode() in argv and argv[-2:] == [b"serve", b""]]


def serve_clients(tag: str) -> list[int]:
    """The local ssh processes that run this test's far sides."""
    return [pid for pid, argv in argvs().items() if os.path.basename(argv[0]) == b"ssh"
            and any(tag.encode() in word and b"mpi_stager serve" in word for word in argv)]


def masters(runtime: Path) -> list[int]:
    """The ssh ControlMasters whose socket is in ``runtime``'s directory of kept connections."""
    where = f"ControlPath={runtime}/pallet/".encode()
    return [pid for pid, argv in argvs().items() if b"-N" in argv and any(w.startswith(where) for w in argv)]


def wait_until(check: Callable[[], object], what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)
    return value


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def read_chars(pid: int) -> int:
    with open(f"/proc/{pid}/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


def open_files(pid: int) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return found


def pending_input(pid: int) -> int:
    """Bytes written to process ``pid``'s stdin pipe that it has not read yet."""
    fd = os.open(f"/proc/{pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    finally:
        os.close(fd)


# ---------------------------------------------------------------- trees

def make_tree(root: Path, count: int, size: int, prefix: str = "d") -> list[str]:
    names = []
    for n in range(count):
        rel = f"{prefix}{n % 3}/f{n:04d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(size))
        names.append(rel)
    return names


def wrong_files(src: Path, dest: Path) -> list[str]:
    """Files under ``dest`` (outside `.pallet-partial`) whose bytes are not those of ``src``'s file of that name."""
    wrong = []
    for top, dirs, files in os.walk(dest):
        dirs[:] = [d for d in dirs if d != PARTIAL]
        for name in files:
            rel = os.path.relpath(os.path.join(top, name), dest)
            if not (src / rel).is_file() or (src / rel).read_bytes() != Path(top, name).read_bytes():
                wrong.append(rel)
    return wrong


def assert_same_files(src: Path, dest: Path) -> None:
    """``dest`` holds exactly ``src``'s paths, its files with their bytes, modes and mtimes (its directories'
    own modes and mtimes aside: see test_an_inline_fetch_gives_parent_directories_their_times)."""
    def files(root: Path) -> dict:
        return {rel: entry if entry[0] != "d" else "d" for rel, entry in snapshot(root).items()}
    assert files(src) == files(dest)


def partials(*roots: Path) -> list[str]:
    return [top for root in roots for top, dirs, files in os.walk(root) if PARTIAL in dirs + files]


def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list]:
    """``work`` started in a thread; the list gets its result or the exception it raised."""
    box: list = []

    def run() -> None:
        try:
            box.append(work())
        except BaseException as exc:  # handed to the test
            box.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# ---------------------------------------------------------------- the rig: a run's pool, its own runtime directory

@dataclass
class Rig:
    sshd: SSHServer
    work: Path
    runtime: Path
    tag: str
    options: StagingOptions
    pool: HostSessions

    def url(self, rel: str) -> str:
        return self.sshd.url(str(self.work / rel))

    def session(self):
        (session,) = self.pool.all()
        return session

    def send(self, src: Path, items: list[str], dest: str = "dest", **kw):
        return send(str(src), items, self.url(dest), self.options, sessions=self.pool, **kw)

    def fetch(self, items: list[str], dest: Path, src: str = "dest", tree: Path | None = None):
        sizes = [(tree / i).stat().st_size for i in items] if tree is not None else None
        return fetch(self.url(src), items, str(dest), self.options, sizes=sizes, sessions=self.pool)


def make_rig(sshd, tmp_path: Path, monkeypatch, idle_s: float = 60.0, keep: float | None = None,
             remote_python: str | None = None) -> Rig:
    runtime = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))      # short: a socket's path holds 108 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    tag = f"pallet_test_{uuid.uuid4().hex[:12]}"
    python = remote_python or f"{sys.executable} -X {tag}"            # -X TAG: our far sides, found by argv
    options = StagingOptions(ssh_options=tuple(sshd.ssh_options), remote_python=python,
                             transport_options={"ssh": {"keep": keep}} if keep is not None else {})
    return Rig(sshd, tmp_path, runtime, tag, options, HostSessions(idle_s=idle_s))


def end_rig(rig: Rig) -> None:
    """Close the pool, and end whatever this test's run left (by PID), its kept connections and runtime dir."""
    rig.pool.close()
    for pid in far_serves(rig.tag):
        kill(pid, signal.SIGCONT)
        kill(pid)
    for sock in (rig.runtime / "pallet").glob("ssh-*"):
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "x"], capture_output=True, timeout=30)
    for pid in masters(rig.runtime):
        kill(pid)
    shutil.rmtree(rig.runtime, ignore_errors=True)
