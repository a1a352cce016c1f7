"""The far side's JSON summaries: one versioned format, written by every far-side command and read by one decoder."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import asdict, replace

import pytest

from bundles.errors import SummaryError
from bundles.progress import NoProgress
from mpi_stager.send import prepare_source, send_stream
from mpi_stager.wire import KINDS, SUMMARY_VERSION, PackSummary, ReceiveSummary, StagerSummary
from mpi_stager.wire import decode_summary as decode
from mpi_stager.wire import encode_summary as encode
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet
from tests.programs import python_module, user_env

FAR = "ssh://me@login.hpc:2222/scratch/me/dest"

SAMPLES = {
    "receive": ReceiveSummary("/scratch/me/dest", "0123456789abcdef01234567", 5, 3, 2, 40, 12345, 23456, 20000,
                              True, 50 << 20, 1.25),
    "unpack": StagerSummary("/scratch/me/dest", 8, 10, 4, 6, 400, 1 << 30, 12.5),
    "pack": PackSummary("/scratch/me/b.tar.zst", 4, 401, 10, 1 << 29, 3.0),
}


def unversioned(summary) -> str:
    """``summary`` as a pallet before versioned summaries printed it: its fields alone."""
    doc = {k: v for k, v in asdict(summary).items() if k != "errors"}
    return json.dumps(doc)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_round_trips_with_its_version_and_kind(kind):
    line = encode(SAMPLES[kind])
    doc = json.loads(line)
    assert doc["summary"] == SUMMARY_VERSION and doc["kind"] == kind
    assert "\n" not in line
    assert decode(line, kind, FAR) == SAMPLES[kind]
    assert decode(b"some launcher noise\n" + line.encode() + b"\n\n", kind, FAR) == SAMPLES[kind]   # last line


def test_an_unpack_summary_leaves_its_errors_on_the_far_side():
    failed = replace(SAMPLES["unpack"], errors=["rank 3: disk full"])
    assert "errors" not in json.loads(encode(failed)) and not failed.ok
    assert decode(encode(failed), "unpack", FAR).errors == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_unversioned_summary_from_an_older_far_side_reads_as_version_0(kind):
    decoded = decode(unversioned(SAMPLES[kind]), kind, FAR)
    assert decoded == SAMPLES[kind] and type(decoded) is KINDS[kind]


def test_a_newer_version_is_refused_naming_both_versions_and_the_fix():
    doc = {**json.loads(encode(SAMPLES["receive"])), "summary": SUMMARY_VERSION + 1}
    with pytest.raises(SummaryError) as caught:
        decode(json.dumps(doc), "receive", FAR)
    text = str(caught.value)
    assert f"version {SUMMARY_VERSION + 1}" in text and f"up to {SUMMARY_VERSION}" in text, text
    assert "`pallet remote install ssh://me@login.hpc:2222`" in text and text.startswith(FAR), text


def test_unknown_fields_are_ignored_and_missing_ones_named():
    doc = {**json.loads(encode(SAMPLES["pack"])), "compressed_ratio": 0.3, "extra": {"nested": [1]}}
    assert decode(json.dumps(doc), "pack", FAR) == SAMPLES["pack"]
    del doc["shards"], doc["seconds"]
    with pytest.raises(SummaryError, match=r"lacks shards, seconds"):
        decode(json.dumps(doc), "pack", FAR)


@pytest.mark.parametrize("output", [
    b"", b"\n  \n", b"Traceback (most recent call last):\n  File ...\nKeyError: 'x'\n", b"garbage\xff\xfe",
    encode(SAMPLES["unpack"]).encode()[:-9], b"[1, 2]", b"null", b'{"summary": "1", "kind": "unpack"}',
    b'{"summary": true}', b'{"summary": -1}', b"[" * 100000,
    encode(SAMPLES["pack"]).encode(),                                       # another kind
    json.dumps({**json.loads(encode(SAMPLES["unpack"])), "files": "400"}).encode(),
    json.dumps({**json.loads(encode(SAMPLES["unpack"])), "ranks": True}).encode(),
    json.dumps({k: v for k, v in json.loads(encode(SAMPLES["unpack"])).items() if k != "kind"}).encode(),
])
def test_garbage_or_a_truncated_line_is_a_summary_error_naming_the_far_side(output):
    with pytest.raises(SummaryError) as caught:
        decode(output, "unpack", FAR)
    assert str(caught.value).startswith(f"{FAR}: the far side's ") and "hint: " in str(caught.value)


def test_seconds_written_as_an_integer_read_as_a_float():
    doc = {**json.loads(encode(SAMPLES["pack"])), "seconds": 3}
    decoded = decode(json.dumps(doc), "pack", FAR)
    assert decoded == SAMPLES["pack"] and isinstance(decoded.seconds, float)


def run_stager(*args: str, stdin: bytes | None = None) -> bytes:
    done = subprocess.run([*python_module("mpi_stager"), *args], input=stdin, capture_output=True, env=user_env())
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout


def test_every_far_side_command_prints_a_versioned_summary_the_decoder_reads(tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    bundle = str(tmp_path / "b.tar.zst")
    packed = decode(run_stager("pack", "--comm", "serial", "--json", src, bundle), "pack", "here")
    assert packed.bundle == bundle and packed.shards >= 1 and packed.ranks == 1
    unpacked = decode(run_stager("unpack", "--comm", "serial", "--json", bundle, str(tmp_path / "u")), "unpack",
                      "here")
    assert unpacked.shards_done == packed.shards and unpacked.shards_skipped == 0
    stream = io.BytesIO()
    send_stream(prepare_source(src, "zstd", 1, 16 << 10), stream, lambda stream_id: {}, NoProgress())
    output = run_stager("receive", "--json", str(tmp_path / "r"), stdin=stream.getvalue())
    received = decode(output, "receive", "here")
    assert json.loads(output.splitlines()[-1])["summary"] == SUMMARY_VERSION
    assert received.shards_received == received.shards_total >= 1 and received.verified
    assert_same_tree(src, tmp_path / "u")
    assert_same_tree(src, tmp_path / "r")


_FILTER = r"""
import re, sys
inp, out = sys.stdin.buffer, sys.stdout.buffer
pattern, replacement = re.compile(sys.argv[1].encode()), sys.argv[2].encode()
for line in iter(inp.readline, b""):
    size = line[len(b"listing "):].strip()
    if line.startswith(b"listing ") and size.isdigit():
        out.write(line + inp.read(int(size)))           # a session's listing block passes as it is
    else:
        out.write(pattern.sub(replacement, line))
    out.flush()
"""


def far_python(tmp_path, pattern: str, replacement: str) -> str:
    """A far-side Python whose ``mpi_stager`` summaries have ``pattern`` replaced (as an older or newer pallet
    would print them)."""
    (tmp_path / "filter.py").write_text(_FILTER)
    shim = tmp_path / "far-python"
    shim.write_text(f"#!/bin/bash\nset -o pipefail\n{sys.executable} \"$@\" | "
                    f"{sys.executable} {tmp_path / 'filter.py'} '{pattern}' '{replacement}'\n")
    shim.chmod(0o755)
    return str(shim)


def push_to(sshd, src: str, dest, python: str, *args: str) -> subprocess.CompletedProcess:
    return run_pallet("push", "--json", "--quiet", "--strategy", "bundle", "--remote-python", python,
                      *[f"--ssh-option={o}" for o in sshd.ssh_options], *args, src, sshd.url(str(dest)))


_VERSIONED = r'"summary": ' + str(SUMMARY_VERSION) + r', "kind": "([a-z]*)", '


def test_a_far_side_printing_unversioned_summaries_is_still_served(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    older = far_python(tmp_path, _VERSIONED, "")
    shown = subprocess.run([older, "-m", "mpi_stager", "pack", "--comm", "serial", "--json", src,
                            str(tmp_path / "b.tar")], capture_output=True, env=user_env(), check=True)
    assert "summary" not in json.loads(shown.stdout) and "kind" not in json.loads(shown.stdout)   # the shim works
    done = push_to(sshd, src, tmp_path / "dest", older)
    assert done.returncode == 0 and json.loads(done.stdout)["route"] == "stream", done.stderr
    assert_same_tree(src, tmp_path / "dest")
    launched = push_to(sshd, src, tmp_path / "d2", older, "--launcher", "env")          # store and forward
    assert launched.returncode == 0 and json.loads(launched.stdout)["route"] != "stream", launched.stderr
    assert_same_tree(src, tmp_path / "d2")


def test_a_far_side_printing_a_newer_summary_version_stops_the_push_with_the_fix(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    newer = far_python(tmp_path, _VERSIONED, r'"summary": 99, "kind": "\1", ')
    done = push_to(sshd, src, tmp_path / "dest", newer)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "version 99" in done.stderr and f"up to {SUMMARY_VERSION}" in done.stderr, done.stderr
    assert "pallet remote install ssh://" in done.stderr, done.stderr
