"""Streamed pull over a real sshd: one far-side sender, extraction while it still packs, resume, errors."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from staging_core.operations.push_pull import pull
from staging_core.options import StagingOptions
from tests.conftest import assert_same_tree, make_nasty_tree, run_pallet

SHARD = 64 << 10


def random_tree(root: Path, count: int, size: int) -> str:
    """``count`` incompressible files of ``size`` bytes in 10 directories."""
    for n in range(count):
        path = root / f"d{n % 10}" / f"f{n:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return str(root)


def far_python(tmp_path: Path, name: str, body: str) -> str:
    """A far-side python that logs each mpi_stager command and runs ``send`` through ``body`` (sh, with
    $log, $python and "$@" set); any other command runs as is."""
    log = tmp_path / f"{name}.log"
    script = tmp_path / f"{name}.sh"
    script.write_text(f"#!/bin/sh\nlog={log}\npython={sys.executable}\n"
                      'case "$*" in *"-m mpi_stager "*) echo "$3" >> "$log";; esac\n'
                      'case "$3" in send) ;; *) exec "$python" "$@";; esac\n' + body)
    script.chmod(0o755)
    return str(script)


def ssh_flags(sshd) -> list[str]:
    return [f"--ssh-option={o}" for o in sshd.ssh_options]


def pulled(sshd, src: str, dest: Path, remote_python: str = sys.executable, *args: str) -> dict:
    """`pallet pull --json --strategy bundle` (``args`` may override it) into ``dest``; its summary."""
    done = run_pallet("pull", "--json", "--quiet", "--strategy", "bundle", "--remote-python", remote_python,
                      *ssh_flags(sshd), *args, sshd.url(src), str(dest))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_pull_over_ssh_streams_a_nasty_tree(sshd, tmp_path):
    src = make_nasty_tree(str(tmp_path / "src"))
    summary = pulled(sshd, src, tmp_path / "dest")
    assert summary["route"] == "stream" and summary["strategy"] == "bundle" and summary["transfers"] == 1
    assert_same_tree(src, tmp_path / "dest")                       # strict: nothing of pallet's is left


def test_extraction_starts_while_the_one_far_side_sender_is_still_packing(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 400, 10_000)                 # 4 MB in ~60 shards
    dest, mark = tmp_path / "dest", tmp_path / "overlap"
    # The sender's stream goes through a FIFO: the first 256 KiB are passed on, then the rest waits until
    # a file has landed in DEST. The sender, with far more than a pipe's worth left, must still be running.
    python = far_python(tmp_path, "gate", f"""fifo={tmp_path}/stream.fifo
rm -f "$fifo"; mkfifo "$fifo"
exec 3<&0                             # an asynchronous command's stdin would be /dev/null
"$python" "$@" <&3 > "$fifo" & sender=$!
{{
  dd bs=65536 count=262144 iflag=count_bytes status=none   # exact: it reads no byte beyond these
  landed=
  for _ in $(seq 300); do
    landed=$(find {dest} -path {dest}/.pallet -prune -o -type f -print 2>/dev/null | head -n 1)
    [ -n "$landed" ] && break
    sleep 0.1
  done
  if [ -z "$landed" ]; then echo nothing-landed > {mark}
  elif kill -0 $sender 2>/dev/null; then echo sender-running > {mark}
  else echo sender-done > {mark}; fi
  cat
}} < "$fifo"
wait $sender
""")
    summary = pulled(sshd, src, dest, python, "--shard-size", str(SHARD))
    assert summary["route"] == "stream"
    assert mark.read_text().strip() == "sender-running", "no file landed while the sender was still packing"
    assert (tmp_path / "gate.log").read_text().split() == ["send"]   # one far-side stager, no pack, no fetch
    assert_same_tree(src, dest)


def test_a_cut_stream_is_retried_and_resumes_from_the_shards_already_here(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 200, 10_000)
    dest = tmp_path / "dest"
    # The first sender's stream is cut after 512 KiB and ssh's status for a dropped connection is returned;
    # the retry runs normally.
    python = far_python(tmp_path, "cut", f"""if [ ! -e {tmp_path}/cut.done ]; then
  touch {tmp_path}/cut.done
  "$python" "$@" | dd bs=65536 count=524288 iflag=count_bytes status=none
  exit 255
fi
exec "$python" "$@"
""")
    summary = pulled(sshd, src, dest, python, "--shard-size", str(SHARD))
    assert summary["attempts"] == 2 and summary["skipped_shards"] >= 2, summary
    assert (tmp_path / "cut.log").read_text().split() == ["send", "send"]
    assert_same_tree(src, dest)


def test_a_cut_stream_without_retries_leaves_dest_marked_and_a_rerun_resumes(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 200, 10_000)
    dest = tmp_path / "dest"
    cut = far_python(tmp_path, "cut", '"$python" "$@" | dd bs=65536 count=524288 iflag=count_bytes status=none\n')
    failed = run_pallet("pull", "--quiet", "--strategy", "bundle", "--retries", "0", "--shard-size", str(SHARD),
                        "--remote-python", cut, *ssh_flags(sshd), sshd.url(src), str(dest))
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "stream ends" in failed.stderr and "rerun" in failed.stderr, failed.stderr
    assert (dest / ".pallet" / "INCOMPLETE").exists()
    summary = pulled(sshd, src, dest, sys.executable, "--shard-size", str(SHARD))
    assert summary["skipped_shards"] >= 2 and summary["route"] == "stream", summary
    assert_same_tree(src, dest)


def test_the_far_side_senders_own_error_reaches_the_user_in_one_line(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 20, 100)
    python = far_python(tmp_path, "broken", 'echo "mpi_stager send: error: cannot read d1/f0001.bin" >&2\nexit 1\n')
    done = run_pallet("pull", "--quiet", "--strategy", "bundle", "--retries", "0", "--remote-python", python,
                      *ssh_flags(sshd), sshd.url(src), str(tmp_path / "dest"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "the far side's sender failed: cannot read d1/f0001.bin" in done.stderr, done.stderr


def test_a_selection_streams_only_those_files(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 50, 100)
    wanted = ["d1/f0001.bin", "d3/f0013.bin", "d3/f0023.bin"]
    options = StagingOptions(strategy="bundle", remote_python=sys.executable, ssh_options=tuple(sshd.ssh_options))
    result = pull(sshd.url(src), str(tmp_path / "dest"), options, items=wanted)
    assert result.route == "stream" and result.files == 3
    landed = sorted(str(p.relative_to(tmp_path / "dest")) for p in (tmp_path / "dest").rglob("*") if p.is_file())
    assert landed == wanted
    for name in wanted:
        assert (tmp_path / "dest" / name).read_bytes() == (Path(src) / name).read_bytes()


def test_stream_off_and_a_launcher_store_and_forward(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 30, 100)
    assert pulled(sshd, src, tmp_path / "off", sys.executable, "--stream", "off")["route"] == "in place"
    assert_same_tree(src, tmp_path / "off")
    refused = run_pallet("pull", "--quiet", "--strategy", "bundle", "--stream", "on", "--launcher", "mpirun -n 2",
                         "--remote-python", sys.executable, *ssh_flags(sshd), sshd.url(src), str(tmp_path / "on"))
    assert refused.returncode == 2 and "--stream on" in refused.stderr, refused.stderr


def test_the_plan_reads_the_streams_skeleton_and_an_individual_plan_stops_the_sender(sshd, tmp_path):
    src = random_tree(tmp_path / "src", 1, 8 << 20)                  # one big file: individual wins
    python = far_python(tmp_path, "early", '"$python" "$@"\necho "exit $?" >> "$log"\n')
    summary = pulled(sshd, src, tmp_path / "dest", python, "--strategy", "auto")
    assert summary["strategy"] == "individual", summary
    assert (tmp_path / "early.log").read_text().split() == ["send", "exit", "5"]     # its receiver went away
    assert_same_tree(src, tmp_path / "dest")
