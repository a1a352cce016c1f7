"""The project's static checks: mypy and ruff, configured in pyproject.toml, report nothing on the source tree."""
from __future__ import annotations

import subprocess

from programs import SOURCE, program, user_env


def _check(argv: list[str], cache: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=SOURCE, env=user_env(MYPY_CACHE_DIR=cache, RUFF_CACHE_DIR=cache),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)


def test_mypy_finds_nothing_in_the_product_code(tmp_path):
    """Every package that ships (the `files` of [tool.mypy]) type-checks, bodies of unannotated functions
    included."""
    done = _check([program("mypy")], str(tmp_path / "mypy"))
    assert done.returncode == 0 and "Success: no issues found" in done.stdout, done.stdout[-6000:] + done.stderr


def test_ruff_finds_nothing_in_any_python_file(tmp_path):
    """ruff's rule set of [tool.ruff.lint] holds on every Python file: product, tests, benchmarks, examples."""
    done = _check([program("ruff"), "check", "--no-fix", "."], str(tmp_path / "ruff"))
    assert done.returncode == 0 and "All checks passed" in done.stdout, done.stdout[-6000:] + done.stderr
