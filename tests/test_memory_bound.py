"""unpack and verify stay within the documented peak-memory formula (bundles.memory), checked under `prlimit --as`."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bundles import Bundle
from bundles.memory import BASE_BYTES, peak_bytes
from tests.conftest import make_files, run_pallet
from tests.programs import program, user_env

pytestmark = [pytest.mark.skipif(shutil.which("prlimit") is None, reason="util-linux prlimit is not installed"),
              pytest.mark.usefixtures("each_engine")]
WORKERS = 2
LARGE = 256 << 20


def _limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["prlimit", f"--as={limit}", program("pallet"), *args], capture_output=True, text=True,
                          env=user_env(), stdin=subprocess.DEVNULL, timeout=300)


@pytest.fixture(scope="module")
def mixed_bundle(tmp_path_factory) -> str:
    """5,000 small files in 8 MiB shards and one 256 MiB file (streamed through its own shard)."""
    root = tmp_path_factory.mktemp("memory")
    src = make_files(root / "src", 5000, 50, lambda n: os.urandom(200) * (1 + n % 10))
    with open(Path(src) / "large.bin", "wb") as handle:
        handle.truncate(LARGE)
    run_pallet("pack", "--quiet", "--shard-size", "8M", src, str(root / "mixed.tar.zst"), check=True)
    return str(root / "mixed.tar.zst")


def test_unpack_and_verify_fit_in_the_formula(mixed_bundle, tmp_path):
    with Bundle.open(mixed_bundle) as bundle:
        limit = peak_bytes(bundle.index, WORKERS)
    assert limit < LARGE, "the formula must stay below the input's largest file"
    unpacked = _limited(limit, "unpack", "--quiet", "--jobs", str(WORKERS), mixed_bundle, str(tmp_path / "dest"))
    assert unpacked.returncode == 0, unpacked.stderr
    assert os.path.getsize(tmp_path / "dest" / "large.bin") == LARGE
    verified = _limited(limit, "verify", "--jobs", str(WORKERS), mixed_bundle, str(tmp_path / "dest"))
    assert verified.returncode == 0, verified.stderr


def test_the_limit_binds_below_the_formula(tmp_path):
    """A control: with one shard of 48 MiB (a target above twice the tree's size), a limit that leaves out
    the shard term is too small, so the check above is a real bound, not a limit that nothing reaches."""
    src = make_files(tmp_path / "src", 12, 1, lambda n: os.urandom(1 << 20) * 4)
    bundle = tmp_path / "big-shards.tar.zst"
    run_pallet("pack", "--quiet", "--shard-size", "128M", src, str(bundle), check=True)
    with Bundle.open(bundle) as opened:
        assert max(s.raw_size for s in opened.index.shards) >= 40 << 20
        enough = peak_bytes(opened.index, 1)
    assert _limited(enough, "verify", "--jobs", "1", str(bundle)).returncode == 0
    assert _limited(BASE_BYTES, "verify", "--jobs", "1", str(bundle)).returncode != 0
