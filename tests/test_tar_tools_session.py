"""The tar-tools session at its floor: DEST's lock taken inside it, digests checked there, mtimes at whole seconds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bundles.errors import DestinationError, DestinationLocked
from bundles.progress import NoProgress
from bundles.scan import scan
from staging_core.locking import DestinationLock
from staging_core.routes.tar_tools import TarToolsRoute, session_lock
from staging_core.routes.tar_tools_push import push_tar_tools
from staging_core.testing import assert_same_tree, make_nasty_tree, snapshot
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_transport
from tests.programs import user_env
from tests.servers import start_bare_sshd
from tests.test_tar_tools_route import SLOW_ZSTD, _kill_when_landed, push, random_tree, summary

SECOND = 1_000_000_000

# The far side's tar, which flips the first byte of the file named in $HOME/corrupt after each extraction: once,
# or every time while $HOME/corrupt-always exists.
CORRUPTING_TAR = """#!/bin/sh
/usr/bin/tar "$@" || exit $?
if [ -s "$HOME/corrupt" ]; then
  victim=$(cat "$HOME/corrupt")
  if [ -f "$victim" ]; then
    printf '\\377' | dd of="$victim" bs=1 count=1 conv=notrunc 2>/dev/null
    [ -e "$HOME/corrupt-always" ] || rm -f "$HOME/corrupt"
  fi
fi
"""

# A pusher in a process of its own (so that a test can kill it): a push through the session's lock.
PUSHER = """
import sys
from bundles.progress import NoProgress
from bundles.scan import scan
from staging_core.routes.tar_tools import TarToolsRoute, session_lock
from staging_core.routes.tar_tools_push import push_tar_tools
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_transport

src, url, *ssh = sys.argv[1:]
endpoint = parse_url(url)
with open_transport(endpoint, ssh_options=ssh) as transport:
    route = TarToolsRoute("127.0.0.1", "zstd")
    with session_lock(route, endpoint, transport):
        print("held", flush=True)
        if src == "-":
            sys.stdin.read()
        else:
            push_tar_tools(transport, scan(src, "zstd", 0), endpoint, route, 1, NoProgress())
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """An sshd whose sessions have no pallet on their PATH (tests.servers.start_bare_sshd)."""
    server = start_bare_sshd(tmp_path_factory.mktemp("bare"))
    try:
        yield server
    finally:
        server.stop()


class Far:
    """DEST at the bare far side, pushed to through the tar-tools session's own lock, in this process."""

    def __init__(self, server, dest: Path):
        self.server, self.dest = server, dest
        self.endpoint = parse_url(server.url(str(dest)))

    def transport(self):
        return open_transport(self.endpoint, ssh_options=list(self.server.ssh_options))

    def lock(self, transport, wait: bool = False, route: TarToolsRoute | None = None) -> DestinationLock:
        """DEST's lock, taken by a tar-tools session there."""
        lock = session_lock(route or TarToolsRoute("127.0.0.1", "zstd"), self.endpoint, transport, wait)
        assert lock is not None
        return lock

    def push(self, src: Path, wait: bool = False):
        route = TarToolsRoute("127.0.0.1", "zstd")
        with self.transport() as transport, self.lock(transport, wait, route):
            return push_tar_tools(transport, scan(str(src), "zstd", 0), self.endpoint, route, 1, NoProgress())

    def pusher(self, src: str) -> subprocess.Popen:
        """A pusher process (``src`` "-": it holds the lock until its stdin ends) that has printed "held"."""
        process = subprocess.Popen([sys.executable, "-c", PUSHER, src, self.server.url(str(self.dest)),
                                    *self.server.ssh_options], env=user_env(), start_new_session=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert process.stdout is not None and process.stdout.readline() == b"held\n", process.stderr
        return process


def test_a_push_through_the_sessions_own_lock_leaves_the_source_tree_and_nothing_else(bare, tmp_path):
    src = Path(make_nasty_tree(str(tmp_path / "src")))
    far = Far(bare, tmp_path / "dest")
    first = far.push(src)
    assert first.rounds == 1 and first.files_sent > 0
    assert_same_tree(src, tmp_path / "dest", whole_seconds=True)          # strict: nothing of pallet's is left
    assert os.stat(tmp_path / "dest").st_mtime_ns == os.stat(src).st_mtime_ns     # DEST's own time, set there
    again = far.push(src)
    assert again.rounds == 0 and again.bytes_sent == 0 and again.in_place == first.files_sent


def test_the_session_holds_dests_lock_against_every_other_run(bare, tmp_path):
    far = Far(bare, tmp_path / "dest")
    with far.transport() as transport:
        with far.lock(transport):
            with pytest.raises(DestinationLocked), DestinationLock(far.endpoint, transport):
                pass
            with pytest.raises(DestinationLocked), far.lock(transport):
                pass
        with DestinationLock(far.endpoint, transport), pytest.raises(DestinationLocked), far.lock(transport):
            pass                                              # the other way round
    assert os.listdir(tmp_path / "dest") == []                # an idle session leaves nothing behind


def test_a_waiting_session_takes_the_lock_once_its_holder_is_gone(bare, tmp_path):
    far = Far(bare, tmp_path / "dest")
    holder = far.pusher("-")
    released, seen = threading.Event(), []

    def wait_for_it() -> None:
        with far.transport() as transport, far.lock(transport, wait=True):
            seen.append(released.is_set())

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    released.set()
    os.killpg(holder.pid, signal.SIGKILL)                     # the lock dies with its process
    holder.wait()
    waiter.join()
    assert seen == [True]


def test_a_push_killed_mid_transfer_with_the_sessions_lock_resumes(bare, tmp_path):
    src = random_tree(tmp_path / "src")
    far = Far(bare, tmp_path / "dest")
    slow = bare.shims / "zstd"
    slow.write_text(SLOW_ZSTD)
    slow.chmod(0o755)
    try:
        _kill_when_landed(far.pusher(str(src)), far.dest)
        assert (far.dest / ".pallet" / "INCOMPLETE").exists()
    finally:
        slow.unlink()
    rerun = far.push(src, wait=True)                          # waits for the killed push's tar, if it still writes
    assert 0 < rerun.files_sent < 300 and rerun.in_place > 300, rerun
    assert_same_tree(src, far.dest, whole_seconds=True)


def test_a_byte_flipped_there_after_its_tar_is_found_there_and_sent_again(bare, tmp_path):
    src = Path(make_nasty_tree(str(tmp_path / "src")))
    dest = tmp_path / "dest"
    corrupting = bare.shims / "tar"
    corrupting.write_text(CORRUPTING_TAR)
    corrupting.chmod(0o755)
    try:
        (bare.home / "corrupt").write_text("sub/dir/hard_c")       # once: the second send lands intact
        once = summary(push(bare, src, dest, "--strategy", "bundle", "--reprobe"))
        assert once["attempts"] == 1 and not (bare.home / "corrupt").exists(), once
        assert_same_tree(src, dest, whole_seconds=True)
        (bare.home / "corrupt-always").touch()
        (bare.home / "corrupt").write_text("empty.txt")
        (dest / "empty.txt").unlink()
        failed = push(bare, src, dest, "--strategy", "bundle", "--retries", "0")
        assert failed.returncode != 0 and "empty.txt" in failed.stderr and "after 2 sends" in failed.stderr, failed
    finally:
        corrupting.unlink()
        (bare.home / "corrupt-always").unlink(missing_ok=True)
        (bare.home / "corrupt").unlink(missing_ok=True)
    repaired = summary(push(bare, src, dest, "--strategy", "bundle"))
    assert repaired["files"] == 1, repaired
    assert_same_tree(src, dest, whole_seconds=True)


def test_a_file_changed_there_with_its_metadata_kept_is_found_by_the_check_there(bare, tmp_path):
    src = Path(make_nasty_tree(str(tmp_path / "src")))
    far = Far(bare, tmp_path / "dest")
    far.push(src)
    for name in ("sub/dir/hard_c", "new\nline.txt"):         # a check line, and a name md5sum -c cannot read back
        victim = far.dest / name
        before = os.stat(victim)
        data = bytearray(victim.read_bytes())
        data[0] ^= 0x01
        victim.write_bytes(bytes(data))
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    repaired = far.push(src)
    assert repaired.rounds == 1 and repaired.files_sent == 2, repaired     # hard_c's group, and the other
    assert_same_tree(src, far.dest, whole_seconds=True)


def _sub_second_tree(src: Path) -> Path:
    """Files and directories whose mtimes have nanoseconds, none of them near a second's end."""
    for n in range(40):
        path = src / f"d{n // 10}" / f"f{n:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"%04d" % n)
        os.utime(path, ns=(1_700_000_000 * SECOND + n * SECOND + 123_456_789,) * 2)
    for n in range(4):
        os.utime(src / f"d{n}", ns=(1_700_000_100 * SECOND + 987_654_321,) * 2)
    return src


def _whole_seconds(root: Path) -> None:
    """What a far tar that restores whole seconds leaves: every mtime floored to its second."""
    for top, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            st = os.lstat(os.path.join(top, name))
            os.utime(os.path.join(top, name), ns=(st.st_atime_ns, st.st_mtime_ns - st.st_mtime_ns % SECOND),
                     follow_symlinks=False)


def _to_the_second(root: Path) -> dict:
    """The tree's snapshot with every mtime in whole seconds."""
    return {path: (kind, mode, mtime - mtime % SECOND, *rest) for path, (kind, mode, mtime, *rest)
            in snapshot(root).items()}


@pytest.mark.parametrize("far_tar", ["whole seconds", "nanoseconds"])
def test_mtimes_compare_at_whole_seconds_and_changes_are_still_found(bare, tmp_path, far_tar):
    src = _sub_second_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    summary(push(bare, src, dest, "--strategy", "bundle"))
    if far_tar == "whole seconds":
        _whole_seconds(dest)
    assert _to_the_second(dest) == _to_the_second(src)
    again = summary(push(bare, src, dest, "--strategy", "bundle"))
    assert again["files"] == 0 and again["bytes_sent"] == 0 and again["transfers"] == 0, again
    same_second = src / "d0" / "f01.txt"                      # same size and second, other content and ns
    mtime = os.stat(same_second).st_mtime_ns
    same_second.write_bytes(b"XXXX")
    os.utime(same_second, ns=(mtime + 500_000_000,) * 2)
    longer = src / "d1" / "f12.txt"                           # same second, another size
    mtime = os.stat(longer).st_mtime_ns
    longer.write_bytes(b"12345")
    os.utime(longer, ns=(mtime,) * 2)
    later = src / "d2" / "f23.txt"                            # same size and content, another second
    os.utime(later, ns=(os.stat(later).st_mtime_ns + SECOND,) * 2)
    for directory in ("d0", "d1", "d2"):
        os.utime(src / directory, ns=(1_700_000_100 * SECOND + 987_654_321,) * 2)
    third = summary(push(bare, src, dest, "--strategy", "bundle"))
    assert third["files"] == 3 and third["in_place"] == 37, third
    assert _to_the_second(dest) == _to_the_second(src)


def test_a_check_that_did_not_cover_every_line_is_an_error(bare, tmp_path):
    src = Path(make_nasty_tree(str(tmp_path / "src")))
    far = Far(bare, tmp_path / "dest")
    quiet = bare.shims / "md5sum"                             # an md5sum -c that checks nothing and says so
    quiet.write_text('#!/bin/sh\ncase " $* " in *" -c "*) cat > /dev/null; exit 0 ;; esac\nexec /usr/bin/md5sum "$@"\n')
    quiet.chmod(0o755)
    try:
        with pytest.raises(DestinationError, match="md5sum -c checked 0 of"):
            far.push(src)
    finally:
        quiet.unlink()
    far.push(src)
    assert_same_tree(src, far.dest, whole_seconds=True)
