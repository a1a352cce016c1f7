"""Where a kept ssh connection's socket lives: a private directory of this user, checked before every use."""
from __future__ import annotations

import hashlib
import os
import socket
import stat
import subprocess
from collections.abc import Sequence

from bundles.errors import SetupError

from .base import Endpoint

SESSION_DIR_NAME = "pallet"
_MAX_DIR = 60           # a socket's path (this, "/ssh-" and 20 characters, and ssh's temporary suffix) fits 108 bytes


def session_directory() -> str:
    """This user's directory for kept connections: ``$XDG_RUNTIME_DIR/pallet`` when that runtime directory is
    set (and short enough for a socket's path), else ``/tmp/pallet-UID``. Made with
    mode 0700 if missing; SetupError, naming it and the fix, when it is a link, not a directory, owned by
    another user, or open to others (anyone who can reach the socket can run commands as you there)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    path = os.path.join(runtime, SESSION_DIR_NAME)
    if not runtime or not os.path.isabs(runtime) or len(path) > _MAX_DIR:
        path = f"/tmp/pallet-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SetupError(f"cannot make the directory of kept ssh connections ({exc.strerror})", path,
                         "make it writable, set XDG_RUNTIME_DIR to a directory of yours, or pass --ssh-keep 0") \
            from None
    check_private(path, directory=True)
    return path


def check_private(path: str, directory: bool) -> None:
    """SetupError unless ``path`` (not followed if a link) is this user's own and closed to others: a
    directory (``directory``) of mode 0700, or a socket of no group or other access."""
    info = os.lstat(path)
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISSOCK(info.st_mode)
    what = "directory of kept ssh connections" if directory else "kept ssh connection's socket"
    if not kind_ok:
        raise SetupError(f"the {what} is not a {'directory' if directory else 'socket'}", path,
                         "remove it (pallet makes it again)")
    if info.st_uid != os.geteuid():
        raise SetupError(f"the {what} belongs to user {info.st_uid}, not to you: refused", path,
                         "remove it (pallet makes its own), or set XDG_RUNTIME_DIR to a directory of yours")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise SetupError(f"the {what} has mode {stat.S_IMODE(info.st_mode):04o}, open to others: refused", path,
                         f"chmod {'700' if directory else '600'} {path}, or remove it")


def socket_path(directory: str, endpoint: Endpoint, ssh_options: Sequence[str]) -> str:
    """The socket of the kept connection to ``endpoint``'s user, host and port with ``ssh_options``, in
    ``directory``: one name per combination, short enough for a socket's path limit."""
    key = repr((endpoint.user, endpoint.host, endpoint.port, list(ssh_options))).encode()
    return os.path.join(directory, "ssh-" + hashlib.sha256(key).hexdigest()[:20])


def users_control_path(ssh_argv: Sequence[str]) -> str | None:
    """The ControlPath the user's ssh configuration sets for ``ssh_argv`` (``ssh [options] destination``, as
    ``ssh -G`` expands it), or None when it sets none."""
    try:
        done = subprocess.run([ssh_argv[0], "-G", *ssh_argv[1:]], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.decode(errors="replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "controlpath" and value and value != "none":
            return value
    return None


def listening(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path`` (a master that died leaves its socket
    file behind, refusing them): one connect, no ssh started."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def master_answers(client_argv: Sequence[str], socket: str, destination: str) -> bool:
    """Whether a master listens on ``socket`` (``ssh -O check``), asked through ``client_argv``'s ssh."""
    try:
        done = subprocess.run([*client_argv, "-o", f"ControlPath={socket}", "-O", "check", destination],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
