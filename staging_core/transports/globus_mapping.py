"""Globus answers in pallet terms: error codes to TransportError subclasses, ls/stat documents to RemoteEntry."""
from __future__ import annotations

import datetime
import stat

import globus_sdk
from globus_sdk.token_storage import TokenValidationError

from .base import RemoteEntry
from .errors import (AuthenticationError, HostUnreachableError, NotSupportedError, RemoteDiskFullError,
                     RemotePathMissingError, RemotePermissionError, TransportError)

LOGIN_HINT = "run `pallet login globus` on this host"
# (needles in the lower-cased, dot/underscore-free Globus code, error class, message, hint)
_RULES = (
    (("consentrequired",), AuthenticationError, "a consent is missing",
     "run `pallet login globus --collection COLLECTION_UUID` for each GCS mapped collection"),
    (("notactivated", "activationrequired", "authenticationfailed", "loginfailed", "credential", "unauthorized",
      "authorizationrequired"), AuthenticationError, "not authorised",
     f"{LOGIN_HINT}, and log into the collection once in the Globus web app (https://app.globus.org)"),
    (("quota", "nospace"), RemoteDiskFullError, "no space left (quota)", "free space or choose another destination"),
    (("notfound", "nosuchfile"), RemotePathMissingError, "path or collection does not exist",
     "check the path and the collection UUID"),
    (("permissiondenied", "forbidden", "notallowed"), RemotePermissionError, "permission denied",
     "check the collection's permissions (sharing ACLs) for your identity"),
    (("invalidpath",), NotSupportedError, "the collection refuses this name", "rename it, or bundle the tree"),
    (("gcdisconnected", "gcnotconnected", "connectfailed", "connectionfailed", "toobusy", "unavailable"),
     HostUnreachableError, "collection unreachable", "check that the endpoint (e.g. Globus Connect Personal) runs"),
)
FAIL_FAST = (AuthenticationError, RemotePermissionError, RemoteDiskFullError)


def classify_globus(code: str | None, detail: str = "", path: str | None = None,
                    status: int | None = None) -> TransportError:
    """Turn a Globus API/task error code (``ClientError.NotFound``, ``PERMISSION_DENIED``, ...) into a
    TransportError."""
    key = (code or "").lower().replace(".", "").replace("_", "")
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    text = f"{code}: {first}" if code and first else (code or first)
    for needles, cls, message, hint in _RULES:
        if any(needle in key for needle in needles):
            return cls(message, path, hint, stderr=text)
    retryable = status is not None and (status >= 500 or status == 429)
    return TransportError(f"Globus error {code or status}", path, "see the Globus message above", stderr=text,
                          retryable=retryable)


def from_sdk(exc: Exception, what: str, path: str | None) -> TransportError:
    """Turn an exception of globus-sdk (network, API, token validation) into a TransportError saying ``what`` failed."""
    if isinstance(exc, globus_sdk.NetworkError):
        return HostUnreachableError(f"{what}: cannot reach the Globus service", path,
                                    "check the network; Globus needs outbound HTTPS", stderr=str(exc), retryable=True)
    if isinstance(exc, globus_sdk.GlobusAPIError):
        error = classify_globus(exc.code, exc.message or "", path, exc.http_status)
        error.message = f"{what}: {error.message}"
        return error
    if isinstance(exc, TokenValidationError):
        return AuthenticationError(f"{what}: no usable Globus login ({type(exc).__name__})", path, hint=LOGIN_HINT)
    return TransportError(f"{what}: {type(exc).__name__}", path, "see the message above", stderr=str(exc))


def unsupported(item: str, mode: int) -> TransportError | None:
    """NotSupportedError for what Globus cannot carry (links, special files), else None."""
    if stat.S_ISLNK(mode):
        return _link_refusal(item)
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return NotSupportedError("Globus carries only regular files and directories", item)
    return None


def _link_refusal(item: str) -> NotSupportedError:
    return NotSupportedError("Globus does not carry symbolic links", item,
                             "bundle the tree (pallet pack) so links travel inside the bundle")


def remote_kind(doc: dict | None, item: str) -> str | TransportError:
    """'d' or 'f' for a listed entry, or the error that keeps it out of a task."""
    if doc is None:
        return RemotePathMissingError("source does not exist on the collection", item, "check the remote path")
    if doc.get("link_target") or doc.get("type") == "invalid_symlink":
        return _link_refusal(item)
    return "d" if doc.get("type") == "dir" else "f"


def entry(rel: str, doc: dict) -> RemoteEntry:
    """A RemoteEntry from an operation_ls/operation_stat document (mtime to the second)."""
    kind = "l" if doc.get("link_target") or doc.get("type") == "invalid_symlink" else \
        "d" if doc.get("type") == "dir" else "f"
    modified = doc.get("last_modified") or "1970-01-01 00:00:00+00:00"
    seconds = datetime.datetime.fromisoformat(modified).timestamp()
    return RemoteEntry(rel, kind, int(doc.get("size") or 0) if kind == "f" else 0,
                       int(doc.get("permissions") or "0", 8), int(seconds) * 1_000_000_000,
                       doc.get("link_target") or "")
