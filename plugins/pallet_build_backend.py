"""pallet's build backend: setuptools', plus a real sys.path entry for the Snakemake plugin in editable installs."""
from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every PEP 517/660 hook, as setuptools defines it)

# Snakemake finds storage plugins with pkgutil.iter_modules(), which sees sys.path entries only. setuptools'
# default (and compat) editable installs serve packages mapped from other directories through an import hook
# instead, so the plugin would import but not be found; strict mode's link tree is a real path entry already.
PLUGIN_ROOT = os.path.join("plugins", "snakemake_staging")
PTH_NAME = "pallet-snakemake-plugin.pth"


def build_editable(wheel_directory: str, config_settings: dict | None = None,
                   metadata_directory: str | None = None) -> str:
    """setuptools' editable wheel; outside strict mode, with a .pth naming the plugin's source directory."""
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    settings = config_settings or {}
    if str(settings.get("editable-mode") or settings.get("editable_mode") or "").lower() != "strict":
        add_file(os.path.join(wheel_directory, name), PTH_NAME, f"{os.path.abspath(PLUGIN_ROOT)}\n".encode())
    return name


def add_file(wheel: str, name: str, data: bytes) -> None:
    """Add ``name`` (at the wheel's root) to ``wheel``, rewriting its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(wheel) as old:
        record = next(i.filename for i in old.infolist() if i.filename.endswith(".dist-info/RECORD"))
        entries = [(info, old.read(info)) for info in old.infolist()]
    temporary = f"{wheel}.tmp"
    with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
        for info, content in entries:
            if info.filename == record:
                content = content.rstrip(b"\n") + f"\n{name},sha256={digest},{len(data)}\n".encode()
            new.writestr(info, content)
    os.replace(temporary, wheel)
