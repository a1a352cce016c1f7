"""What a push or pull pays before its first shard and after its last: the far side's start, the session's end."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bundles.progress import NoProgress
from mpi_stager.__main__ import _send_args, _session_args, build_parser
from mpi_stager.session import _listing
from mpi_stager.wire import LISTING_ARGV
from staging_core.far_side.session import FarSession
from staging_core.far_side.streaming import stream_push
from staging_core.options import StagingOptions
from staging_core.transports.base import parse_url
from staging_core.transports.registry import open_endpoint
from tests.conftest import assert_same_tree, make_nasty_tree


@pytest.mark.parametrize("argv", [["session", "/d"], ["session", "--list", "/d"], ["session", "/d", "--wait"],
                                  ["session", "--wait", "--list", "with space"]])
def test_the_session_reads_its_arguments_as_argparse_does(argv):
    fast = _session_args(argv)
    parsed = build_parser().parse_args(argv)
    assert fast is not None and (fast.dest, fast.list, fast.wait) == (parsed.dest, parsed.list, parsed.wait)


@pytest.mark.parametrize("argv", [["session"], ["session", "--li", "/d"], ["session", "--list", "--list", "/d"],
                                  ["session", "-h"], ["session", "a", "b"], ["receive", "/d"], []])
def test_anything_else_is_left_to_argparse(argv):
    assert _session_args(argv) is None


@pytest.mark.parametrize("argv", [["send", "/s"], ["send", "--codec", "gzip", "/s"], ["send", "/a b", "--jobs", "4"],
                                  ["send", "--codec", "none", "--shard-size", "1048576", "--jobs", "2",
                                   "--files-from", "-", "/s"]])
def test_send_reads_the_arguments_a_pull_gives_it_as_argparse_does(argv):
    parsed = {name: value for name, value in vars(build_parser().parse_args(argv)).items()
              if name not in ("command", "version")}
    assert vars(_send_args(argv)) == parsed


@pytest.mark.parametrize("argv", [["send"], ["send", "--codec", "lz4", "/s"], ["send", "--jobs", "-1", "/s"],
                                  ["send", "--jobs", "2", "--jobs", "3", "/s"], ["send", "/a", "/b"],
                                  ["send", "-h"], ["send", "--codec"], ["send", "--shard", "5", "/s"]])
def test_send_leaves_anything_else_to_argparse(argv):
    assert _send_args(argv) is None


def test_the_wire_loads_a_module_only_when_one_of_its_names_is_used():
    code = ("import sys, mpi_stager.wire as wire; loaded = lambda: sorted(m for m in sys.modules "
            "if m.startswith('mpi_stager.wire.')); before = loaded(); wire.Hello; "
            "print(before, loaded(), all(getattr(wire, n) is not None for n in wire.__all__))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("] ")[:2] == ["[", "['mpi_stager.wire.hello', 'mpi_stager.wire.versions'"]
    assert done.stdout.strip().endswith("True")


@pytest.mark.parametrize("inside", [(), (".pallet",), ("a",), (".pallet", "a")])
def test_the_listing_of_a_dest_is_what_find_prints(tmp_path, inside):
    for name in inside:
        (tmp_path / name).mkdir()
    found = subprocess.run(LISTING_ARGV, cwd=tmp_path, capture_output=True, check=True).stdout
    assert _listing(str(tmp_path)) == found


def test_a_last_stream_ends_the_session_with_its_clear(sshd, tmp_path):
    src, dest = make_nasty_tree(str(tmp_path / "src")), tmp_path / "dest"
    (dest / ".pallet" / "old").mkdir(parents=True)
    endpoint = parse_url(sshd.url(str(dest)))
    options = StagingOptions(remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    with open_endpoint(endpoint, options) as transport:
        session = FarSession(transport, endpoint, options, listing=True)
        session.end_with_stream()
        stream_push(transport, src, endpoint, "zstd", options, NoProgress(), receiver=lambda: session.receiver(True))
        # nothing is sent after the stream: the far side clears and ends on what came with it (a bound, not a timing)
        assert session._far.process.wait(timeout=120) == 0 and not Path(dest, ".pallet").exists()
        session.clear()
        session.close()
    assert_same_tree(src, str(dest))
