"""The engine choice: pallet's compiled per-file loops (``bundles._native``) when built, else pure Python.

Both engines produce the same tar bytes, index columns and files; the
shared tests in tests/test_native_parity.py hold them to it. Set
``PALLET_ENGINE=python`` to use the pure-Python engine even where the
extension is built (it is read on every call, so threads and tests may
switch it); ``PALLET_ENGINE=native`` makes a missing extension an error.
"""
from __future__ import annotations

import importlib
import os
from array import array
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

from .errors import UsageError

INTERFACE = 6          # the extension's interface version this wrapper speaks


@dataclass(frozen=True)
class EngineInfo:
    """Which engine runs, and why the native one does not when it does not."""

    name: str            # "native" or "python"
    reason: str = ""


@lru_cache(maxsize=1)
def _load() -> ModuleType | None:
    """The extension module, or None when it is not built (or built for another interface)."""
    try:
        module = importlib.import_module("bundles._native")
    except ImportError:
        return None
    return module if getattr(module, "INTERFACE", None) == INTERFACE else None


def module() -> ModuleType | None:
    """The extension to call now, or None for the pure-Python engine (see the module docstring)."""
    wanted = os.environ.get("PALLET_ENGINE", "")
    if wanted == "python":
        return None
    if wanted not in ("", "auto", "native"):
        raise UsageError(f"PALLET_ENGINE={wanted!r} is not an engine", hint="use native, python or auto (the default)")
    native = _load()
    if native is None and wanted == "native":
        raise UsageError("PALLET_ENGINE=native, but pallet's native engine is not built",
                         hint="reinstall pallet with cargo on PATH (./bootstrap.sh install), or unset PALLET_ENGINE")
    return native


def releases_gil() -> bool:
    """True when the per-file loops run natively now, so threads (not processes) can share the work."""
    return module() is not None


def engine_info() -> EngineInfo:
    """The engine calls would use now, for ``pallet --version`` and the benchmarks."""
    if os.environ.get("PALLET_ENGINE", "") == "python":
        return EngineInfo("python", "PALLET_ENGINE=python")
    if _load() is None:
        return EngineInfo("python", "the native extension is not built")
    return EngineInfo("native")


def blob(parts) -> bytes:
    """NUL-joined names, as the extension takes them (names never hold a NUL)."""
    return b"\0".join(parts)


def entry_columns(index) -> tuple:
    """The entry columns of ``index`` (an Index) as the extension takes them, one tuple: (count, paths,
    links, kinds, modes, mtimes, sizes, format), ``format`` the bundle format whose tar headers they make."""
    return (len(index), blob(index.paths), blob(index.links), raw(index.kinds), raw(index.modes),
            raw(index.mtimes), raw(index.sizes), index.format)


def as_bytes(data) -> bytes:
    """``data`` as a bytes object, without a copy when it is bytes or a whole view of bytes."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview) and isinstance(data.obj, bytes) and data.nbytes == len(data.obj):
        return data.obj
    return bytes(data)


def raw(column: array) -> bytes:
    """An ``array`` column's bytes in this machine's order, as the extension takes them."""
    return column.tobytes()
