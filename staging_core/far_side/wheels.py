"""The wheels `pallet remote install` ships: pallet's own (as installed, or built from source) and its dependencies'."""
from __future__ import annotations

import base64
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from importlib import metadata
from urllib.parse import unquote, urlparse

from bundles.errors import PalletError

_SOURCE_JUNK = (".git", "target", ".hg", ".svn", ".venv", "venv", ".tox", ".nox", "build", "dist", "*.egg-info",
                "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "*.pyc")

NATIVE_TARGET = os.path.join("bundles", "native", "target")     # cargo's output for the native engine's crate


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
        libc_major, libc_minor = int(glibc[1]), int(glibc[2])
        floor = 5 if arch in ("x86_64", "i686") else 17
        tags = [f"manylinux_{libc_major}_{n}_{arch}" for n in range(libc_minor, floor - 1, -1)]
        legacy = [(17, "manylinux2014"), (12, "manylinux2010"), (5, "manylinux1")]
        tags += [f"{name}_{arch}" for low, name in legacy if libc_minor >= low and (low == 17 or floor == 5)]
        return tags + [plat]


def details(text: str, lines: int = 8) -> str:
    """The last non-blank ``lines`` of a program's output, indented under an error message."""
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "".join(f"\n  | {line[:300]}" for line in kept)


def cache_root() -> str:
    """$XDG_CACHE_HOME/pallet/wheels (default ~/.cache/pallet/wheels)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallet", "wheels")


def _pip(*args: str, what: str, hint: str = "see pip's last lines above", brief: bool = False,
         env: dict[str, str] | None = None) -> None:
    """Run this Python's pip (the local package index and pip configuration apply); ``brief``: a failure says
    pip's last ERROR line only, where it printed one."""
    if importlib.util.find_spec("pip") is None:
        raise WheelError(f"pip is not available to this pallet's Python ({sys.executable})",
                         hint=f"install it: {sys.executable} -m ensurepip")
    env = {**os.environ, **(env or {}), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=env)
    if done.returncode != 0:
        errors = [line.strip()[7:] for line in done.stderr.splitlines() if line.strip().startswith("ERROR: ")]
        said = f": {errors[-1]}" if brief and errors else f" (pip exited with {done.returncode})" + details(done.stderr)
        raise WheelError(f"{what} failed{said}", hint=hint)


def pallet_source() -> str:
    """Where this pallet was installed from (its direct_url.json): a source tree, an sdist or a wheel."""
    url = _direct_url().get("url", "")
    path = unquote(urlparse(url).path) if url.startswith("file://") else ""
    if not path or not os.path.exists(path):
        where = f"from {url}, which no longer exists" if path else "from no local source tree, sdist or wheel"
        raise WheelError(f"cannot build pallet's wheel: this pallet was installed {where}",
                         hint="install pallet from its source (`pip install /path/to/pallet`, or ./bootstrap.sh "
                              "install there) and run pallet remote install again")
    return path


def _direct_url() -> dict:
    raw = metadata.distribution("pallet").read_text("direct_url.json")
    return json.loads(raw) if raw else {}


def installed_wheel(work: str) -> str | None:
    """This pallet as a wheel in ``work``/pallet, packed again from its installed files (no build, no network,
    exactly what runs here); None for an editable install or where :func:`repack_installed` cannot be exact."""
    if _direct_url().get("dir_info", {}).get("editable"):
        return None
    out = os.path.join(work, "pallet")
    os.makedirs(out, exist_ok=True)
    return repack_installed(out)


def repack_installed(out: str) -> str | None:
    """This installed distribution as a wheel in ``out``, from the files its RECORD lists (scripts are made again
    from its entry points where it is installed); None where that cannot be exact: no RECORD, a file missing or
    changed since the install, or a file outside site-packages that is not an entry-point script."""
    dist = metadata.distribution("pallet")
    tags = re.findall(r"^Tag:\s*(\S+)$", dist.read_text("WHEEL") or "", re.M)
    files = _installed_files(dist)
    if files is None or len(tags) != 1:
        return None
    info_dir = next(str(f.parent) for f, _, _ in files if f.name == "METADATA")
    wheel = os.path.join(out, f"pallet-{dist.version}-{tags[0]}.whl")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file, path, _ in sorted(files, key=lambda item: (str(item[0].parent) == info_dir, str(item[0]))):
            with open(path, "rb") as handle:
                archive.writestr(_entry(str(file), path), handle.read())
        record = [f"{file},sha256={digest},{os.path.getsize(path)}" for file, path, digest in files]
        archive.writestr(_entry(f"{info_dir}/RECORD"), "\n".join([*record, f"{info_dir}/RECORD,,", ""]))
    return wheel


def _installed_files(dist: metadata.Distribution) -> list[tuple[metadata.PackagePath, str, str]] | None:
    """The files of ``dist`` that belong in its wheel, each with its path here and its RECORD sha256; None if one is
    missing, differs from its RECORD hash, or lies outside site-packages without being an entry-point script."""
    scripts = {e.name for e in dist.entry_points if e.group in ("console_scripts", "gui_scripts")}
    kept = []
    for file in dist.files or []:
        outside = file.parts[0] == ".."
        install_time = file.parent.name.endswith(".dist-info") and file.name in _INSTALL_TIME
        if outside and file.name in scripts or file.suffix == ".pyc" or install_time:
            continue
        path = str(dist.locate_file(file))
        if outside or not file.hash or file.hash.mode != "sha256" or not os.path.isfile(path):
            return None
        with open(path, "rb") as handle:
            if _sha256(handle.read()) != file.hash.value:
                return None
        kept.append((file, path, file.hash.value))
    return kept if any(f.name == "METADATA" for f, _, _ in kept) else None


_INSTALL_TIME = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}     # written by the installer, not in wheels


def _sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _entry(name: str, path: str | None = None) -> zipfile.ZipInfo:
    """A zip entry for ``name`` with a fixed date, keeping the mode (executable bits) of the file at ``path``."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = ((os.stat(path).st_mode if path else 0o644) & 0o7777 | 0o100000) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def build_requirements_here(source: str) -> bool:
    """Whether this Python has every build requirement of ``source`` (a tree: its pyproject.toml), so that pip
    can build without build isolation, that is without the package index."""
    try:
        with open(os.path.join(source, "pyproject.toml"), "rb") as handle:
            needs = tomllib.load(handle).get("build-system", {}).get("requires", [])
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return bool(needs) and all(_installed(need) for need in needs)


def _installed(requirement: str) -> bool:
    """Whether ``requirement`` (NAME or NAME>=X.Y only; anything else counts as missing) is installed here."""
    match = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*(?:>=\s*(\d+(?:\.\d+)*))?\s*", requirement)
    if not match:
        return False
    try:
        have = metadata.version(match[1])
    except metadata.PackageNotFoundError:
        return False
    numbers = tuple(int(n) for n in re.findall(r"\d+", have.split("+")[0])[:3])
    return not match[2] or numbers >= tuple(int(n) for n in match[2].split("."))


def build_pallet_wheel(work: str, source: str) -> str:
    """pallet's wheel in ``work``/pallet from its :func:`pallet_source`: that wheel, or built with `pip wheel` (a
    tree is copied first): without build isolation where this Python has the build requirements, else with it
    (pip fetches them here; the far side never needs the network)."""
    out = os.path.join(work, "pallet")
    os.makedirs(out, exist_ok=True)
    if source.endswith(".whl"):
        return shutil.copy(source, out)
    env = {}
    if os.path.isdir(source):        # build a copy: building writes build/ and *.egg-info, never into the user's tree
        copy = os.path.join(work, "source")
        shutil.copytree(source, copy, symlinks=True, ignore=_ignore_junk)
        env = _cargo_target(source)
        source = copy
    if os.path.isdir(source) and build_requirements_here(source):
        _pip("wheel", "--no-deps", "--quiet", "--no-build-isolation", "--wheel-dir", out, source, env=env,
             what="building pallet's wheel")
    else:
        _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", out, source, brief=True, env=env,
             what="building pallet's wheel (this Python lacks setuptools, wheel or setuptools-rust, so pip builds "
                  "with isolation, fetching them)",
             hint=f"install them into this Python (`{sys.executable} -m pip install setuptools wheel "
                  "setuptools-rust`) or reach a package index, then run pallet remote install again; a non-editable "
                  "install (`pip install .`) needs neither: its installed files are shipped as they are")
    wheels = glob.glob(os.path.join(out, "pallet-*.whl"))
    if len(wheels) != 1:
        raise WheelError(f"building pallet's wheel gave {len(wheels)} wheels", source)
    return wheels[0]


def _cargo_target(source: str) -> dict[str, str]:
    """CARGO_TARGET_DIR for building the native engine from a copy of ``source``: the tree's own target
    directory where its editable install compiled it (writable), so cargo reuses that work; else nothing."""
    target = os.path.join(source, NATIVE_TARGET)
    if "CARGO_TARGET_DIR" in os.environ or not os.path.isdir(target) or not os.access(target, os.W_OK):
        return {}
    return {"CARGO_TARGET_DIR": target}


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
