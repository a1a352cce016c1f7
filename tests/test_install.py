"""pallet as users install it: a plain `snakemake` finds the plugin, from a non-editable and an editable install."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.programs import BIN

INPUTS = 1000
SNAKEFILE = """
rule all:
    input: [storage.pallet(f"file://{data}/s{{n:04d}}.csv") for n in range({count})]
    output: "sum.txt"
    run:
        total = 0
        for path in input:
            with open(path) as handle:
                total += int(handle.read().split(",")[1])
        with open(output[0], "w") as out:
            out.write(f"{{len(input)}} {{total}}\\n")
"""


def run_snakemake(bin_dir: Path, workdir: Path, data: Path) -> subprocess.CompletedProcess:
    """`env -i PATH=... HOME=... snakemake`: nothing but the install tells it where the plugin is."""
    workdir.mkdir()
    (workdir / "Snakefile").write_text(SNAKEFILE.format(data=data, count=INPUTS))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(workdir)}
    return subprocess.run([str(bin_dir / "snakemake"), "--cores", "1"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def tiny_inputs(root: Path) -> Path:
    root.mkdir()
    for n in range(INPUTS):
        (root / f"s{n:04d}.csv").write_text(f"{n},{3 * n}\n")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("install", ["pip install (not editable)", "bootstrap (editable)"])
def test_a_plain_snakemake_finds_the_plugin_and_reads_1000_inputs(install, request, tmp_path):
    bin_dir = request.getfixturevalue("fresh_venv") if install.startswith("pip") else BIN
    done = run_snakemake(bin_dir, tmp_path / "wf", tiny_inputs(tmp_path / "data"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "wf" / "sum.txt").read_text() == f"{INPUTS} {3 * INPUTS * (INPUTS - 1) // 2}\n"
    assert f"pallet: fetched {INPUTS} object(s)" in done.stderr
