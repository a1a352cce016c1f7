"""What the far side of an ssh destination offers (pallet, python3, tar, codecs, launchers, space), probed per host."""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shlex
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

from mpi_stager.wire import STREAM_VERSION, VERSION_REPORT, VersionReport, WireVersionError

from staging_core.options import StagingOptions
from staging_core.transports.base import Endpoint, Transport

PROBE_TTL_S = 3600
DEFAULT_REMOTE_PYTHON = "python3"
_TOOLS = ("zstd", "pigz", "gzip", "md5sum", "flock", "rsync", "mpirun", "srun", "sbatch")

# $1 DEST, $2 mpi_stager.wire.VERSION_REPORT, then candidate Pythons (shell words; "@recorded" and "@shebang" are
# looked up there). Prints key=value lines; "pallet=CANDIDATE<TAB>REPORT" for the first that imports pallet, REPORT
# the line VERSION_REPORT prints (EXECUTABLE, VERSION, STREAM, SESSION).
_SCRIPT = r"""
dest=$1 code=$2; shift 2
say() { printf '%s=%s\n' "$1" "$2"; }
for candidate in "$@"; do
  case $candidate in            # a path found there runs as one word; a command given to pallet as shell words
    @recorded) candidate=$(cat "$HOME/.config/pallet/python" 2>/dev/null); run='"$candidate"' ;;
    @shebang) script=$(command -v pallet 2>/dev/null || echo "$HOME/.local/bin/pallet")
              candidate=$(head -n 1 "$script" 2>/dev/null | sed -n 's/^#! *//p'); run='"$candidate"' ;;
    *) run=$candidate ;;
  esac
  [ -n "$candidate" ] || continue
  found=$(eval "$run -c \"\$code\"" 2>/dev/null) && [ -n "$found" ] && {
    printf 'pallet=%s\t%s\n' "$candidate" "$found"; break; }
done
say python3 "$(python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null)"
say tar "$(tar --version 2>/dev/null | head -n 1)"
say find_printf "$(find / -maxdepth 0 -printf ok 2>/dev/null)"
for tool in TOOLS; do say "$tool" "$(command -v "$tool" 2>/dev/null)"; done
d=$dest; while [ ! -d "$d" ]; do d=$(dirname -- "$d"); done
say free_kib "$(df -Pk -- "$d" 2>/dev/null | awk 'NR==2 {print $4}')"
say free_inodes "$(df -Pi -- "$d" 2>/dev/null | awk 'NR==2 {print $4}')"
""".replace("TOOLS", " ".join(_TOOLS))


@dataclass(frozen=True)
class FarSide:
    """The probe's findings for one host and destination.

    ``pallet_python`` is the command that runs a Python importing pallet
    there (None: pallet is absent), with its ``pallet_version``,
    ``stream_version`` and ``session_version`` (0: a pallet from before
    mpi_stager.wire, or not said; its session's hello says more); ``tools`` maps each of zstd, pigz, gzip, md5sum,
    flock, rsync, mpirun, srun, sbatch to its path ('' when missing);
    ``free_bytes``/``free_inodes`` are those of DEST's file system (None:
    unknown); ``probed_at`` is a Unix time.
    """

    host: str
    dest: str
    pallet_python: str | None = None
    pallet_version: str = ""
    stream_version: int = 0
    session_version: int = 0
    python3: str = ""
    tar: str = ""
    find_printf: bool = False
    tools: dict[str, str] = field(default_factory=dict)
    free_bytes: int | None = None
    free_inodes: int | None = None
    probed_at: float = 0.0

    @property
    def gnu_tar(self) -> bool:
        return "GNU tar" in self.tar

    @property
    def pallet_usable(self) -> bool:
        """pallet is there and speaks this pallet's stream protocol."""
        return self.pallet_python is not None and self.stream_version == STREAM_VERSION

    @property
    def tar_tools_decoder(self) -> str | None:
        """The codec the far side's own tools can decode for the tar-tools route (None: no such route)."""
        if not (self.gnu_tar and self.find_printf and self.tools.get("md5sum") and self.tools.get("flock")):
            return None
        return "zstd" if self.tools.get("zstd") else "gzip" if self.tools.get("gzip") or self.tools.get("pigz") \
            else "none"

    def routes(self) -> list[str]:
        """The bundle routes these findings allow, best first: 'pallet', 'tar tools'."""
        return [name for name, ok in (("pallet", self.pallet_usable), ("tar tools", self.tar_tools_decoder))
                if ok]

    def summary(self) -> list[str]:
        """Lines for `pallet plan`: what was found and which routes it allows."""
        session = f", session v{self.session_version}" if self.session_version else ""
        pallet = (f"pallet {self.pallet_version} (stream v{self.stream_version}{session}) via {self.pallet_python}"
                  if self.pallet_python else "no pallet")
        tools = ", ".join(name for name in _TOOLS if self.tools.get(name)) or "none"
        space = "unknown" if self.free_bytes is None else f"{self.free_bytes / 2**30:.1f} GiB"
        inodes = "unknown" if self.free_inodes is None else f"{self.free_inodes:,}"
        age = max(0, int(time.time() - self.probed_at))
        return [f"far side {self.host} (probed {age} s ago): {pallet}; python3 {self.python3 or 'missing'}; "
                f"{self.tar or 'no tar'}",
                f"  tools: {tools}; find {'with' if self.find_printf else 'LACKS'} -printf"
                f"{'' if self.find_printf else ' (GNU findutils needed to list the far side)'}; "
                f"free at DEST: {space}, {inodes} inodes",
                f"  bundle routes: {', '.join(self.routes()) or 'none (files go individually)'}"]

    def to_json(self) -> dict:
        return {**asdict(self), "routes": self.routes()}


class RemoteVersionError(WireVersionError):
    """pallet at the far side speaks another stream protocol than this one (found by the probe, before any
    session's hello)."""


def far_side_options(transport: Transport, endpoint: Endpoint, options: StagingOptions,
                     current_space: bool = False) -> tuple[StagingOptions, FarSide | None]:
    """Probe an ssh ``endpoint`` that has no explicit route (``--unpack-via``, ``--pack-via``, ``--keep-packed``)
    and no explicit ``remote_python`` (a Python named by the user is used as given, unprobed).

    Returns the options with ``remote_python`` naming the Python that
    imports pallet there (when one was found) and the findings; other
    endpoints give ``(options, None)``. With ``current_space`` the free
    space and inodes are those of this DEST (cached findings about another
    path are probed again). Raises RemoteVersionError when the pallet found
    there speaks another stream protocol.
    """
    if not transport.capabilities.posix_shell or options.keep_packed or options.unpack_via or options.pack_via \
            or options.remote_python != DEFAULT_REMOTE_PYTHON:
        return options, None
    far = probe_far_side(transport, endpoint, options.remote_python, options.reprobe,
                         current_space=current_space)
    if far.pallet_python and not far.pallet_usable:
        from importlib.metadata import version
        raise RemoteVersionError(
            f"pallet {far.pallet_version} at {endpoint.host} ({far.pallet_python}) speaks stream protocol "
            f"v{far.stream_version}; this pallet {version('pallet')} speaks v{STREAM_VERSION}", endpoint.url(),
            f"run `pallet remote install {endpoint.host}` to install this version there, or pass "
            "--remote-python naming a matching one")
    if far.pallet_usable and far.pallet_python is not None:
        options = replace(options, remote_python=far.pallet_python)
    return options, far


def probe_far_side(transport: Transport, endpoint: Endpoint, remote_python: str = "python3",
                   reprobe: bool = False, ttl_s: float = PROBE_TTL_S, current_space: bool = False) -> FarSide:
    """Probe ``endpoint``'s host with one remote command, or return the cached findings younger than ``ttl_s``.

    pallet is looked for with the Python recorded by `pallet remote install`
    (~/.config/pallet/python), then ``remote_python`` and ``python3`` of the
    login shell, then the one in the shebang of `pallet` on the login PATH or
    in ~/.local/bin. Findings are
    cached per host, user, port and ``remote_python`` under
    $XDG_CACHE_HOME/pallet/probes (written atomically, so concurrent calls
    are safe); their free space is that of the DEST probed (``dest``), and
    with ``current_space`` findings about another path are not used.
    Raises TransportError when the host cannot be reached.
    """
    cache = _cache_path(endpoint, remote_python)
    if not reprobe:
        cached = _read_cache(cache, ttl_s)
        if cached is not None and (not current_space or cached.dest == endpoint.path):
            return cached
    candidates = ["@recorded", *dict.fromkeys((remote_python, "python3")), "@shebang"]
    output = transport.run(["sh", "-c", _SCRIPT, "pallet-probe", endpoint.path, VERSION_REPORT, *candidates])
    found = parse_probe(endpoint, output.decode(errors="replace"), time.time())
    _write_cache(cache, found)
    return found


def parse_probe(endpoint: Endpoint, text: str, now: float) -> FarSide:
    """The FarSide that the probe script's ``key=value`` lines describe."""
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    tools = {name: values.get(name, "") for name in _TOOLS}
    found = FarSide(endpoint.host or "", endpoint.path, python3=values.get("python3", ""), tar=values.get("tar", ""),
                    find_printf=values.get("find_printf") == "ok", tools=tools,
                    free_bytes=_int(values.get("free_kib"), 1024), free_inodes=_int(values.get("free_inodes"), 1),
                    probed_at=now)
    command, _, line = values.get("pallet", "").partition("\t")     # shell words as given, or a path found there
    report = VersionReport.parse(line)
    if not command or report is None:
        return found
    return replace(found, pallet_python=shlex.quote(command) if command.startswith("/") else command,
                   pallet_version=report.pallet_version, stream_version=report.stream,
                   session_version=report.session.high)


def _int(text: str | None, scale: int) -> int | None:
    return int(text) * scale if text and text.strip().isdigit() else None


def forget_probes(host: str) -> None:
    """Drop every cached finding about ``host`` (after something changed there, e.g. `pallet remote install`)."""
    directory = _cache_dir()
    for path in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(host)}-*.json")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallet", "probes")


def _cache_path(endpoint: Endpoint, remote_python: str) -> str:
    key = json.dumps([endpoint.user, endpoint.host, endpoint.port, remote_python])
    return os.path.join(_cache_dir(), f"{endpoint.host}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def _read_cache(path: str, ttl_s: float) -> FarSide | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        data.pop("routes", None)
        found = FarSide(**data)
    except (OSError, ValueError, TypeError):
        return None
    return found if 0 <= time.time() - found.probed_at < ttl_s else None


def _write_cache(path: str, found: FarSide) -> None:
    """Best effort: a cache that cannot be written only means probing again next time."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".probe-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(found.to_json(), handle)
        os.replace(temporary, path)
    except OSError:
        os.unlink(temporary)
