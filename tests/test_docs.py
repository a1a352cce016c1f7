"""Every command block of README.md, docs/snakemake.md, docs/parsl.md and examples/*/README.md runs as written.

The docs' hosts (login.hpc, gateway.hpc, localhost) are a loopback sshd: an `ssh` first on PATH adds `-F` with an
ssh config naming them (ssh reads the config of the passwd entry's home, not of $HOME). That sshd's sessions run
in a home of their own whose .bashrc puts a `python3` with pallet installed (the docs' own, non-editable install)
first on PATH, as the docs assume of a cluster. The docs' example directories (/scratch/me, /proj, /data/set1,
/tmp) are moved under the test's directory; the rest of each block runs as written, except where its test names
a scale-down.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs import SOURCE, DocBlock, blocks_of, doc_block, user_docs
from tests.programs import BIN, program, user_env
from tests.servers import start_sshd

EXAMPLE_DIRS = ("/scratch/me", "/proj/", "/data/set1", "/tmp/")
HOSTS = "login.hpc gateway.hpc localhost"


@dataclass(frozen=True)
class Claim:
    """The test that runs (or checks) the block of ``doc`` whose first line starts with ``first_line``.

    ``by`` is ``module::function``; that function must read the block through ``doc_block`` with the same first
    line. ``not_run`` gives the reason instead when no test here can run the block.
    """

    doc: str
    first_line: str
    by: str = ""
    not_run: str = ""


CLAIMS = (
    Claim("README.md", "./bootstrap.sh demo", "tests.test_docs::test_readme_demo_runs"),
    Claim("README.md", "./bootstrap.sh test", "tests.test_docs::test_ci_runs_the_readme_test_command"),
    Claim("README.md", "pallet pack SRC BUNDLE", "tests.test_docs::test_readme_synopsis_matches_the_help"),
    Claim("docs/snakemake.md", "pip install '.[snakemake]'",
          "tests.test_docs::test_the_install_command_makes_a_plain_install"),
    Claim("docs/snakemake.md", "pip install -e '.[snakemake]'",
          "tests.test_docs::test_bootstrap_installs_as_the_docs_say"),
    Claim("docs/snakemake.md", "SAMPLES = ", "tests.test_docs::test_snakefile_rules_run_with_a_tagged_provider"),
    Claim("docs/snakemake.md", "# 3. everything that is not marked local",
          "tests.test_docs::test_default_storage_prefix_command_runs"),
    Claim("docs/snakemake.md", "rule tree:", "tests.test_docs::test_directory_output_rule_runs"),
    Claim("docs/snakemake.md", ".venv/bin/python benchmarks/bench_snakemake.py",
          "tests.test_docs::test_bench_snakemake_command_runs"),
    Claim("docs/parsl.md", "import parsl", "tests.test_docs::test_parsl_guide_script_runs"),
    Claim("docs/parsl.md", "parsl.dataflow.errors.DependencyError",
          "tests.test_parsl::test_a_failed_batch_fails_each_dependent_app_naming_the_cause"),
    Claim("examples/parsl/README.md", "python examples/parsl/many_inputs.py ssh://localhost/tmp/rows",
          "tests.test_docs::test_parsl_example_runs"),
    Claim("examples/parsl/README.md", "2000 apps, total 2004995, 9.8", "tests.test_docs::test_parsl_example_runs"),
    Claim("examples/parsl/README.md", "python examples/parsl/many_inputs.py ssh://localhost/tmp/kept",
          "tests.test_docs::test_parsl_example_runs"),
    Claim("examples/parsl/README.md", "2000 apps, total 2004995, 12.0", "tests.test_docs::test_parsl_example_runs"),
    Claim("examples/snakemake/README.md", "ssh login.hpc python3 -", "tests.test_docs::example_inputs"),
    Claim("examples/snakemake/README.md", "snakemake -s examples/snakemake/Snakefile --cores 4",
          "tests.test_docs::test_snakemake_example_runs"),
    Claim("examples/snakemake/README.md", "pallet: fetched 2000 object(s)",
          "tests.test_docs::test_snakemake_example_runs"),
    Claim("examples/snakemake/README.md", "snakemake -s examples/snakemake/Snakefile --executor slurm",
          not_run="snakemake-executor-plugin-slurm needs Slurm accounting (sacct, slurmdbd), which the test cluster "
                  "lacks; the same storage flags run with the cluster-generic executor in "
                  "tests/test_snakemake_kept.py"),
)


def test_every_block_of_the_user_docs_is_claimed_by_a_test_that_reads_it():
    claimed = {(claim.doc, claim.first_line): claim for claim in CLAIMS}
    for doc in user_docs():
        for block in blocks_of(doc):
            owners = [c for (d, first), c in claimed.items() if d == doc and block.first_line.startswith(first)]
            assert len(owners) == 1, f"{doc}:{block.line}: block {block.first_line!r} needs one claim in CLAIMS"
    for claim in CLAIMS:
        doc_block(claim.doc, claim.first_line)
        if claim.not_run:
            continue
        module, name = claim.by.split("::")
        function = getattr(importlib.import_module(module), name)
        reads = re.findall(r'doc_block\(\s*"([^"]+)",\s*"([^"]+)"', inspect.getsource(function))
        assert (claim.doc, claim.first_line) in reads, f"{claim.by} does not read {claim.doc}: {claim.first_line!r}"


# ---------------------------------------------------------------- the docs' world: hosts, directories, a user

@dataclass(frozen=True)
class DocWorld:
    """Where the docs' commands run: ``root`` holds the moved example directories, ``env`` is the user's shell."""

    root: Path
    env: dict

    def moved(self, text: str) -> str:
        """``text`` with each of the docs' example directories moved under ``root``."""
        return re.sub("|".join(map(re.escape, EXAMPLE_DIRS)), lambda m: f"{self.root}{m.group(0)}", text)

    def workdir(self, name: str) -> Path:
        """A fresh working directory holding a copy of examples/, as a user's clone would."""
        work = self.root / "work" / name
        shutil.copytree(SOURCE / "examples", work / "examples")
        return work

    def run(self, text: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
        """Run a block's shell text (paths moved) with bash in the user's environment; it must succeed."""
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", self.moved(text)], cwd=cwd, env={**self.env, **env},
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
        assert done.returncode == 0, f"{text.strip()}\nfailed ({done.returncode}):\n{done.stderr[-4000:]}"
        return done


def ssh_config(root: Path, server) -> Path:
    config = root / "ssh_config"
    config.write_text(f"Host {HOSTS}\n" + "".join(f"    {line}\n" for line in (
        "HostName 127.0.0.1", f"Port {server.port}", f"User {server.user}", f"IdentityFile {server.key}",
        "IdentitiesOnly yes", "StrictHostKeyChecking no", f"UserKnownHostsFile {root}/known_hosts",
        "BatchMode yes", "LogLevel ERROR")))
    return config


@pytest.fixture(scope="module")
def world(tmp_path_factory, fresh_venv):
    root = tmp_path_factory.mktemp("docs")
    far_home = root / "far-home"          # the cluster account: its shell start-up puts pallet's Python on PATH
    far_home.mkdir()
    (far_home / ".bashrc").write_text(f'export PATH="{fresh_venv}:$PATH"\n')
    server = start_sshd(root / "sshd", (f"SetEnv HOME={far_home}",))
    shims = root / "bin"
    shims.mkdir()
    (shims / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {ssh_config(root, server)} "$@"\n')
    (shims / "ssh").chmod(0o755)
    (root / "home").mkdir()
    (root / "tmp").mkdir()                # the moved /tmp exists, as /tmp does
    env = user_env(PATH=f"{shims}:{user_env()['PATH']}", HOME=str(root / "home"), TMPDIR=str(root))
    try:
        yield DocWorld(root, env)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def example_inputs(world) -> Path:
    """examples/snakemake/README.md's first command: 2,000 inputs made on login.hpc over ssh."""
    world.run(doc_block("examples/snakemake/README.md", "ssh login.hpc python3 -").text, world.workdir("inputs"))
    inputs = Path(world.moved("/scratch/me/inputs"))
    assert len(list(inputs.glob("s*.csv"))) == 2000
    return inputs


def shape(text: str) -> str:
    """A line with its timings blanked: a sample output and the real one differ in nothing else."""
    return re.sub(r"\d+\.\d+ s\b", "N s", text.strip())


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


SUMMARY_2000 = f"2000 {3 * 2000 * 1999 // 2}\n"      # make_inputs.py writes n,3n into s{n}.csv


# ---------------------------------------------------------------- README.md

@pytest.mark.slow
def test_readme_demo_runs(world):
    if not (BIN.parent / ".pallet-installed").exists():
        pytest.skip("the suite's environment was not made by ./bootstrap.sh, so its demo command would reinstall")
    done = world.run(doc_block("README.md", "./bootstrap.sh demo").text, SOURCE, PALLET_VENV=str(BIN.parent))
    assert "verified" in done.stdout.lower() and "traceback" not in done.stderr.lower(), done.stdout


def test_ci_runs_the_readme_test_command():
    command = doc_block("README.md", "./bootstrap.sh test").text.strip()
    ci = [line.strip() for line in (SOURCE / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert command in ci or f"exec {command}" in ci, f".ci/run must run {command!r}: {ci}"


def test_readme_synopsis_matches_the_help():
    for line in doc_block("README.md", "pallet pack SRC BUNDLE").text.splitlines():
        words = line.split()
        if words[0] == "pallet":
            command = words[:3] if words[1] in ("login", "remote") else words[:2]
            helped = subprocess.run([program("pallet"), *command[1:], "--help"], capture_output=True, text=True,
                                    env=user_env(), stdin=subprocess.DEVNULL)
            assert helped.returncode == 0, f"{' '.join(command)} --help: {helped.stderr}"
        for flag in re.findall(r"--[a-z][a-z-]*", line):
            assert flag in helped.stdout, f"README synopsis: {' '.join(command)} has no {flag} in its --help"


# ---------------------------------------------------------------- docs/snakemake.md

def test_the_install_command_makes_a_plain_install(fresh_venv):
    """The fresh_venv fixture runs the docs' install command; what it made is a plain, non-editable install."""
    doc_block("docs/snakemake.md", "pip install '.[snakemake]'")
    found = subprocess.run([str(fresh_venv / "python"), "-c", "import staging_core; print(staging_core.__file__)"],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert found.returncode == 0 and found.stdout.startswith(str(fresh_venv.parent)), found
    assert all((fresh_venv / script).exists() for script in ("pallet", "snakemake"))


def test_bootstrap_installs_as_the_docs_say():
    """The docs' development install is the one bootstrap.sh makes (tests/test_install.py runs snakemake from it)."""
    command = doc_block("docs/snakemake.md", "pip install -e '.[snakemake]'").text.split("#")[0].split()
    bootstrap = (SOURCE / "bootstrap.sh").read_text()
    assert "--config-settings editable_mode=strict -e" in bootstrap and command[-2:] == [
        "--config-settings", "editable_mode=strict"]


@pytest.mark.slow
def test_snakefile_rules_run_with_a_tagged_provider(world):
    """Rules 1 and 2: explicit queries, and a tagged provider that reaches login.hpc through gateway.hpc."""
    work = world.workdir("rules")
    (work / "Snakefile").write_text(world.moved(doc_block("docs/snakemake.md", "SAMPLES = ").text))
    data, ref = Path(world.moved("/proj/data")), Path(world.moved("/proj/ref"))
    data.mkdir(parents=True)
    ref.mkdir(parents=True)
    for n, sample in enumerate("abc"):
        (data / f"{sample}.csv").write_text("x\n" * (n + 1))
    (ref / "genome.fa").write_text(">chr1\nACGT\n")
    world.run("snakemake -s Snakefile --cores 1 counts.txt genome.fa", work, timeout=300)
    assert (work / "genome.fa").read_text() == ">chr1\nACGT\n"
    counts = (work / "counts.txt").read_text().split()
    assert counts[0:6:2] == ["1", "2", "3"] and counts[-2:] == ["6", "total"]


@pytest.mark.slow
def test_default_storage_prefix_command_runs(world, example_inputs):
    work = world.workdir("default-prefix")
    world.run(doc_block("docs/snakemake.md", "# 3. everything that is not marked local").text, work, timeout=300)
    results = Path(world.moved("/scratch/me/run1"))
    assert files_under(results) == {"results", *(f"results/part{n}.txt" for n in range(4)), "results/summary.txt"}
    assert (results / "results" / "summary.txt").read_text() == SUMMARY_2000


@pytest.mark.slow
def test_directory_output_rule_runs(world):
    work = world.workdir("tree")
    (work / "Snakefile").write_text(world.moved(doc_block("docs/snakemake.md", "rule tree:").text))
    world.run("snakemake -s Snakefile --cores 1", work, timeout=300)
    tree = Path(world.moved("/proj/results/tree"))
    assert files_under(tree) - {".snakemake_timestamp"} == {"made.txt"}


@pytest.mark.slow
def test_bench_snakemake_command_runs(world):
    """Scaled down from 500 jobs to 3 per side; the JSON it promises is written."""
    command = doc_block("docs/snakemake.md", ".venv/bin/python benchmarks/bench_snakemake.py").text
    if not (SOURCE / ".venv" / "bin" / "python").exists():
        pytest.skip("the docs' command runs the bootstrap environment, .venv, which this checkout lacks")
    world.run(command.replace("--outputs 500", "--outputs 3"), SOURCE, timeout=600)
    assert '"outputs": 3' in Path(world.moved("/tmp/bsm-500.json")).read_text()


# ---------------------------------------------------------------- docs/parsl.md, examples/

@pytest.mark.slow
def test_parsl_guide_script_runs(world):
    """The guide's script, scaled down from 10,000 apps to 1,000: each reads one line of its one input."""
    work = world.workdir("parsl-guide")
    script = doc_block("docs/parsl.md", "import parsl").text.replace("range(10_000)", "range(1_000)")
    (work / "count_lines.py").write_text(world.moved(script))
    data = Path(world.moved("/data/set1"))
    data.mkdir(parents=True)
    for n in range(1000):
        (data / f"{n:05d}.csv").write_text(f"{n}\n")
    done = world.run("python count_lines.py", work, timeout=600)
    assert done.stdout.strip().splitlines()[-1] == "1000"


def _run_parsl_example(world, work: Path, command: DocBlock, output: DocBlock) -> None:
    """Run the README's ``command`` block; its printed lines must have the shape of the ``output`` block."""
    done = world.run(command.text, work)
    sample = world.moved(output.text).splitlines()
    printed = done.stdout.strip().splitlines()
    assert [shape(line) for line in printed] == [shape(line) for line in sample], done.stdout


@pytest.mark.slow
def test_parsl_example_runs(world):
    work = world.workdir("parsl-example")
    total = sum(n + n % 7 for n in range(2000))
    _run_parsl_example(world, work, doc_block("examples/parsl/README.md",
                                              "python examples/parsl/many_inputs.py ssh://localhost/tmp/rows"),
                       doc_block("examples/parsl/README.md", "2000 apps, total 2004995, 9.8"))
    assert Path(world.moved("/tmp/rows/total.txt")).read_text() == f"{total}\n"
    _run_parsl_example(world, work, doc_block("examples/parsl/README.md",
                                              "python examples/parsl/many_inputs.py ssh://localhost/tmp/kept"),
                       doc_block("examples/parsl/README.md", "2000 apps, total 2004995, 12.0"))
    assert Path(world.moved("/tmp/kept/total.txt")).read_text() == f"{total}\n"
    mirrored = world.root / f"pallet-parsl-{os.getuid()}" / "localhost" / world.moved("/tmp/kept").lstrip("/")
    assert os.listdir(mirrored) == ["total.txt"]              # the output only: no input was unpacked
    assert sorted(os.listdir(work)) == ["examples"]           # no runinfo/ or parsl-work/ left where it ran


@pytest.mark.slow
def test_snakemake_example_runs(world, example_inputs):
    work = world.workdir("snakemake-example")
    command = doc_block("examples/snakemake/README.md", "snakemake -s examples/snakemake/Snakefile --cores 4").text
    done = world.run(command, work, timeout=300)
    assert (work / "results" / "summary.txt").read_text() == SUMMARY_2000
    sample = world.moved(doc_block("examples/snakemake/README.md", "pallet: fetched 2000 object(s)").text)
    logged = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith("pallet: fetched")]
    assert [shape(line) for line in logged] == [shape(sample)], done.stderr[-3000:]
    again = world.run(command, work, timeout=300)
    assert "Nothing to be done" in again.stderr and "pallet: fetched" not in again.stderr


def test_doc_world_paths_stay_under_the_test_directory(tmp_path):
    world = DocWorld(tmp_path, dict(os.environ))
    moved = world.moved("ssh://localhost/tmp/rows --generate /tmp/rows data=ssh://login.hpc/scratch/me/inputs")
    assert moved == (f"ssh://localhost{tmp_path}/tmp/rows --generate {tmp_path}/tmp/rows "
                     f"data=ssh://login.hpc{tmp_path}/scratch/me/inputs")
