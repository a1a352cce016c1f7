"""Bad input fails with a clear error (the path and a hint), a non-zero exit, no partial output, source untouched."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bundles import PackOptions, pack
from staging_core.cli.main import main
from tests.conftest import run_pallet, snapshot

NOBODY = 65534


def make_tree(root: Path, big: int = 0) -> Path:
    """A few small text files in two directories, and ``big`` random bytes in big.bin if asked."""
    rng = random.Random(3)
    for n in range(8):
        path = root / ("sub" if n % 2 else "") / f"file{n}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"line %d\n" % n * rng.randint(20, 120))
    if big:
        (root / "big.bin").write_bytes(rng.randbytes(big))
    return root


def assert_clear_failure(done, *names: object, code: int = 1) -> None:
    """Exit ``code``, no traceback, and stderr names every one of ``names`` and gives a hint."""
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "hint:" in done.stderr, done.stderr
    for name in names:
        assert str(name) in done.stderr, (name, done.stderr)


def assert_no_bundle(directory: Path, name: str) -> None:
    """Neither the bundle, its sidecar, nor a temporary .NAME.part-* file exists."""
    left = sorted(p.name for p in directory.iterdir() if p.name.startswith((name, f".{name}")))
    assert left == [], left


def run_all(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Run several `pallet` command lines at once (each is a real subprocess)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda argv: run_pallet(*map(str, argv)), commands))


@pytest.fixture
def world():
    """A fresh directory under /tmp that any user may enter (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="pallet-errors-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def as_nobody(fresh_venv):
    """Run `pallet` as user nobody, from an install nobody can read: root reads everything, so permission
    errors need another user."""
    if os.geteuid() != 0:
        pytest.skip("switching to user nobody needs root")
    env = {"PATH": f"{fresh_venv}:/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    pallet = str(fresh_venv / "pallet")
    nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": [], "env": env, "capture_output": True,
              "text": True, "stdin": subprocess.DEVNULL}
    probe = subprocess.run([pallet, "--version"], cwd="/", **nobody)
    assert probe.returncode == 0, probe.stderr
    return lambda *args, cwd: subprocess.run([pallet, *map(str, args)], cwd=cwd, **nobody)


@pytest.mark.parametrize("name,codec,jobs", [("sub/file3.txt", "zstd", 2), ("big.bin", "gzip", 1)])
def test_unreadable_source_file(world, as_nobody, name, codec, jobs):
    src = make_tree(world / "src", big=300_000)     # big.bin is a streamed shard of its own
    victim = src / name
    victim.chmod(0)
    out = world / "out"
    out.mkdir()
    out.chmod(0o777)
    before = snapshot(src)
    done = as_nobody("pack", "--codec", codec, "--jobs", jobs, "--shard-size", "64K", src, out / "b.tar",
                     cwd=world)
    assert_clear_failure(done, victim, "Permission denied")
    assert_no_bundle(out, "b.tar")
    assert snapshot(src) == before


@pytest.mark.parametrize("where", ["sub", "."])
def test_unreadable_source_directory(world, as_nobody, where):
    src = make_tree(world / "src")
    (src / where).chmod(0)
    out = world / "out"
    out.mkdir()
    out.chmod(0o777)
    before = snapshot(src)
    done = as_nobody("pack", src, out / "b.tar.zst", cwd=world)
    assert_clear_failure(done, os.path.normpath(src / where), "cannot list directory")
    assert_no_bundle(out, "b.tar.zst")
    assert snapshot(src) == before


def test_destination_not_writable(world, as_nobody):
    src = make_tree(world / "src")
    locked = world / "locked"
    locked.mkdir(mode=0o755)
    bundle = world / "b.tar.zst"
    pack(src, bundle)
    before = snapshot(src)
    packed = as_nobody("pack", src, locked / "b.tar.zst", cwd=world)
    assert_clear_failure(packed, locked, "not writable")
    into_locked = as_nobody("unpack", bundle, locked, cwd=world)
    assert_clear_failure(into_locked, locked, "not writable")
    under_locked = as_nobody("unpack", bundle, locked / "dest", cwd=world)
    assert_clear_failure(under_locked, locked / "dest", "Permission denied")
    assert os.listdir(locked) == [] and snapshot(src) == before


def test_missing_source(tmp_path):
    done = run_pallet("pack", str(tmp_path / "nope"), str(tmp_path / "b.tar.zst"))
    assert_clear_failure(done, tmp_path / "nope", "does not exist")
    assert_no_bundle(tmp_path, "b.tar.zst")


def test_bundle_path_is_a_directory(tmp_path):
    src = make_tree(tmp_path / "src")
    target = tmp_path / "target"
    target.mkdir()
    before = snapshot(src)
    packed, unpacked, listed, verified = run_all(["pack", src, target], ["unpack", target, tmp_path / "out"],
                                                 ["ls", target], ["verify", target])
    assert_clear_failure(packed, target, "is a directory")
    for done in (unpacked, listed, verified):
        assert_clear_failure(done, target, "is a directory, not a bundle")
    assert os.listdir(target) == [] and not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["src", "target"] and snapshot(src) == before


@pytest.fixture
def small_fs():
    """A 512 KiB tmpfs, unmounted afterwards; skipped where mounting is not allowed."""
    mountpoint = Path(tempfile.mkdtemp(prefix="pallet-full-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)
        mountpoint.rmdir()


@pytest.mark.parametrize("codec", ["zstd", "gzip", "none"])
def test_pack_onto_a_full_disk(tmp_path, small_fs, codec):
    src = make_tree(tmp_path / "src", big=1 << 20)     # incompressible and bigger than the file system
    before = snapshot(src)
    bundle = small_fs / "b.tar"
    done = run_pallet("pack", "--codec", codec, "--shard-size", "256K", str(src), str(bundle))
    assert_clear_failure(done, bundle, "no space left")
    assert os.listdir(small_fs) == []
    assert snapshot(src) == before


@pytest.mark.parametrize("kind", ["bundle", "plain tar.gz"])
def test_unpack_onto_a_full_disk(tmp_path, small_fs, kind):
    src = make_tree(tmp_path / "src", big=1 << 20)
    archive = tmp_path / "b.tar.gz"
    if kind == "bundle":
        pack(src, archive, PackOptions(codec="gzip", shard_size=256 << 10))
    else:
        subprocess.run(["tar", "-czf", str(archive), "-C", str(src), "."], check=True)
    dest = small_fs / "dest"
    done = run_pallet("unpack", str(archive), str(dest))
    assert_clear_failure(done, dest, "no space left")
    assert (dest / ".pallet" / "INCOMPLETE").is_file()


@pytest.fixture(scope="module", params=["zstd", "gzip", "none"])
def packed(request, tmp_path_factory):
    """A bundle of several shards; returns (bundle bytes, sidecar bytes, where the shards end)."""
    base = tmp_path_factory.mktemp(f"trunc-{request.param}")
    index = pack(make_tree(base / "src"), base / "b", PackOptions(codec=request.param, shard_size=1024)).index
    assert len(index.shards) >= 3
    end = index.shards[-1].offset + index.shards[-1].length
    return request.param, (base / "b").read_bytes(), (base / "b.pidx").read_bytes(), end


def cli(capsys, *args) -> tuple[int, str]:
    """Run the CLI's main() in this process (fast), returning the exit status and stderr."""
    code = main([*map(str, args)])
    return code, capsys.readouterr().err


CUTS = {"first shard": lambda size, end: 100, "middle of the shards": lambda size, end: end // 2,
        "index section": lambda size, end: end + 10, "locator": lambda size, end: size - 1}
# Without a sidecar, a bundle cut inside its shards reads as a plain archive: it must still be refused.


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("sidecar", [True, False], ids=["with-pidx", "without-pidx"])
def test_truncated_bundle(tmp_path, capsys, packed, cut, sidecar):
    codec, data, index_bytes, end = packed
    bundle = tmp_path / "cut.bundle"
    bundle.write_bytes(data[:CUTS[cut](len(data), end)])
    if sidecar:
        Path(f"{bundle}.pidx").write_bytes(index_bytes)
    code, err = cli(capsys, "verify", "--jobs", "1", bundle)
    assert code == 1 and str(bundle) in err, err
    assert "hint:" in err or "index or its locator" in err, err
    if cut in ("index section", "locator"):
        return                       # the shards are whole: unpack may use them (verified by the sidecar)
    for command in (["ls", bundle], ["unpack", "--jobs", "1", bundle, tmp_path / "out"]):
        code, err = cli(capsys, *command)
        assert code == 1 and str(bundle) in err and "hint:" in err, (command, err)
    assert not (tmp_path / "out").exists() or (tmp_path / "out" / ".pallet" / "INCOMPLETE").exists()
    if sidecar:
        assert "is truncated" in err and not (tmp_path / "out").exists()


def test_not_an_archive(tmp_path):
    files = {"random.tar.zst": random.Random(9).randbytes(4096).replace(b"\x1f\x8b", b"xx"),
             "notes.txt": b"just some text, not an archive\n" * 20, "empty.tar.gz": b""}
    commands = []
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        commands += [["ls", tmp_path / name], ["verify", tmp_path / name],
                     ["unpack", tmp_path / name, tmp_path / f"out-{name}"]]
    for argv, done in zip(commands, run_all(*commands), strict=True):
        assert_clear_failure(done, argv[1])
        assert "not a tar archive" in done.stderr or "empty" in done.stderr or "no pallet index" in done.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(files)      # unpack created no destination


def test_missing_bundle(tmp_path):
    missing = tmp_path / "missing.tar.zst"
    for done in run_all(["ls", missing], ["verify", missing], ["unpack", missing, tmp_path / "out"]):
        assert_clear_failure(done, missing, "does not exist")
    assert os.listdir(tmp_path) == []


def test_usage_errors_exit_2(tmp_path):
    src = make_tree(tmp_path / "src")
    b = tmp_path / "b.tar.zst"
    commands = [
        ["pack", "--codec", "lz4", src, b], ["pack", "--shard-size", "lots", src, b],
        ["pack", "--shard-size", "0", src, b], ["pack", "--shard-size", "inf", src, b],
        ["pack", "--level", "42", src, b], ["pack", "--codec", "gzip", "--level", "0", src, b],
        ["pack", "--codec", "none", "--level", "3", src, b], ["pack", "--jobs", "-1", src, b],
        ["pack", src], ["unpack", b], ["verify"], ["ls"], [], ["frobnicate", src],
    ]
    for argv, done in zip(commands, run_all(*commands), strict=True):
        assert done.returncode == 2, (argv, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr and ("usage:" in done.stderr or "hint:" in done.stderr), argv
    level = run_pallet("pack", "--level", "42", str(src), str(b))
    assert "level 42" in level.stderr and "hint: use 1..19" in level.stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_ls_of_a_plain_tar_gz_made_by_gnu_tar(tmp_path):
    src = make_tree(tmp_path / "src")
    archive = tmp_path / "plain.tar.gz"
    subprocess.run(["tar", "-czf", str(archive), "-C", str(src), "."], check=True)
    listed, as_json, verified = run_all(["ls", archive], ["ls", "--json", archive], ["verify", archive])
    assert listed.returncode == 0 and as_json.returncode == 0, listed.stderr + as_json.stderr
    names = {json.loads(line)["path"].removeprefix("./").rstrip("/") for line in as_json.stdout.splitlines()}
    assert names - {".", ""} == {os.fsdecode(rel) for rel in snapshot(src)}
    assert sorted(line.split()[-1] for line in listed.stdout.splitlines())[-1] == "./sub/file7.txt"
    assert len(listed.stdout.splitlines()) == len(names)
    assert_clear_failure(verified, archive, "no pallet index")
