"""The wheels `pallet remote install` ships: pallet's own, built from its source, and its dependencies'."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from importlib import metadata
from urllib.parse import unquote, urlparse

from bundles.errors import PalletError

_SOURCE_JUNK = (".git", "target", ".hg", ".svn", ".venv", "venv", ".tox", ".nox", "build", "dist", "*.egg-info", "__pycache__",
                ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "*.pyc")


class WheelError(PalletError):
    """pallet's wheel cannot be built here, or its dependencies' wheels cannot be had for the far side."""


@dataclass(frozen=True)
class WheelTarget:
    """A CPython that wheels are gathered for: its version, ABI flags, sysconfig platform, machine, macOS
    version and C library (``os.confstr('CS_GNU_LIBC_VERSION')``, e.g. 'glibc 2.36')."""

    version: tuple[int, ...]
    abiflags: str = ""
    platform: str = ""
    machine: str = ""
    mac: str = ""
    libc: str = ""

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))

    @property
    def abi(self) -> str:
        return f"cp{self.version[0]}{self.version[1]}{self.abiflags}"

    def platform_tags(self) -> list[str]:
        """Wheel platform tags this Python accepts, best first (pip does not widen manylinux_2_X itself)."""
        plat = re.sub(r"[-.]", "_", self.platform)
        if plat.startswith("macosx_") and self.mac:
            major, minor = (self.mac.split(".") + ["0"])[:2]
            return [f"macosx_{major}_{0 if int(major) >= 11 else minor}_{self.machine}"]    # pip widens these
        if not plat.startswith("linux_"):
            return [plat]
        arch = plat[len("linux_"):]
        glibc = re.match(r"glibc (\d+)\.(\d+)", self.libc)
        if not glibc:
            return [f"musllinux_1_{n}_{arch}" for n in (2, 1)] + [plat]
        major, minor = int(glibc[1]), int(glibc[2])
        floor = 5 if arch in ("x86_64", "i686") else 17
        tags = [f"manylinux_{major}_{n}_{arch}" for n in range(minor, floor - 1, -1)]
        legacy = [(17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1")]
        tags += [f"{name}_{arch}" for low, name in legacy if minor >= low and (low == 17 or floor == 5)]
        return tags + [plat]


def details(text: str, lines: int = 8) -> str:
    """The last non-blank ``lines`` of a program's output, indented under an error message."""
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "".join(f"\n  | {line[:300]}" for line in kept)


def cache_root() -> str:
    """$XDG_CACHE_HOME/pallet/wheels (default ~/.cache/pallet/wheels)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallet", "wheels")


def _pip(*args: str, what: str) -> None:
    """Run this Python's pip (the local package index and pip configuration apply)."""
    if importlib.util.find_spec("pip") is None:
        raise WheelError(f"pip is not available to this pallet's Python ({sys.executable})",
                         hint=f"install it: {sys.executable} -m ensurepip")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=env)
    if done.returncode != 0:
        raise WheelError(f"{what} failed (pip exited with {done.returncode})" + details(done.stderr),
                         hint="see pip's last lines above")


def pallet_source() -> str:
    """Where this pallet was installed from (its direct_url.json): a source tree, an sdist or a wheel."""
    raw = metadata.distribution("pallet").read_text("direct_url.json")
    url = json.loads(raw).get("url", "") if raw else ""
    path = unquote(urlparse(url).path) if url.startswith("file://") else ""
    if not path or not os.path.exists(path):
        where = f"from {url}, which no longer exists" if path else "from no local source tree, sdist or wheel"
        raise WheelError(f"cannot build pallet's wheel: this pallet was installed {where}",
                         hint="install pallet from its source (`pip install /path/to/pallet`, or ./bootstrap.sh "
                              "install there) and run pallet remote install again")
    return path


def build_pallet_wheel(work: str, source: str) -> str:
    """pallet's own wheel in ``work``, from its :func:`pallet_source`: that wheel, or built with `pip wheel`."""
    out = os.path.join(work, "pallet")
    os.makedirs(out)
    if source.endswith(".whl"):
        return shutil.copy(source, out)
    if os.path.isdir(source):        # build a copy: building writes build/ and *.egg-info, never into the user's tree
        copy = os.path.join(work, "source")
        shutil.copytree(source, copy, symlinks=True, ignore=_ignore_junk)
        source = copy
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []  # else pip fetches it
    _pip("wheel", "--no-deps", "--quiet", *isolation, "--wheel-dir", out, source, what="building pallet's wheel")
    wheels = glob.glob(os.path.join(out, "pallet-*.whl"))
    if len(wheels) != 1:
        raise WheelError(f"building pallet's wheel gave {len(wheels)} wheels", source)
    return wheels[0]


def _ignore_junk(directory: str, names: list[str]) -> set[str]:
    junk = set(shutil.ignore_patterns(*_SOURCE_JUNK)(directory, names))
    return junk | {n for n in names if os.path.isfile(os.path.join(directory, n, "pyvenv.cfg"))}


def requirements(wheel: str) -> list[str]:
    """The Requires-Dist lines of ``wheel`` that belong to no extra: its runtime dependencies."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = HeaderParser().parsestr(archive.read(name).decode("utf-8"))
    return [r for r in meta.get_all("Requires-Dist") or [] if not re.search(r"\bextra\s*==", r)]


def fetch_dependencies(needs: list[str], target: WheelTarget) -> tuple[str, bool]:
    """A directory holding binary wheels of ``needs`` (and theirs) for ``target``; whether any were downloaded.

    The directory, $XDG_CACHE_HOME/pallet/wheels/ABI-PLATFORM, is tried alone first, so a repeated install
    does not use the package index. Environment markers are evaluated by pip for this machine's Python.
    """
    tags = target.platform_tags()
    cache = os.path.join(cache_root(), f"{target.abi}-{tags[0]}")
    os.makedirs(cache, exist_ok=True)
    if not needs:
        return cache, False
    flags = ["--only-binary=:all:", "--python-version", f"{target.version[0]}.{target.version[1]}",
             "--implementation", "cp", "--abi", target.abi, *(a for t in tags for a in ("--platform", t)),
             "--dest", cache, "--quiet", *needs]
    try:
        _pip("download", "--no-index", "--find-links", cache, *flags, what="reading the wheel cache")
        return cache, False
    except WheelError:
        pass
    _pip("download", *flags, what=f"downloading wheels of {', '.join(needs)} for Python {target.version_text} "
                                  f"({tags[0]})")
    return cache, True
