"""Queries are pallet URLs: validation without I/O (wildcards allowed), parsing, and the local suffix."""
from __future__ import annotations

import posixpath
import re

from snakemake_interface_storage_plugins.io import WILDCARD_REGEX
from snakemake_interface_storage_plugins.storage_provider import StorageQueryValidationResult

from staging_core import Endpoint, UsageError, parse_url

_SCHEME = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<rest>.*)$")
_PLACEHOLDER = "1"      # stands for a wildcard while validating: fits a host, a port (1..65535), a user and a path part
_FORMS = ("write ssh://[user@]host[:port]/abs, [user@]host:/abs, gsiftp://host[:port]/abs, ftp://host/abs, "
          "globus://COLLECTION/abs or file:///abs")

EXAMPLES = (
    ("ssh://login.hpc.example.org/project/data/{sample}.csv", "a file on an ssh host (rsync over ssh)"),
    ("login.hpc.example.org:/project/results/", "scp-style ssh location, here a directory"),
    ("gsiftp://gridftp.example.org:2811/scratch/me/{sample}.csv", "a file on a GridFTP server"),
    ("globus://6c54cade-bde5-45c1-bdea-f4bd71dba2cc/project/data/{sample}.csv",
     "a file on a Globus collection (by its UUID)"),
    ("file:///scratch/me/data/{sample}.csv", "a file on a locally mounted file system"),
)


def validate(query: str) -> StorageQueryValidationResult:
    """Whether ``query`` is a pallet URL this plugin can serve, with the reason if not; performs no I/O.

    Accepted: ``ssh://[user@]host[:port]/abs``, ``[user@]host:/abs``,
    ``gsiftp://``, ``ftp://``, ``globus://ENDPOINT/abs`` and ``file:///abs``,
    with Snakemake ``{wildcards}`` anywhere but in the scheme. Plain paths
    are refused (other storage plugins claim them; write ``file:///abs``),
    as are relative remote paths, unknown schemes, passwords in the URL
    and a bare ``/``.
    """
    concrete = WILDCARD_REGEX.sub(_PLACEHOLDER, query)
    if concrete.startswith("/"):
        return _invalid(query, f"a plain path is not a pallet URL (other storage plugins take those); "
                               f"write file://{query}")
    try:
        endpoint = parse_url(concrete)
    except UsageError as exc:
        return _invalid(query, f"{exc.message}; {_FORMS}")
    if endpoint.is_local and not concrete.startswith("file:///"):
        return _invalid(query, "file URLs take an absolute path and no host: file:///abs/path")
    if endpoint.user and ":" in endpoint.user:
        return _invalid(query, "do not write passwords into URLs; use ssh keys or an agent")
    if endpoint.path == "/":
        return _invalid(query, "the URL names the root directory '/'; name a file or directory below it")
    return StorageQueryValidationResult(query=query, valid=True)


def _invalid(query: str, reason: str) -> StorageQueryValidationResult:
    return StorageQueryValidationResult(query=query, valid=False, reason=reason)


def local_suffix(query: str) -> str:
    """Where the object lives below the provider's local prefix: ``SCHEME/[user@]HOST[:PORT]/PATH``.

    Worked out from the text alone, so that wildcards anywhere (a port
    too) stay in place and the suffix of a pattern, formatted, is the
    suffix of the concrete query. ``host:/p`` and ``ssh://host/p`` share
    one suffix; ``file:///p`` is ``file/p``.
    """
    match = _SCHEME.match(query)
    if match:
        netloc, _, path = match["rest"].partition("/")
        parts = ("file",) if match["scheme"] == "file" else (match["scheme"], netloc)
    else:
        netloc, _, path = query.partition(":")
        parts = ("ssh", netloc)
    return posixpath.join(*parts, posixpath.normpath("/" + path).lstrip("/"))


def query_for(endpoint: Endpoint) -> str:
    """The query naming ``endpoint`` (``file:///...`` for local paths)."""
    return f"file://{endpoint.path}" if endpoint.is_local else endpoint.url()
