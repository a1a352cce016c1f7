"""The plugin's `--storage-pallet-*` settings and their translation into pallet's StagingOptions."""
# No `from __future__ import annotations` here: Snakemake reads these field types at run time (bool flags).

import shlex
from dataclasses import dataclass, field
from typing import Optional

from snakemake_interface_common.exceptions import WorkflowError
from snakemake_interface_storage_plugins.settings import StorageProviderSettingsBase

from staging_core import STRATEGIES, StagingOptions, parse_size

CODECS = ("zstd", "gzip", "none")


def _setting(default, text: str, kind):
    """A settings field: Snakemake needs the help text, the default and an explicit ``type`` for each."""
    return field(default=default, metadata={"help": text, "type": kind})


@dataclass
class StorageProviderSettings(StorageProviderSettingsBase):
    """Every `--storage-pallet-NAME VALUE` flag (also `[TAG::]VALUE` for tagged providers).

    None of them carries a secret: credentials come from the transports'
    own sources (ssh keys and agent, X509 proxy, Globus token file), never
    from settings, because Snakemake copies settings into job scripts.
    """

    strategy: str = _setting("auto", "How to move a batch: auto (the planner decides), individual, bundle or "
                                     "hybrid.", str)
    codec: Optional[str] = _setting(None, "Bundle compression: zstd, gzip or none (default: the planner's "
                                          "choice, zstd for fetches).", str)
    ssh_options: Optional[str] = _setting(None, "Extra ssh arguments for every connection, one string split "
                                                "like a shell command line, e.g. '-o ProxyJump=gateway'.", str)
    remote_python: str = _setting("python3", "Python with pallet installed on ssh hosts (runs mpi_stager "
                                             "pack/unpack there).", str)
    jobs: int = _setting(0, "Local worker processes for packing and unpacking (0: one per CPU).", int)
    ranks: int = _setting(1, "Processes that pack or unpack at the far side.", int)
    launcher: Optional[str] = _setting(None, "Command prefix that starts mpi_stager at the far side, e.g. "
                                             "'srun -n 16'.", str)
    profile: Optional[str] = _setting(None, "Link profile measured with `pallet calibrate --name NAME` "
                                            "(default: the documented generic profile).", str)
    pack_via: Optional[str] = _setting(None, "ssh://HOST that sees a GridFTP/Globus source's file system and "
                                             "packs bundles there.", str)
    unpack_via: Optional[str] = _setting(None, "ssh://HOST that sees a GridFTP/Globus destination's file "
                                               "system and unpacks bundles there.", str)
    retries: int = _setting(2, "Attempts after the first when a batch fails for network reasons.", int)
    no_verify: bool = _setting(False, "Do not check unpacked files against the bundle index hashes.", bool)
    no_ondemand_links: bool = _setting(False, "Copy file:// inputs that Snakemake marks on-demand eligible "
                                              "(read once, sequentially, by one job) instead of linking them "
                                              "in place.", bool)
    keep_packed: bool = _setting(False, "Fetch the remote directory a batch's objects share once, whole, as one "
                                        "bundle kept below --storage-pallet-packed-dir, and copy each object "
                                        "out of it (hash-checked) when it is retrieved: remote jobs on one node "
                                        "share one fetch. Needs pallet at the source.", bool)
    packed_dir: Optional[str] = _setting(None, "Where kept bundles live (default: .pallet-packed below the "
                                               "local storage prefix; in remote jobs, node-local when "
                                               "--remote-job-local-storage-prefix is); a directory "
                                               "only you can write into. $VARS and ~ are expanded where the "
                                               "inputs are retrieved (e.g. '/local/$USER/packed').", str)
    batch_window: float = _setting(0.0, "Seconds a batch stays open for more requests of the same round "
                                        "(0: until the scheduler has handed over the whole round).", float)
    batch_max_files: int = _setting(0, "Start a new batch after this many objects (0: no limit).", int)
    batch_max_bytes: Optional[int] = _setting(None, "Start a new batch after this many bytes, e.g. 64G "
                                                    "(default: no limit).", parse_size)


def check(settings: StorageProviderSettings) -> None:
    """Raise WorkflowError naming the flag of any setting with a value pallet cannot use."""
    problems = []
    if settings.strategy not in STRATEGIES:
        problems.append(f"--storage-pallet-strategy must be one of {', '.join(STRATEGIES)}, not {settings.strategy!r}")
    if settings.codec is not None and settings.codec not in CODECS:
        problems.append(f"--storage-pallet-codec must be one of {', '.join(CODECS)}, not {settings.codec!r}")
    for name in ("jobs", "ranks", "retries", "batch_max_files"):
        if getattr(settings, name) < 0:
            problems.append(f"--storage-pallet-{name.replace('_', '-')} must not be negative")
    if settings.batch_window < 0:
        problems.append("--storage-pallet-batch-window must not be negative")
    try:
        shlex.split(settings.ssh_options or "")
    except ValueError as exc:
        problems.append(f"--storage-pallet-ssh-options cannot be split: {exc}")
    if problems:
        raise WorkflowError("invalid pallet storage settings: " + "; ".join(problems))


def staging_options(settings: StorageProviderSettings) -> StagingOptions:
    """The StagingOptions every batch of this provider runs with (no progress bars inside Snakemake's log)."""
    return StagingOptions(strategy=settings.strategy, codec=settings.codec, jobs=settings.jobs,
                          ranks=settings.ranks, launcher=settings.launcher, remote_python=settings.remote_python,
                          ssh_options=tuple(shlex.split(settings.ssh_options or "")),
                          verify=not settings.no_verify, profile=settings.profile, pack_via=settings.pack_via,
                          unpack_via=settings.unpack_via, retries=settings.retries, progress=False)
