"""Byte ranges of a far-side file over one ssh channel: the source behind reading a remote bundle in place."""
from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import threading
from typing import IO

from bundles.errors import UsageError
from bundles.view import BundleView

from staging_core.transports.registry import capable, declared_capabilities
from staging_core.transports.base import parse_url
from staging_core.transports.errors import TransportError, classify
from staging_core.transports.ssh import SSHTransport

TAIL_BYTES = 64 << 10           # fetched once at the start: the locator and a small index are read from it
# A link that stalls is given up after about a minute, so a mount waiting on it does not hang.
_KEEPALIVE = ("-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")
# The far side needs only a POSIX sh, GNU dd and head. It prints the file's size, then answers each
# "OFFSET LENGTH" line with exactly LENGTH bytes (the range clipped by the client to the size it was told;
# zeros pad a file that shrank since, which the shard hashes then refuse).
_RANGE_SCRIPT = r"""
f=$1
size=$(wc -c < "$f") || exit 3
echo "$size"
while read -r off len; do
  { dd if="$f" bs=1048576 iflag=skip_bytes,count_bytes skip="$off" count="$len" status=none; cat /dev/zero; } |
    head -c "$len" || exit 4
done
"""


def is_remote_bundle(bundle: str) -> bool:
    """True for ``ssh://HOST/PATH`` and ``[user@]host:/path`` (a local file of that name wins)."""
    return bundle.startswith("ssh://") or (":" in bundle.split("/", 1)[0] and not os.path.exists(bundle))


class RemoteRanges:
    """A ByteSource over a file on an ssh host: one far-side ``sh`` reads the ranges asked for, in turn.

    Opening starts the session and learns the size and the file's last
    ``TAIL_BYTES`` (served from memory afterwards). Reads are serialised on
    the one channel; ``bytes_fetched`` counts what crossed it. Any failure of
    the session is a TransportError naming ``host:path`` and what the far
    side printed; the session is then dead, and every later read raises the
    same error. ``close()`` ends the session and the ssh connection.
    """

    def __init__(self, transport: SSHTransport, path: str):
        self.transport, self.path = transport, path
        self.name = f"{transport.endpoint.host}:{path}"
        self.bytes_fetched = 0
        self._lock = threading.Lock()
        self._dead: TransportError | None = None
        self._process = transport.stream_into(["sh", "-c", _RANGE_SCRIPT, "sh", path])
        self._stdin, self._stdout, self._stderr = _pipes(self._process)
        try:
            self.size = self._read_size()
            tail_start = max(0, self.size - TAIL_BYTES)
            self._tail_start = tail_start
            self._tail = self._fetch(self.size - tail_start, tail_start)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open_url(cls, url: str, ssh_options: tuple[str, ...] = ()) -> RemoteRanges:
        """The source for ``ssh://[user@]host[:port]/abs/path`` or ``[user@]host:/abs/path``; each of
        ``ssh_options`` is split as a shell would (``"-o ConnectTimeout=5"`` is two arguments)."""
        ssh_options = tuple(part for option in ssh_options for part in shlex.split(option))
        endpoint = parse_url(url)
        if not capable(declared_capabilities(endpoint.scheme), frozenset({"byte_ranges"})):
            raise UsageError(f"reading a bundle in place needs an ssh URL or a local path, not {endpoint.scheme}://",
                             url, "copy the bundle here first (pallet pull), or give ssh://HOST/PATH")
        return cls(SSHTransport(endpoint, (*_KEEPALIVE, *ssh_options)), endpoint.path)

    def pread(self, length: int, offset: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        if length == 0:
            return b""
        if offset >= self._tail_start:
            start = offset - self._tail_start
            return self._tail[start:start + length]
        with self._lock:
            return self._fetch(length, offset)

    def _read_size(self) -> int:
        line = self._stdout.readline()
        if not line.strip().isdigit():
            raise self._failure("cannot open the bundle at the far side")
        return int(line)

    def _fetch(self, length: int, offset: int) -> bytes:
        if self._dead is not None:
            raise self._dead
        if length == 0:
            return b""
        try:
            self._stdin.write(b"%d %d\n" % (offset, length))
            self._stdin.flush()
        except OSError:
            raise self._failure("the far side's range reader stopped") from None
        data = self._stdout.read(length)
        if len(data) != length:
            raise self._failure("the far side's range reader stopped")
        self.bytes_fetched += length
        return data

    def _failure(self, message: str) -> TransportError:
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            stderr = self._stderr.read().decode(errors="replace")
            status: int | None = self._process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            stderr, status = "", None
        dead = classify(stderr, status, None, self.name, message)
        self._dead = dead if isinstance(dead, TransportError) else TransportError(str(dead), self.name)
        return self._dead

    def close(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None:
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:       # a session that will not end is killed
                process.kill()
                process.wait()
        self.transport.close()


def _pipes(process: subprocess.Popen) -> tuple[IO[bytes], IO[bytes], IO[bytes]]:
    """The three pipes of a far-side process started with all three (stream_into always pipes them)."""
    stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
    assert stdin is not None and stdout is not None and stderr is not None, "stream_into pipes all three"
    return stdin, stdout, stderr


def open_view(bundle: str, cache_bytes: int, ssh_options: tuple[str, ...] = ()) -> BundleView:
    """The view of a local bundle path (with its sidecar) or of an ssh:// (or host:/path) bundle."""
    if is_remote_bundle(bundle):
        return BundleView.from_source(RemoteRanges.open_url(bundle, ssh_options), cache_bytes)
    return BundleView.open(bundle, cache_bytes)
