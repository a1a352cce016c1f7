"""The far-side wire: every protocol version and message format pallet and its far side exchange (docs/wire.md).

One package, whose names are all here: ``versions`` (every protocol version, the exit statuses a client acts on),
``hello`` (the versions and capabilities each side speaks, and the version report), ``messages`` (session requests
and answers, and the listing record), ``summaries`` (the far side's JSON summaries), ``host`` (the host session: many
operations on one far-side process) and ``tar_tools`` (the tar-tools route's versioned scripts).
Import from ``mpi_stager.wire``; the modules are how it is laid out.

Each module is loaded when one of its names is first asked for (PEP 562), so that a far-side command
loads only the vocabulary it speaks: a session's start needs its hello, not the host session's messages.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .versions import (HOST_VERSION, LOCKED, MIN_HOST_VERSION, MIN_SESSION_VERSION, MIN_SUMMARY_VERSION,
                           RECEIVER_GONE, SESSION_VERSION, SOURCE_MISSING, STREAM_VERSION, SUMMARY_VERSION,
                           TAR_TOOLS_VERSION, USAGE_ERROR, WireVersionError, decode_resume_reply, encode_resume_reply,
                           install_hint)
    from .hello import (FAR_HELLO, HELLO, HELLO_ENV, HELLO_PREFIX, SESSION_CAPS, VERSION_REPORT, Agreement, Hello,
                        VersionReport, Versions, agree, client_hello, client_hello_in, far_hello_for, hello_env)
    from .messages import (DECLINED, FIND_RECORDS, LISTING_ARGV, LISTING_FIELDS, LISTING_TAG, MAX_LISTING_HEADER,
                           NOT_COMPARABLE, OK, FarEntry, SessionRequest, decode_dirs, decode_listing, encode_dirs,
                           listing_block, listing_size, parse_records)
    from .host import (HOST_CAPS, HOST_HELLO_ENV, HOST_HELLO_PREFIX, MAX_LINE, HostHello, InlineDirectory, InlineFile,
                       PutRequest, TooLarge, decode_error, decode_files, decode_get, decode_put, encode_error,
                       encode_files, encode_get, encode_put, far_hello, frame, host_client_text, parse_header,
                       read_exactly)
    from .summaries import KINDS, PackSummary, ReceiveSummary, StagerSummary, Summary, decode_summary, encode_summary
    from .tar_tools import MANIFEST_END, TAR_TOOLS_LINE, check_tar_tools_line, strip_tar_tools_line, tar_tools_script

# Where each name lives: module -> names (the imports above, for readers and type checkers).
_WHERE: dict[str, tuple[str, ...]] = {
    "versions": ("HOST_VERSION", "LOCKED", "MIN_HOST_VERSION", "MIN_SESSION_VERSION", "MIN_SUMMARY_VERSION",
                 "RECEIVER_GONE", "SESSION_VERSION", "SOURCE_MISSING", "STREAM_VERSION", "SUMMARY_VERSION",
                 "TAR_TOOLS_VERSION", "USAGE_ERROR", "WireVersionError", "decode_resume_reply", "encode_resume_reply",
                 "install_hint"),
    "hello": ("FAR_HELLO", "HELLO", "HELLO_ENV", "HELLO_PREFIX", "SESSION_CAPS", "VERSION_REPORT", "Agreement",
              "Hello", "VersionReport", "Versions", "agree", "client_hello", "client_hello_in", "far_hello_for",
              "hello_env"),
    "messages": ("DECLINED", "FIND_RECORDS", "LISTING_ARGV", "LISTING_FIELDS", "LISTING_TAG", "MAX_LISTING_HEADER",
                 "NOT_COMPARABLE", "OK", "FarEntry", "SessionRequest", "decode_dirs", "decode_listing", "encode_dirs",
                 "listing_block", "listing_size", "parse_records"),
    "host": ("HOST_CAPS", "HOST_HELLO_ENV", "HOST_HELLO_PREFIX", "MAX_LINE", "HostHello", "InlineDirectory",
             "InlineFile", "PutRequest", "TooLarge", "decode_error", "decode_files", "decode_get", "decode_put",
             "encode_error", "encode_files", "encode_get", "encode_put", "far_hello", "frame", "host_client_text",
             "parse_header", "read_exactly"),
    "summaries": ("KINDS", "PackSummary", "ReceiveSummary", "StagerSummary", "Summary", "decode_summary",
                  "encode_summary"),
    "tar_tools": ("MANIFEST_END", "TAR_TOOLS_LINE", "check_tar_tools_line", "strip_tar_tools_line",
                  "tar_tools_script"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    """A name of the wire, loaded from its module at first use (then found in this module's namespace)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "HOST_CAPS", "HOST_HELLO_ENV", "HOST_HELLO_PREFIX", "HOST_VERSION", "HostHello", "InlineDirectory", "InlineFile",
    "MAX_LINE", "MIN_HOST_VERSION", "PutRequest", "TooLarge", "decode_error", "decode_files", "decode_get",
    "decode_put", "encode_error", "encode_files", "encode_get", "encode_put", "far_hello", "frame",
    "host_client_text", "parse_header", "read_exactly",
    "Agreement", "DECLINED", "FAR_HELLO", "FIND_RECORDS", "FarEntry", "HELLO", "HELLO_ENV", "HELLO_PREFIX", "Hello",
    "KINDS", "LISTING_ARGV", "LISTING_FIELDS", "LISTING_TAG", "LOCKED", "MANIFEST_END", "MAX_LISTING_HEADER",
    "MIN_SESSION_VERSION", "MIN_SUMMARY_VERSION", "NOT_COMPARABLE", "OK", "PackSummary", "RECEIVER_GONE",
    "ReceiveSummary", "SESSION_CAPS", "SESSION_VERSION", "SOURCE_MISSING", "STREAM_VERSION", "SUMMARY_VERSION",
    "SessionRequest", "StagerSummary", "Summary", "TAR_TOOLS_LINE", "TAR_TOOLS_VERSION", "USAGE_ERROR",
    "VERSION_REPORT", "VersionReport", "Versions", "WireVersionError", "agree", "check_tar_tools_line", "client_hello",
    "client_hello_in", "decode_dirs", "decode_listing", "decode_resume_reply", "decode_summary", "encode_dirs",
    "encode_resume_reply", "encode_summary", "far_hello_for", "hello_env", "install_hint", "listing_block",
    "listing_size", "parse_records", "strip_tar_tools_line", "tar_tools_script",
]
