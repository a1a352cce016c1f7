"""The declared options of pallet's own transports (``Transport.declared_options``), apart from the transports.

They are kept apart so that they can be listed without importing any transport or its dependencies (globus-sdk):
``registry.all_declared_options`` reads them through ``Registration.options``. Each transport class sets its
``declared_options`` to its tuple here; tests/test_transport_capabilities.py checks that every tuple matches
its constructor's keyword arguments and defaults.
"""
from __future__ import annotations

from .base import TransportOption

LOCAL_OPTIONS: tuple[TransportOption, ...] = (
    TransportOption("link_mode", str, "copy", "how files reach the destination: copied, hard-linked or reflinked "
                    "(copy-on-write clones where the file system can; copied where it cannot)",
                    choices=("copy", "hardlink", "reflink")),
    TransportOption("threads", int, 0, "regular files copied at once by the native engine (0: one per CPU)"),
)

KEEP_S = 60.0       # seconds an ssh connection is kept for later operations and commands

SSH_OPTIONS: tuple[TransportOption, ...] = (
    TransportOption("ssh_options", str, (), "extra ssh arguments for every connection, e.g. -o ProxyJump=gate "
                    "(one argument a value)", multiple=True, staging_field="ssh_options", flag="--ssh-option",
                    env="PALLET_SSH_OPTIONS"),
    TransportOption("parallel", int, 1, "rsync processes per batch, sharing the one connection and balanced by "
                    "bytes and file count"),
    TransportOption("master", object, None, "a started staging_core.transports.ssh_master.SSHMaster for this host "
                    "and these options (see Transport.connect_early), which the transport takes over and ends",
                    settable=False),
    TransportOption("keep", float, KEEP_S, "seconds the connection stays open without use, for later operations "
                    "and later pallet commands to the host (its socket in $XDG_RUNTIME_DIR/pallet, private to you; "
                    "0: closed when the operation ends)"),
)

GRIDFTP_OPTIONS: tuple[TransportOption, ...] = (
    TransportOption("concurrency", int, None, "files moved at once, globus-url-copy -cc (None: 4)"),
    TransportOption("parallel", int, 1, "TCP streams per file, globus-url-copy -p"),
    TransportOption("pipeline", bool, True, "pipeline commands on each connection, globus-url-copy -pp"),
    TransportOption("fast", bool, True, "MODE E with data channel reuse, globus-url-copy -fast (GridFTP servers "
                    "only)"),
    TransportOption("restart", bool, False, "restart failed transfers, globus-url-copy -rst"),
    TransportOption("verify_checksum", bool, False, "verify each file's checksum after the transfer, "
                    "globus-url-copy -verify-checksum"),
    TransportOption("checksum_alg", str, "MD5", "the checksum algorithm of verify_checksum, globus-url-copy "
                    "-checksum-alg"),
    TransportOption("options", str, (), "extra globus-url-copy arguments, e.g. -s SUBJECT or -cred FILE (one "
                    "argument a value)", multiple=True, env="PALLET_GRIDFTP_OPTIONS"),
)

GLOBUS_OPTIONS: tuple[TransportOption, ...] = (
    TransportOption("local_endpoint", str, None, "UUID of the collection that sees this host's files, e.g. Globus "
                    "Connect Personal", env="PALLET_GLOBUS_LOCAL_ENDPOINT"),
    TransportOption("client", object, None, "a ready globus_sdk.TransferClient (None: one built from the tokens "
                    "of `pallet login globus`)", settable=False),
    TransportOption("local_collection_root", str, "/", "the host directory the local collection shows as /"),
    TransportOption("sync_level", str, None, "skip files already there by this test (None: copy every file)",
                    choices=("exists", "size", "mtime", "checksum")),
    TransportOption("verify_checksum", bool, True, "have Globus verify each file's checksum"),
    TransportOption("timeout", float, 86_400.0, "seconds a task may take (also its deadline)"),
    TransportOption("poll_interval", float, 2.0, "first wait between polls of a task, in seconds"),
    TransportOption("poll_max_interval", float, 60.0, "longest wait between polls of a task, in seconds"),
    TransportOption("submit_attempts", int, 3, "times a task is submitted (with one submission id)"),
    TransportOption("fail_fast", bool, True, "cancel a task that reports a fault waiting cannot cure "
                    "(permission, quota, credentials)"),
    TransportOption("label", str, "pallet", "the label of each task"),
    TransportOption("data_access", str, (), "UUIDs of GCS v5 mapped collections whose data_access consent the "
                    "client asks for",
                    multiple=True),
)
