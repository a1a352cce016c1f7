"""fsspec's own shipped abstract tests of `get` (reading a file system into local files) on the pallet:// file system.

fsspec builds its scenarios by writing into the file system under test; pallet:// is read-only, so the same trees
are built on disk, packed into one bundle, and the scenario fixtures return where each tree lives in it.
"""
from __future__ import annotations

from hashlib import md5
from pathlib import Path

import fsspec
import pytest
from fsspec.tests.abstract import AbstractFixtures, AbstractGetTests

from tests.conftest import run_pallet

SCENARIOS = {
    "bulk": ["file1", "file2", "subdir/subfile1", "subdir/subfile2", "subdir/nesteddir/nestedfile"],
    "glob": ["file1", "file2", *(f"subdir{n}/{name}" for n in range(2)
                                  for name in ("subfile1", "subfile2", "nesteddir/nestedfile"))],
    "prefix": ["subdir.txt", "subdir/subfile.txt"],
}


@pytest.fixture(scope="module")
def scenario_bundle(tmp_path_factory) -> str:
    """One bundle holding each scenario's tree at SCENARIO/source (and fsspec's "hashed" list of 10 files)."""
    root = tmp_path_factory.mktemp("fsspec-scenarios")
    src = root / "src"
    for scenario, names in SCENARIOS.items():
        for name in names:
            path = src / scenario / "source" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
    for i in range(10):
        path = src / "hashed" / "source" / f"{md5(str(i).encode()).hexdigest()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(str(i).encode())
    run_pallet("pack", "--quiet", str(src), str(root / "scenarios.tar.zst"), check=True)
    return str(root / "scenarios.tar.zst")


class TestPalletGet(AbstractFixtures, AbstractGetTests):
    """Every `get` test fsspec ships, except the one that writes its own source into the file system."""

    @pytest.fixture
    def fs(self, scenario_bundle):
        filesystem = fsspec.filesystem("pallet", fo=scenario_bundle)
        yield filesystem
        filesystem.close()

    @pytest.fixture
    def fs_path(self):
        return ""

    @pytest.fixture
    def fs_join(self):
        return lambda *parts: "/".join(part for part in parts if part)

    @pytest.fixture
    def fs_bulk_operations_scenario_0(self):
        return "bulk/source"

    @pytest.fixture
    def fs_glob_edge_cases_files(self):
        return "glob/source"

    @pytest.fixture
    def fs_dir_and_file_with_same_name_prefix(self):
        return "prefix/source"

    @pytest.fixture
    def fs_10_files_with_hashed_names(self):
        return "hashed/source"

    def test_get_directory_recursive(self):
        pytest.skip("writes its source into the file system under test (mkdir, touch); pallet:// is read-only")


def test_the_scenarios_hold_what_fsspec_expects(scenario_bundle):
    """The fixtures above stand for fsspec's: the same trees, with the same contents."""
    fs = fsspec.filesystem("pallet", fo=scenario_bundle)
    for scenario, names in SCENARIOS.items():
        assert sorted(fs.find(f"{scenario}/source")) == sorted(f"{scenario}/source/{n}" for n in names)
    hashed = {Path(p).name: fs.cat(p) for p in fs.find("hashed/source")}
    assert hashed == {f"{md5(str(i).encode()).hexdigest()}.txt": str(i).encode() for i in range(10)}
