"""Bundles read in place: `pallet mount` (FUSE) and the pallet:// fsspec file system, local and over ssh."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bundles import Bundle, CorruptBundleError
from bundles.view import BundleView
from staging_core.in_place.remote_bytes import RemoteRanges
from staging_core.transports.errors import TransportError
from tests.conftest import assert_same_tree, make_files, run_pallet
from tests.programs import SOURCE as SOURCE_DIR, program, user_env
from tests.test_safety import _set, write_tampered

pytestmark = pytest.mark.usefixtures("each_engine")
needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                                reason="FUSE is not available (./bootstrap.sh installs fuse3)")


def _pack(src, bundle, *options: str) -> str:
    run_pallet("pack", "--quiet", *options, str(src), str(bundle), check=True)
    return str(bundle)


@contextlib.contextmanager
def _mounted(bundle: str, mountpoint: Path, *options: str):
    """`pallet mount` in the background; unmounted, and its process gone, on leaving."""
    mountpoint.mkdir(exist_ok=True)
    log = mountpoint.parent / f"{mountpoint.name}.log"
    done = run_pallet("mount", bundle, str(mountpoint), "--log", str(log), *options, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(re.search(r"\(pid (\d+),", done.stdout).group(1))
    try:
        yield log
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False, timeout=60)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), "the mount process outlived its unmount"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _flip_byte_in_shard(bundle: str, number: int) -> list[str]:
    """Flip one byte in the middle of shard ``number``; return the files that shard holds."""
    with Bundle.open(bundle) as opened:
        index = opened.index
        shard = index.shards[number]
        names = [index.entry(i).name for i in range(shard.first_entry, shard.first_entry + shard.entry_count)
                 if index.kinds[i] == 0]
    with open(bundle, "r+b") as handle:
        handle.seek(shard.offset + shard.length // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    return names


def _python(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` with the environment's python in a user's environment (pallet imported as installed)."""
    return subprocess.run([program("python"), "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          env=user_env(), stdin=subprocess.DEVNULL, timeout=300)


# ------------------------------------------------------------------ pallet mount

@needs_fuse
def test_mount_shows_the_nasty_tree_exactly(nasty_tree, tmp_path):
    bundle = _pack(nasty_tree, tmp_path / "nasty.tar.zst")
    mountpoint = tmp_path / "mnt"
    with _mounted(bundle, mountpoint):
        diff = subprocess.run(["diff", "-r", "--no-dereference", nasty_tree, str(mountpoint)], capture_output=True,
                              text=True)
        assert diff.returncode == 0, diff.stdout + diff.stderr
        assert_same_tree(nasty_tree, mountpoint)
        with pytest.raises(OSError) as refused:
            (mountpoint / "new-file").write_bytes(b"x")
        assert refused.value.errno in (errno.EROFS, errno.EACCES)
    assert os.listdir(mountpoint) == []


@needs_fuse
def test_a_damaged_shard_fails_only_its_own_files(tmp_path):
    src = make_files(tmp_path / "src", 400, 8, lambda n: os.urandom(2048))
    bundle = _pack(src, tmp_path / "b.tar.zst", "--shard-size", "64K")
    damaged = set(_flip_byte_in_shard(bundle, 2))
    assert damaged
    with _mounted(bundle, tmp_path / "mnt") as log:
        for path in sorted(Path(src).rglob("*")):
            if not path.is_file():
                continue
            rel = str(path.relative_to(src))
            if rel in damaged:
                with pytest.raises(OSError) as failed:
                    (tmp_path / "mnt" / rel).read_bytes()
                assert failed.value.errno == errno.EIO, rel
            else:
                assert (tmp_path / "mnt" / rel).read_bytes() == path.read_bytes(), rel
        messages = log.read_text()
    assert "shard 2 is damaged" in messages and "Traceback" not in messages, messages


@needs_fuse
def test_the_mount_serves_concurrent_readers(tmp_path):
    src = make_files(tmp_path / "src", 3000, 40, lambda n: b"%06d" % n * (1 + n % 300))
    bundle = _pack(src, tmp_path / "b.tar.zst", "--shard-size", "128K")
    files = sorted(str(p.relative_to(src)) for p in Path(src).rglob("*") if p.is_file())
    failures: list[str] = []

    def reader(seed: int) -> None:
        chooser = random.Random(seed)
        for rel in chooser.sample(files, 300):
            if (tmp_path / "mnt" / rel).read_bytes() != (Path(src) / rel).read_bytes():
                failures.append(rel)

    with _mounted(bundle, tmp_path / "mnt", "--cache-mib", "1"):       # a small cache: shards are evicted
        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
    assert not failures, failures[:10]


@needs_fuse
def test_a_bundle_on_an_ssh_host_mounts_by_ranges(nasty_tree, tmp_path, sshd):
    bundle = _pack(nasty_tree, tmp_path / "nasty.tar.zst")
    options = [f"--ssh-option={o}" for o in sshd.ssh_options]
    with _mounted(sshd.url(bundle), tmp_path / "mnt", *options):
        assert_same_tree(nasty_tree, tmp_path / "mnt")


def test_mount_errors_are_one_line_with_the_fix(tmp_path):
    src = make_files(tmp_path / "src", 3, 1, lambda n: b"x")
    bundle = _pack(src, tmp_path / "b.tar.zst")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_bytes(b"")
    plain = tmp_path / "plain.tar"
    subprocess.run(["tar", "-cf", str(plain), "-C", src, "."], check=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["mount", bundle, str(busy)], "the mount point is not empty", {}),
        (["mount", bundle, str(tmp_path / "missing")], "mkdir -p", {}),
        (["mount", "--foreground", str(plain), str(empty)], "plain archive", {}),
        (["mount", str(plain), str(empty)], "plain archive", {}),          # in the background: from its log
        (["mount", str(tmp_path / "missing.tar.zst"), str(empty)], "missing.tar.zst: does not exist", {}),
        (["mount", "--log", "/proc/no/log", bundle, str(empty)], "cannot write the mount's log", {}),
        (["mount", bundle, str(empty)], "install FUSE", {"FUSE_LIBRARY_PATH": str(tmp_path / "no-libfuse.so")}),
    ]
    for args, expected, env in cases:
        done = run_pallet(*args, env=env, timeout=60)
        assert done.returncode != 0 and expected in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr and done.stderr.startswith("pallet mount: error:"), done.stderr
    assert os.listdir(empty) == [] and not os.path.ismount(empty)


# ------------------------------------------------------------------ fsspec

_READ_TREE = """
import json, sys, fsspec
fs = fsspec.filesystem("pallet", fo=sys.argv[1])
files = {}
for path in fs.find("", withdirs=False):
    info = fs.info(path)
    files[path] = None if info["type"] == "link" else fs.cat_file(path).hex()
with fsspec.open("pallet://links/rel_link", fo=sys.argv[1]) as handle:      # a link inside the bundle
    followed = handle.read().decode()
print(json.dumps({"files": files, "followed": followed, "top": sorted(fs.ls("", detail=False))}))
"""


@pytest.mark.parametrize("codec", ["zstd", "gzip", "none"])
def test_fsspec_reads_a_local_bundle_in_place(nasty_tree, tmp_path, codec):
    bundle = _pack(nasty_tree, tmp_path / "nasty.tar", "--codec", codec)
    done = _python(_READ_TREE, bundle)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    expected = {str(p.relative_to(nasty_tree)): (None if p.is_symlink() else p.read_bytes().hex())
                for p in Path(nasty_tree).rglob("*") if p.is_symlink() or p.is_file()}
    assert seen["files"] == expected
    assert seen["followed"] == "target"
    assert seen["top"] == sorted(os.listdir(nasty_tree))


_READ_REMOTE = """
import json, sys, fsspec
url, ssh_options, names = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
fs = fsspec.filesystem("pallet", fo=url, ssh_options=ssh_options)
direct = {name: fs.cat_file(name).hex() for name in names}
direct_fetched = fs.bytes_fetched
chained_url = "pallet://" + names[0] + "::" + url
with fsspec.open(chained_url, mode="rb", pallet={"ssh_options": ssh_options}) as handle:
    chained = handle.read().hex()
print(json.dumps({"direct": direct, "fetched": direct_fetched, "chained": chained}))
"""


def test_fsspec_reads_a_bundle_on_an_ssh_host_by_ranges(tmp_path, sshd):
    src = make_files(tmp_path / "src", 2000, 20, lambda n: os.urandom(3000))
    bundle = _pack(src, tmp_path / "b.tar.zst", "--shard-size", "256K")
    size = os.path.getsize(bundle)
    names = [f"d{n % 20}/f{n:05d}" for n in range(0, 2000, 200)]
    done = _python(_READ_REMOTE, sshd.url(bundle), json.dumps(sshd.ssh_options), json.dumps(names))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["direct"] == {name: (Path(src) / name).read_bytes().hex() for name in names}
    assert seen["chained"] == seen["direct"][names[0]]
    assert 0 < seen["fetched"] < size / 10, (seen["fetched"], size)


def test_fsspec_hides_unsafe_entries_and_is_read_only(tmp_path, good_bundle):
    crafted = write_tampered(good_bundle, tmp_path / "crafted.tar.zst", _set("links", b"sym", b"/etc/passwd"),
                             "embedded")
    done = _python("""
        import sys, fsspec
        fs = fsspec.filesystem("pallet", fo=sys.argv[1])
        print(sorted(fs.ls("", detail=False)))
        try:
            fs.open("top.txt", "wb")
        except PermissionError as exc:
            print("refused:", exc)
        """, str(crafted))
    assert done.returncode == 0, done.stderr
    listed, refused = done.stdout.splitlines()
    assert listed == str(sorted(["dir", "hard_a", "hard_b", "suid", "sym2", "top.txt"]))
    assert refused.startswith("refused: pallet:// is read-only")


# ------------------------------------------------------------------ the examples

def _csv_tree(root: Path, files: int) -> float:
    """``files`` CSV files whose third column sums to the returned total."""
    total = 0.0
    for n in range(files):
        path = root / f"d{n % 7}" / f"sample_{n:04d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{n},0,{n * 0.5}\n{n},1,{n * 0.25}\n")
        total += n * 0.75
    return total


def test_the_fsspec_example_sums_a_bundle_in_place(tmp_path):
    total = _csv_tree(tmp_path / "src", 300)
    bundle = _pack(tmp_path / "src", tmp_path / "csv.tar.zst")
    done = subprocess.run([program("python"), str(Path(SOURCE_DIR) / "examples" / "read_in_place.py"), bundle],
                          capture_output=True, text=True, env=user_env(), stdin=subprocess.DEVNULL, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"300 files, column 2 sums to {total:.6f}"


@needs_fuse
def test_the_slurm_read_in_place_example_runs_as_a_job_would(tmp_path):
    _csv_tree(tmp_path / "src", 120)
    bundle = _pack(tmp_path / "src", tmp_path / "inputs.tar.zst")
    scratch = tmp_path / "node-tmp"
    scratch.mkdir()
    env = user_env(BUNDLE=bundle, RESULTS=str(tmp_path / "results"), TMPDIR=str(scratch), SLURM_JOB_ID="42")
    done = subprocess.run(["bash", str(Path(SOURCE_DIR) / "examples" / "slurm" / "read_in_place.sbatch")],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "results" / "count.txt").read_text().strip() == "120"
    assert os.listdir(scratch) == [], "the job left its node-local files or its mount behind"


def test_a_large_file_is_read_by_seeks_in_both_directions(tmp_path):
    """A file too large to share a shard is decoded as a stream: reads after a seek back start over, and a
    damaged byte in its shard makes every read of it fail, never serve wrong bytes."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(20 << 20)
    (src / "large.bin").write_bytes(data)
    (src / "small.txt").write_bytes(b"small")
    bundle = _pack(src, tmp_path / "b.tar.zst", "--shard-size", "4M")
    offsets = [(12 << 20, 1000), (3 << 20, 5000), (19 << 20, 4096), (0, 100), ((20 << 20) - 10, 100)]
    script = """
        import json, sys, fsspec
        fs = fsspec.filesystem("pallet", fo=sys.argv[1])
        out = []
        for start, length in json.loads(sys.argv[2]):
            try:
                with fs.open("large.bin", "rb") as handle:
                    handle.seek(start)
                    out.append(handle.read(length).hex())
            except OSError as exc:
                out.append(f"errno {exc.errno}")
        out.append(fs.cat_file("small.txt").decode())
        print(json.dumps(out))
        """
    done = _python(script, bundle, json.dumps(offsets))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == [data[start:start + length].hex() for start, length in offsets] + ["small"]
    with Bundle.open(bundle) as opened:
        large = next(s.number for s in opened.index.shards if opened.index.paths[s.first_entry] == b"large.bin")
    _flip_byte_in_shard(bundle, large)
    done = _python(script, bundle, json.dumps(offsets))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["errno 5"] * len(offsets) + ["small"]


# ------------------------------------------------------------------ what a review found

def test_bytes_served_from_a_large_file_are_the_hashed_ones_even_if_the_bundle_changes(tmp_path):
    """The streamed shard is hashed into a private copy and decoded from it: rewriting the bundle in place
    after that changes nothing served; a new view of the rewritten bundle refuses the shard."""
    src = tmp_path / "src"
    src.mkdir()
    data = bytes(range(256)) * (24 << 12)          # 24 MiB, compressible
    (src / "large.bin").write_bytes(data)
    bundle = _pack(src, tmp_path / "b.tar", "--codec", "none", "--shard-size", "4M")
    with BundleView.open(bundle) as view:
        node = view.lookup("large.bin")
        assert view.read(node, 0, 100) == data[:100]
        with Bundle.open(bundle) as opened:
            shard = opened.index.shards[opened.index.shard_of[node.entry]]
        with open(bundle, "r+b") as handle:                # overwrite bytes of the file's data in place
            handle.seek(shard.offset + shard.length // 2)
            handle.write(b"a" * 64)
        assert view.read(node, (12 << 20) - 100, 4096) == data[(12 << 20) - 100:(12 << 20) + 3996]
    with BundleView.open(bundle) as fresh, pytest.raises(CorruptBundleError, match="is damaged"):
        fresh.read(fresh.lookup("large.bin"), 0, 100)


def test_offsets_links_and_open_files_through_fsspec(tmp_path, nasty_tree):
    bundle = _pack(nasty_tree, tmp_path / "nasty.tar.zst")
    done = _python("""
        import json, os, sys, fsspec
        fs = fsspec.filesystem("pallet", fo=sys.argv[1])
        try:
            fs.read_node(fs._resolve("links/target.txt")[1], -3, 3)
            negative = "read"
        except ValueError:
            negative = "refused"
        with fsspec.open("pallet://links/target.txt", fo=sys.argv[1]) as handle:      # imports done once
            handle.read()
        import gc; gc.collect()
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            with fsspec.open("pallet://links/target.txt", fo=sys.argv[1]) as handle:
                handle.read()
        import gc; gc.collect()
        leaked = len(os.listdir("/proc/self/fd")) - fds
        fs.get("", sys.argv[2], recursive=True)
        print(json.dumps({"negative": negative, "leaked": leaked, "link": fs.info("links/rel_link")["type"],
                          "through": fs.exists("links/up_and_back")}))
        """, bundle, str(tmp_path / "got"))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"negative": "refused", "leaked": 0, "link": "link", "through": True}, seen
    for path in Path(nasty_tree).rglob("*"):       # get copies contents, and links as links (not metadata)
        got = tmp_path / "got" / path.relative_to(nasty_tree)
        if path.is_symlink():
            assert got.is_symlink() and os.readlink(got) == os.readlink(path), path
        elif path.is_file():
            assert got.read_bytes() == path.read_bytes(), path
        else:
            assert got.is_dir(), path


def test_a_dead_ssh_session_fails_every_later_read_the_same_way(tmp_path, sshd):
    src = make_files(tmp_path / "src", 50, 2, lambda n: os.urandom(70_000))
    bundle = _pack(src, tmp_path / "b.tar.zst", "--shard-size", "256K")
    source = RemoteRanges.open_url(sshd.url(bundle), tuple(sshd.ssh_options))
    try:
        source._process.kill()
        source._process.wait()
        errors = []
        for _ in range(2):
            with pytest.raises(TransportError) as failed:
                source.pread(1000, 0)
            errors.append(failed.value)
        assert errors[0] is errors[1] and sshd.url(bundle).split("//")[1].split("/")[0].split("@")[-1] \
            .split(":")[0] in str(errors[0])
    finally:
        source.close()


@needs_fuse
def test_a_bundle_with_a_comma_in_its_name_mounts(tmp_path):
    src = make_files(tmp_path / "src", 5, 1, lambda n: b"%d" % n)
    bundle = _pack(src, tmp_path / "data,v2.tar.zst")
    with _mounted(bundle, tmp_path / "mnt"):
        assert (tmp_path / "mnt" / "d0" / "f00003").read_bytes() == b"3"


def test_ls_of_a_bundle_on_an_ssh_host_reads_its_index_only(tmp_path, sshd, nasty_tree):
    bundle = _pack(nasty_tree, tmp_path / "nasty.tar.zst")
    here = run_pallet("ls", "--json", bundle, check=True).stdout
    options = [f"--ssh-option={o}" for o in sshd.ssh_options]
    there = run_pallet("ls", "--json", *options, sshd.url(bundle), check=True)
    assert there.stdout == here and there.stderr == ""
    shards = run_pallet("ls", "--shards", *options, sshd.url(bundle), check=True).stdout
    assert shards == run_pallet("ls", "--shards", bundle, check=True).stdout
    missing = run_pallet("ls", *options, sshd.url(str(tmp_path / "none.tar.zst")))
    assert missing.returncode == 3 and "Traceback" not in missing.stderr, missing.stderr
