"""The installed programs run as a user's shell runs them: the environment's scripts, a scrubbed environment."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent       # the scripts of the environment under test: pallet, snakemake, ...
SOURCE = str(Path(__file__).resolve().parents[1])


def user_env(**extra: str) -> dict[str, str]:
    """The test's environment as a user's shell would have it, plus ``extra``: this environment's scripts first
    on PATH (then the test's PATH, which may hold its shims), and no PYTHON* variable or other value that
    points into the source tree, so programs import pallet only from where it is installed."""
    kept = {name: value for name, value in os.environ.items()
            if not name.startswith("PYTHON") and SOURCE not in value and name != "PATH"}
    path = os.pathsep.join([str(BIN), *(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                        if not p.startswith(SOURCE) or p == str(BIN))])
    return {**kept, "PATH": path, "LANG": "C.UTF-8", **extra}


def program(name: str) -> str:
    """The installed script ``name`` of this environment (fails the test if the install did not make it)."""
    path = BIN / name
    assert path.exists(), f"{path} is missing: is pallet installed in this environment?"
    return str(path)


def python_module(module: str) -> list[str]:
    """``python -m MODULE`` with this environment's interpreter (as the docs write it)."""
    return [program("python"), "-m", module]


def copy_of_source(dest: Path) -> Path:
    """``dest``, a copy of the source tree's tracked and untracked-but-not-ignored files (uncommitted work
    included, no build output): an install builds there, never in the checkout other tests run from."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=SOURCE,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        path = Path(SOURCE, name)
        if path.is_file() or path.is_symlink():          # a tracked file deleted in the work tree is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / name, follow_symlinks=False)
    return dest


def fresh_install(root: Path, install_command: str) -> Path:
    """A new virtualenv at ``root`` in which ``install_command`` (a shell line such as the docs' ``pip install
    '.[snakemake]'``) ran in a copy of the source tree (:func:`copy_of_source`, at ROOT-source, kept for an
    editable install), with the new environment first on PATH: the project installed as users install it.

    It is made with a system Python when there is one, and left readable by every user, so a test can
    also run it as another user. Returns the environment's bin directory.
    """
    base = next(p for p in ("/usr/bin/python3", sys.executable) if os.access(p, os.X_OK))
    subprocess.run([base, "-m", "venv", str(root)], check=True, capture_output=True)
    env = {"PATH": f"{root / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": os.environ.get("HOME", "/root"),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_QUIET": "1"}
    source = copy_of_source(root.with_name(f"{root.name}-source"))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", install_command], cwd=source, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{install_command.strip()} failed:\n{done.stderr[-3000:]}"
    for directory, _, _ in os.walk(root):
        os.chmod(directory, 0o755)
    return root / "bin"
