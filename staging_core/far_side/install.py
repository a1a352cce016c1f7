"""`pallet remote install|status HOST`: put pallet in a virtualenv on an ssh host with no network, and report it."""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata

from bundles.errors import PalletError, UsageError
from mpi_stager.wire import (MIN_SESSION_VERSION, SESSION_VERSION, STREAM_VERSION, VERSION_REPORT, Agreement,
                             VersionReport, Versions)

from staging_core.far_side.probe import forget_probes
from staging_core.scratch import scratch
from staging_core.transports.base import Endpoint
from staging_core.transports.errors import classify
from staging_core.far_side.wheels import (WheelTarget, build_pallet_wheel, details, fetch_dependencies,
                                          installed_wheel, pallet_source, requirements)

DEFAULT_PREFIX = "~/.local/share/pallet/venv"
RECORD = "~/.config/pallet/python"      # the far side's file naming PREFIX/bin/python; far_side.probe reads it
EXIT_OK, EXIT_FAILURE = 0, 1
_HOST = re.compile(r"^(?:ssh://)?(?:(?P<user>[^@/:]+)@)?(?P<host>[A-Za-z0-9._-]+)(?::(?P<port>\d+))?/?$")

# Runs under the far side's --python; kept to Python 2 syntax so that any old Python can say its version.
_QUERY_CODE = r'''
import sys
print("@version=%d.%d.%d" % tuple(sys.version_info[:3]))
import os, platform, sysconfig
print("@implementation=" + sys.implementation.name)
print("@abiflags=" + getattr(sys, "abiflags", ""))
print("@platform=" + sysconfig.get_platform())
print("@machine=" + platform.machine())
print("@mac=" + platform.mac_ver()[0])
try:
    print("@libc=" + (os.confstr("CS_GNU_LIBC_VERSION") or ""))
except (AttributeError, ValueError, OSError):
    print("@libc=")
try:
    import venv, ensurepip
    print("@venv=" + ensurepip.version())
except Exception as exc:
    print("@venv_error=%s: %s" % (type(exc).__name__, exc))
'''

# $1 the query code, then the words of --python; prints the query's lines, or @missing=CMD.
_QUERY_SCRIPT = r'''
code=$1; first=$2; shift 2
case $first in "~/"*) first=$HOME/${first#"~/"} ;; esac
command -v "$first" >/dev/null 2>&1 || { printf '@missing=%s\n' "$first"; exit 0; }
"$first" "$@" -c "$code" </dev/null 2>&1
printf '@status=%s\n' "$?"
'''

# stdin: a tar of wheels. $1 PREFIX, $2 X.Y, $3 pallet's wheel, $4 mpi_stager.wire.VERSION_REPORT (the verification),
# then the words of --python.
# Prints @key=value lines; a failed step prints @fail=STEP and the last lines of its output as @detail=.
_INSTALL_SCRIPT = r'''
prefix=$1 want=$2 wheel=$3 code=$4 first=$5; shift 5
say() { printf '@%s=%s\n' "$1" "$2"; }
fail() { say fail "$1"; tail -n 8 "$log" 2>/dev/null | sed 's/^/@detail=/'; exit 0; }
case $prefix in "~") prefix=$HOME ;; "~/"*) prefix=$HOME/${prefix#"~/"} ;; /*) ;; *) prefix=$HOME/$prefix ;; esac
case $first in "~/"*) first=$HOME/${first#"~/"} ;; esac
dir=$(mktemp -d "${TMPDIR:-/tmp}/pallet-wheels.XXXXXX") || { say fail ship; exit 0; }
trap 'rm -rf -- "$dir"' EXIT
trap 'exit 1' HUP INT TERM
log=$dir/log
mkdir "$dir/wheels" && tar -x -C "$dir/wheels" 2>"$log" || fail ship
say prefix "$prefix"
py=$prefix/bin/python
if [ "$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' </dev/null 2>/dev/null)" = "$want" ]; then
  say venv kept
else
  [ -e "$prefix" ] && [ ! -f "$prefix/pyvenv.cfg" ] && [ -n "$(ls -A -- "$prefix" 2>/dev/null)" ] && fail not-a-venv
  "$first" "$@" -m venv --clear "$prefix" </dev/null >"$log" 2>&1 || fail venv
  say venv created
fi
pip() { "$py" -m pip --isolated --disable-pip-version-check --no-input install --no-index --no-cache-dir \
        --find-links "$dir/wheels" "$@" </dev/null >>"$log" 2>&1; }
pip --force-reinstall --no-deps "$dir/wheels/$wheel" && pip pallet \
  && "$py" -m pip --isolated --disable-pip-version-check check </dev/null >>"$log" 2>&1 || fail pip
found=$("$py" -c "$code" </dev/null 2>>"$log") || fail verify
say pallet "$found"
conf=$HOME/.config/pallet
{ mkdir -p -- "$conf" && printf '%s\n' "$py" >"$conf/.python.$$" && mv -f -- "$conf/.python.$$" "$conf/python"; } \
  2>>"$log" || fail record
say recorded "$py"
'''

# $1 mpi_stager.wire.VERSION_REPORT, the code that prints EXECUTABLE<TAB>VERSION<TAB>STREAM<TAB>SESSION for a Python
# importing pallet.
_STATUS_SCRIPT = r'''
code=$1
say() { printf '@%s=%s\n' "$1" "$2"; }
recorded=$(cat "$HOME/.config/pallet/python" 2>/dev/null)
say recorded "$recorded"
[ -n "$recorded" ] && say recorded_pallet "$("$recorded" -c "$code" </dev/null 2>/dev/null)"
say python3_pallet "$(python3 -c "$code" </dev/null 2>/dev/null)"
say python3 "$(python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' </dev/null 2>/dev/null)"
'''


class RemoteInstallError(PalletError):
    """pallet cannot be installed on the far side (its Python, the local build, or a step there failed)."""


@dataclass(frozen=True)
class FarPython(WheelTarget):
    """What the far side's ``--python`` said about itself (``venv``: ensurepip's pip version, '' if missing)."""

    implementation: str = ""
    venv: str = ""
    venv_error: str = ""


@dataclass(frozen=True)
class InstallResult:
    """The summary of one `pallet remote install` (`--json` prints it)."""

    host: str
    python: str
    python_version: str
    prefix: str
    remote_python: str
    recorded_in: str
    pallet_version: str
    stream_version: int
    session_version: int
    venv: str
    wheels: int
    wheel_bytes: int
    downloaded: bool
    wheel_from: str         # pallet's own wheel: 'installed' (this install's files), 'wheel' (it came from) or 'built'
    seconds: float


@dataclass(frozen=True)
class RemoteStatus:
    """What `pallet remote status` found: the recorded Python, which Python imports pallet, and versions: the
    far side's stream version and the session versions it speaks, ``min_session_version`` to
    ``session_version`` (0: a pallet from before mpi_stager.wire, which reports none; no pallet: all 0)."""

    host: str
    recorded: str
    pallet_python: str
    pallet_version: str
    stream_version: int
    min_session_version: int
    session_version: int
    python3: str
    local_version: str
    local_stream_version: int
    local_session_version: int

    @property
    def sessions(self) -> Versions:
        return Versions(self.min_session_version, self.session_version)

    def agreement(self) -> Agreement | None:
        """What this pallet's hello and that of the pallet there would agree on (None: no pallet there)."""
        if not self.pallet_python:
            return None
        return VersionReport(self.pallet_python, self.pallet_version, self.stream_version, self.sessions).agreement()

    @property
    def usable(self) -> bool:
        """A pallet is there whose sessions' hello would agree with this pallet's."""
        agreement = self.agreement()
        return agreement is not None and agreement.ok

    @property
    def matches(self) -> bool:
        return self.usable and self.pallet_version == self.local_version

    def problem(self) -> str:
        """Why the pallet there does not agree with this one ('' when it does, or none is there)."""
        agreement = self.agreement()
        if agreement is None or agreement.ok:
            return ""
        if self.session_version == 0:
            return (f"the far side's pallet reports no session version (it predates mpi_stager.wire); this pallet "
                    f"speaks session protocol {Versions(MIN_SESSION_VERSION, SESSION_VERSION)}")
        return agreement.problem(client_side=True)

    def to_json(self) -> dict:
        return {**asdict(self), "usable": self.usable, "matches": self.matches}


# ---------------------------------------------------------------- the far side

def parse_host(text: str) -> Endpoint:
    """An ssh Endpoint from ``[user@]host[:port]`` or ``ssh://[user@]host[:port]``."""
    match = _HOST.match(text)
    if not match:
        raise UsageError(f"not an ssh host: {text!r}", hint="write [user@]host[:port] or ssh://[user@]host[:port]")
    return Endpoint("ssh", "/", match["host"], int(match["port"]) if match["port"] else None, match["user"])


def host_name(endpoint: Endpoint) -> str:
    user, port = f"{endpoint.user}@" if endpoint.user else "", f":{endpoint.port}" if endpoint.port else ""
    return f"{user}{endpoint.host}{port}"


def _open(endpoint: Endpoint, ssh_options: Sequence[str]):
    from staging_core.transports.registry import open_transport
    return open_transport(endpoint, ssh_options=list(ssh_options))


def _values(text: str) -> dict[str, str]:
    """The ``@key=value`` lines of a far-side script (``@detail`` lines joined by newlines)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, eq, value = line[1:].partition("=")
        if line.startswith("@") and eq:
            values[key] = f"{values[key]}\n{value}" if key == "detail" and key in values else value
    return values


def query_python(transport, words: list[str], host: str, python: str) -> FarPython:
    """Ask the far side's Python for its version, platform and venv support (one remote command)."""
    output = transport.run(["sh", "-c", _QUERY_SCRIPT, "pallet-remote", _QUERY_CODE, *words])
    text = output.decode(errors="replace")
    values = _values(text)
    if "missing" in values:
        raise RemoteInstallError(f"{python} not found on {host}: pass --python CMD naming a Python 3 there "
                                 "(e.g. --python python3.12 or --python /opt/python/bin/python3)")
    if not re.fullmatch(r"\d+\.\d+\.\d+", values.get("version", "")):
        raise RemoteInstallError(f"{python} on {host} did not say its version" + details(text),
                                 hint="pass --python CMD naming a Python 3 there")
    return FarPython(tuple(int(p) for p in values["version"].split(".")),
                     **{k: values.get(k, "") for k in ("implementation", "abiflags", "platform", "machine", "mac",
                                                      "libc", "venv", "venv_error")})


def check_python(far: FarPython, host: str, python: str) -> None:
    """Refuse a Python older than pallet's Requires-Python, not CPython, or without venv."""
    needed = metadata.metadata("pallet")["Requires-Python"] or ""
    if not satisfies(far.version, needed):
        raise RemoteInstallError(f"{python} on {host} is Python {far.version_text} but pallet needs Python "
                                 f"{needed}: pass --python CMD naming a newer Python there (e.g. --python python3.12)")
    if far.implementation != "cpython":
        raise RemoteInstallError(f"{python} on {host} is {far.implementation or 'not CPython'}; pallet's wheels are "
                                 "built for CPython: pass --python CMD naming a CPython there")
    if not far.venv:
        raise RemoteInstallError(f"{python} on {host} cannot create virtualenvs (no venv/ensurepip: "
                                 f"{far.venv_error or 'unknown'})",
                                 hint="install the python3-venv package there (Debian/Ubuntu), or pass --python CMD "
                                      "naming a Python that has venv (e.g. one from `module load python`)")


def satisfies(version: tuple[int, ...], spec: str) -> bool:
    """Whether ``version`` meets a Requires-Python ``spec`` such as '>=3.11' or '>=3.9,<4' (unknown clauses pass)."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = re.fullmatch(r"(~=|===?|!=|<=|>=|<|>)\s*(\d+(?:\.\d+)*)(\.\*)?", clause)
        if not match:
            continue
        op, text, star = match.groups()
        want = tuple(int(p) for p in text.split("."))
        have, padded = version[:len(want)], want + (0,) * (len(version) - len(want))
        ok = {"==": have == want if star else version == padded, "===": version == padded,
              "!=": have != want if star else version != padded, "<=": version <= padded, ">=": version >= padded,
              "<": version < padded, ">": version > padded,
              "~=": version >= padded and version[:len(want) - 1] == want[:-1]}[op]
        if not ok:
            return False
    return True


# ---------------------------------------------------------------- install and status

def install(host: str, python: str = "python3", prefix: str = DEFAULT_PREFIX, ssh_options: Sequence[str] = (),
            say: Callable[[str], None] = lambda line: None) -> InstallResult:
    """Install this pallet into a virtualenv at ``prefix`` on ``host`` with ``python`` there, offline there."""
    started, endpoint = time.monotonic(), parse_host(host)
    name, words = host_name(endpoint), shlex.split(python)
    if not words:
        raise RemoteInstallError("--python is empty: name a Python command there, e.g. --python python3")
    prefix = prefix.rstrip("/") or "/"
    with scratch("pallet-wheels-") as work:
        wheel = installed_wheel(work)                   # this install's own files, packed again: no build
        source = None if wheel else pallet_source()     # else built from its source: fails before any contact
        with _open(endpoint, ssh_options) as transport:
            say(f"pallet: checking {python} on {name} ...")
            far = query_python(transport, words, name, python)
            check_python(far, name, python)
            say(f"pallet: {name} has Python {far.version_text} ({far.platform_tags()[0]}); gathering wheels ...")
            if wheel:
                wheel_from = "installed"
            else:
                assert source is not None           # pallet_source() above: there is no installed wheel
                wheel_from = "wheel" if source.endswith(".whl") else "built"
                wheel = build_pallet_wheel(work, source)
            cache, downloaded = fetch_dependencies(requirements(wheel), far)
            files = [wheel, *sorted(glob.glob(os.path.join(cache, "*.whl")))]
            size = sum(os.path.getsize(f) for f in files)
            say(f"pallet: shipping {len(files)} wheels ({size / 2**20:.1f} MiB) to {name} ...")
            values = ship_and_install(transport, files, prefix, far, words)
    _check_installed(values, name, python)
    assert endpoint.host is not None                     # parse_host always names one
    forget_probes(endpoint.host)
    where, report = values["prefix"], VersionReport.parse(values["pallet"])
    assert report is not None                           # _check_installed: it reads
    version = report.pallet_version
    say(f"pallet: installed pallet {version} at {where}; recorded in {RECORD}")
    if version != metadata.version("pallet"):
        say(f"pallet: note: the source tree this pallet {metadata.version('pallet')} was installed from is now "
            f"version {version}; reinstall pallet here to match")
    return InstallResult(name, python, far.version_text, where, values["recorded"], RECORD, version, report.stream,
                         report.session.high, values.get("venv", ""), len(files), size, downloaded, wheel_from,
                         round(time.monotonic() - started, 3))


def ship_and_install(transport, files: list[str], prefix: str, far: FarPython, words: list[str]) -> dict[str, str]:
    """Stream ``files`` as a tar into one far-side session that makes the venv, installs and records it."""
    want = f"{far.version[0]}.{far.version[1]}"
    argv = ["sh", "-c", _INSTALL_SCRIPT, "pallet-remote", prefix, want, os.path.basename(files[0]), VERSION_REPORT,
            *words]
    process = transport.stream_into(argv)
    try:
        with tarfile.open(fileobj=process.stdin, mode="w|", format=tarfile.PAX_FORMAT) as archive:
            for path in files:
                archive.add(path, arcname=os.path.basename(path), recursive=False)
    except BrokenPipeError:
        pass                                    # the far side stopped reading: its output says why
    out, err = process.communicate()
    if process.returncode != 0:
        raise classify(err.decode(errors="replace"), process.returncode, None, transport.endpoint.url(),
                       f"the install session on {transport.endpoint.host} failed (status {process.returncode})")
    return _values(out.decode(errors="replace"))


_STEPS = {
    "ship": ("cannot unpack the shipped wheels there", "check the free space of $TMPDIR (or /tmp) there"),
    "not-a-venv": ("{prefix} exists there and is not a virtualenv", "choose another --prefix, or remove it"),
    "venv": ("`{python} -m venv {prefix}` failed there",
             "install the python3-venv package there, or pass --python CMD naming a Python that has venv"),
    "pip": ("pip could not install pallet from the shipped wheels there",
            "a wheel for that Python or platform may be missing: see pip's lines above"),
    "verify": ("{prefix}/bin/python does not import pallet after the install", "see the lines above"),
    "record": (f"cannot write {RECORD} there", "check the permissions of ~/.config there"),
}


def _check_installed(values: dict[str, str], host: str, python: str) -> None:
    step = values.get("fail")
    if step is None and (not values.get("recorded") or VersionReport.parse(values.get("pallet", "")) is None):
        step = "verify"
    if step is not None:
        message, hint = _STEPS.get(step, (f"step {step} failed there", "see the lines above"))
        prefix = values.get("prefix", "PREFIX")
        raise RemoteInstallError(f"{host}: " + message.format(prefix=prefix, python=python)
                                 + details(values.get("detail", "")), hint=hint)


def status(host: str, ssh_options: Sequence[str] = ()) -> RemoteStatus:
    """What is at ``host``: the recorded Python, which Python imports pallet, its versions (one remote command)."""
    endpoint = parse_host(host)
    with _open(endpoint, ssh_options) as transport:
        output = transport.run(["sh", "-c", _STATUS_SCRIPT, "pallet-remote", VERSION_REPORT])
    values = _values(output.decode(errors="replace"))
    recorded = VersionReport.parse(values.get("recorded_pallet", ""))
    found, command = (recorded, values["recorded"]) if recorded is not None \
        else (VersionReport.parse(values.get("python3_pallet", "")), "python3")
    local = (metadata.version("pallet"), STREAM_VERSION, SESSION_VERSION)
    if found is None:
        return RemoteStatus(host_name(endpoint), values.get("recorded", ""), "", "", 0, 0, 0,
                            values.get("python3", ""), *local)
    return RemoteStatus(host_name(endpoint), values.get("recorded", ""), command, found.pallet_version, found.stream,
                        found.session.low, found.session.high, values.get("python3", ""), *local)


# ---------------------------------------------------------------- command line

_EPILOG = """\
The far side needs ssh, sh, tar and a CPython that meets pallet's Requires-Python, with venv; it
needs no network: the wheels of pallet and its dependencies are gathered here and shipped. pallet's
own is this install's files packed again; an editable install's is built from its source tree (by
pip, which fetches setuptools, wheel and setuptools-rust for the build when this Python lacks them).
The others are downloaded once into $XDG_CACHE_HOME/pallet/wheels.
exit status: 0 done, 1 failure, 2 usage error, 3 transport failure. See docs/cli.md."""


def add_parser(commands) -> None:
    """Add `remote install` and `remote status` to the `pallet` sub-command set."""
    p = commands.add_parser("remote", help="install pallet on an ssh host, or show what is there",
                            description="Install pallet on an ssh host (no network needed there), or show which "
                                        "pallet a host has.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    i = actions.add_parser("install", help="install this pallet into a virtualenv on HOST",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Create a virtualenv at PREFIX on HOST with its --python, install this\n"
                                       "pallet and its dependencies there from shipped wheels (nothing there uses the\n"
                                       f"network), and record PREFIX/bin/python in {RECORD} there,\n"
                                       "where push and pull look for pallet.",
                           epilog="examples:\n  pallet remote install login.hpc\n"
                                  "  pallet remote install --python /opt/python/3.12/bin/python3 me@login.hpc:2222\n"
                                  "  pallet remote install --prefix /project/me/pallet-venv ssh://login.hpc\n\n"
                                  + _EPILOG)
    _host_options(i)
    i.add_argument("--python", default="python3", metavar="CMD",
                   help="the Python there that makes the virtualenv (default: python3)")
    i.add_argument("--prefix", default=DEFAULT_PREFIX, metavar="DIR",
                   help=f"the virtualenv there; relative to the far HOME unless absolute (default: {DEFAULT_PREFIX})")
    i.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    i.set_defaults(run=run_install)
    s = actions.add_parser("status", help="show which pallet HOST has",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=f"Show the Python recorded in {RECORD} on HOST, whether it (or\n"
                                       "python3) imports pallet, its version, stream and session protocols, and\n"
                                       "whether they match this pallet. Exit 0 when pallet is usable there (its\n"
                                       "sessions' hello would agree with this pallet's), 1 when not.",
                           epilog="example:\n  pallet remote status login.hpc --json")
    _host_options(s)
    s.set_defaults(run=run_status)


def _host_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("host", metavar="HOST", type=_host_arg, help="[user@]host[:port] or ssh://[user@]host[:port]")
    p.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                   help="extra ssh argument, repeatable (also $PALLET_SSH_OPTIONS)")
    p.add_argument("--json", action="store_true", help="print a summary as JSON")


def _host_arg(text: str) -> str:
    try:
        parse_host(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc.message} (write [user@]host[:port] or ssh://[user@]host[:port])") from None
    return text


def _ssh_options(args) -> list[str]:
    return [o for opt in args.ssh_option for o in shlex.split(opt)]


def run_install(args) -> int:
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    result = install(args.host, args.python, args.prefix, _ssh_options(args), say)
    if args.json:
        print(json.dumps(asdict(result)))
    return EXIT_OK


def run_status(args) -> int:
    found = status(args.host, _ssh_options(args))
    if args.json:
        print(json.dumps(found.to_json()))
    else:
        print("\n".join(status_lines(found)))
    if not found.usable:
        why = f" ({found.problem()})" if found.pallet_python else ""
        print(f"pallet remote: pallet is not usable on {found.host}{why}: install it there with "
              f"`pallet remote install {args.host}` (add --python CMD to choose the Python)", file=sys.stderr)
    return EXIT_OK if found.usable else EXIT_FAILURE


def status_lines(found: RemoteStatus) -> list[str]:
    """The human report of `pallet remote status`."""
    here = (f"this pallet {found.local_version} (stream v{found.local_stream_version}, session "
            f"{Versions(MIN_SESSION_VERSION, found.local_session_version)})")
    if not found.pallet_python:
        head = "no pallet: no Python there imports it"
    else:
        sessions = f"session protocol {found.sessions}" if found.session_version else "no session version reported"
        head = (f"pallet {found.pallet_version} (stream protocol v{found.stream_version}, {sessions}) via "
                f"{found.pallet_python}; " + ("the same as here" if found.matches else f"differs from {here}"))
    recorded = found.recorded or "nothing"
    if found.recorded and found.recorded != found.pallet_python:
        recorded += " (does not import pallet)"
    return [f"{found.host}: {head}", f"  recorded in {RECORD}: {recorded}",
            f"  python3 there: {found.python3 or 'missing'}"]
