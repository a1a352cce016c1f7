"""The GridFTP transport: globus-url-copy with one -f list file per batch, for gsiftp:// (GSI) and ftp:// URLs."""
from __future__ import annotations

import builtins
import itertools
import os
import posixpath
import re
import shlex
import stat
import subprocess
from collections.abc import Sequence
from urllib.parse import quote, unquote, urlsplit

from ..scratch import scratch
from .base import Capabilities, Direction, Endpoint, RemoteEntry, Transport, TransferResult, name_crosses
from .declarations import GRIDFTP_OPTIONS
from .errors import (AuthenticationError, HostUnreachableError, MissingDependencyError, NotSupportedError,
                     ItemError, RemotePathMissingError, TransportError, classify)

PROGRAM = "globus-url-copy"
URL_MAX = 511            # globus-url-copy 10.x reads each -f URL into a char[512] (and a line into char[1024])
_BLOCK = re.compile(r"^(?:continuing on error|error): ", re.M)
_SUMMARY = re.compile(r"There (?:were errors with \d+ transfers|was an error with 1 transfer)")
_EMPTY = "No files matched the source url"
_MKD_FAULT = re.compile(r"^(?:5\d\d-GridFTP-Error-String: (?!File exists)|debug: fault on connection to )(.*)$", re.M)
_HINTS: dict[type, str] = {HostUnreachableError: "check the host and port (gsiftp:// defaults to 2811, ftp:// to 21)",
          AuthenticationError: "check the GSI credential (X509_USER_PROXY; renew the proxy), X509_CERT_DIR "
                               "and the server's subject (options=['-s', SUBJECT])"}
_REPLY_CODE = re.compile(r"^(?:\d{3}[- ])+", re.M)    # FTP reply codes: 550 says little, the text says why
_NAMED = re.compile(r"Unable to (?:open file|list url) (.+?):?\s*$", re.M)


class GridFTPTransport(Transport):
    """globus-url-copy to a GridFTP server: ``gsiftp://host[:port]/path`` with the GSI credentials of the
    environment (X509_USER_PROXY or X509_USER_CERT/KEY, X509_CERT_DIR), ``ftp://host[:port]/path`` anonymous.

    ``concurrency`` is -cc (default: capabilities.concurrency), ``parallel`` -p streams per file,
    ``pipeline`` -pp, ``fast`` -fast (MODE E, data channel reuse; GridFTP servers only), ``restart``
    -rst, ``verify_checksum`` -verify-checksum with ``checksum_alg``; ``options`` (and
    $PALLET_GRIDFTP_OPTIONS) are extra arguments such as ``-s SUBJECT`` or ``-cred FILE``.
    """

    scheme = "gsiftp"
    capabilities = Capabilities(batch=True, streaming=False, remote_exec=False, parallel_streams=True,
                                checksums=("md5",), preserves_mtime=False, preserves_mode=False, symlinks=False,
                                hardlinks=False, per_file_overhead_s=6e-4, concurrency=4, names="any")
    declared_options = GRIDFTP_OPTIONS

    def __init__(self, endpoint: Endpoint, concurrency: int | None = None, parallel: int = 1,
                 pipeline: bool = True, fast: bool = True, restart: bool = False, verify_checksum: bool = False,
                 checksum_alg: str = "MD5", options: Sequence[str] = ()):
        super().__init__(endpoint)
        self.scheme = endpoint.scheme
        self.concurrency = max(1, concurrency or self.capabilities.concurrency)
        self.parallel = max(1, parallel)
        self.pipeline, self.fast, self.restart = pipeline, fast, restart
        self.verify_checksum, self.checksum_alg = verify_checksum, checksum_alg
        self.options = [*options, *shlex.split(os.environ.get("PALLET_GRIDFTP_OPTIONS", ""))]
        names = "printable-ascii" if endpoint.scheme == "ftp" else self.capabilities.names
        self.capabilities = Capabilities(**{**self.capabilities.__dict__, "concurrency": self.concurrency,
                                            "names": names})

    def url(self, path: str, directory: bool = False) -> str:
        """The percent-encoded URL of a remote absolute path (directories end with '/')."""
        user = f"{self.endpoint.user}@" if self.endpoint.user else ""
        port = f":{self.endpoint.port}" if self.endpoint.port else ""
        return f"{self.scheme}://{user}{self.endpoint.host}{port}{_quote(path, directory)}"

    def _refusal(self, item: str, path: str) -> TransportError | None:
        """Why ``item`` cannot cross: FTP commands are lines, and clear-text FTP keeps printable ASCII only."""
        if name_crosses(path, self.capabilities.names):
            return None
        what = "names of printable ASCII only" if self.capabilities.names == "printable-ascii" else "no line breaks"
        return NotSupportedError(f"{self.scheme}:// carries {what} (the server drops other bytes)", item,
                                 "rename the file, or bundle the tree (pallet pack) and move the bundle")

    # ------------------------------------------------------------ running globus-url-copy

    def _options(self) -> list[str]:
        argv = ["-c", "-cd", "-r", "-cc", str(self.concurrency), "-p", str(self.parallel)]
        argv += ["-pp"] * self.pipeline + ["-fast"] * self.fast + ["-rst"] * self.restart
        if self.verify_checksum:
            argv += ["-verify-checksum", "-checksum-alg", self.checksum_alg]
        return argv + self.options

    def _run(self, argv: list[str]) -> tuple[int, str]:
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True)
        except FileNotFoundError:
            raise MissingDependencyError(f"the {self.scheme} transport needs {PROGRAM}", self.endpoint.url(),
                                         "apt-get install globus-gass-copy-progs") from None
        return done.returncode, done.stderr.decode(errors="replace")

    def _dump(self, urls: list[str], recursive: bool, work: str,
              sentinel: str | None = None) -> tuple[list[tuple[int, str, bool, dict]], dict]:
        """List directory ``urls`` with ``-do``: entries (index, path, is_dir, facts) and error texts by index.
        A -do run stops if its first URL fails (-c holds only after that): the rest run again, behind
        ``sentinel`` (a URL known to list) when given."""
        entries: list = []
        errors: dict[int, str] = {}
        for chunk in _chunks(urls):
            while chunk:
                lead = [(-1, sentinel)] if sentinel and len(chunk) > 1 and sentinel != chunk[0][1] else []
                found, failed, stopped = self._dump_run(lead + chunk, recursive, work)
                entries += [entry for entry in found if entry[0] >= 0]
                errors.update(failed)
                if stopped == -1:
                    sentinel = None
                    continue
                chunk = chunk[[n for n, _ in chunk].index(stopped) + 1:] if stopped is not None else []
        errors.pop(-1, None)
        return entries, errors

    def _dump_run(self, chunk: list[tuple[int, str]], recursive: bool, work: str):
        nowhere = f"file://{_quote(work)}/never-written"
        dump = os.path.join(work, "dump")
        argv = _with_urls([PROGRAM, "-c", *(["-r"] * recursive), *self.options, "-do", dump],
                          [(url, f"{nowhere}/{n}/") for n, url in chunk], work)
        code, stderr = self._run(argv)
        found = _parse_dump(dump, nowhere)
        if os.path.exists(dump):
            os.unlink(dump)
        errors, stopped = self._dump_errors(chunk, code, stderr, argv)
        return found, errors, stopped

    def _dump_errors(self, chunk, code: int, stderr: str, argv: list[str]) -> tuple[dict[int, str], int | None]:
        """Error text by URL index, and the index the run stopped at, if it did."""
        if code == 0:
            return {}, None
        named = {_path_of(url): n for n, url in chunk}
        errors, stopped = {}, None
        for block in _blocks(stderr):
            if _EMPTY in block:
                continue                      # an empty directory: nothing to list
            match = _NAMED.search(block)
            index = named.get(_path_of(match[1])) if match else (chunk[0][0] if len(chunk) == 1 else None)
            if index is None:
                raise _classify(stderr, code, argv, self.endpoint.url(), f"{PROGRAM} -do failed")
            errors[index] = block
            stopped = index if block.startswith("error:") and len(chunk) > 1 else stopped
            if isinstance(_classify(block, code, argv, None, ""), (HostUnreachableError, AuthenticationError)):
                raise _classify(block, code, argv, self.endpoint.url(), f"cannot list on {self.endpoint.host}")
        if not errors and _EMPTY not in stderr:
            raise _classify(stderr, code, argv, self.endpoint.url(), f"{PROGRAM} -do failed with status {code}")
        return errors, stopped

    def list(self, path: str) -> list[RemoteEntry]:
        root = posixpath.normpath(path)
        with scratch("pallet-gridftp-") as work:
            entries, errors = self._dump([self.url(root, True)], True, work)
        if errors:
            raise _classify(errors[0], 1, None, self.url(root, True), f"cannot list {root}")
        return [_entry(posixpath.relpath(p, root), is_dir, facts) for _, p, is_dir, facts in entries]

    def stat(self, path: str) -> RemoteEntry | None:
        path = posixpath.normpath(path)
        with scratch("pallet-gridftp-") as work:
            entries, errors = self._dump([self.url(posixpath.dirname(path), True), self.url(path, True)], False, work)
        for index, listed, is_dir, facts in entries:
            if index == 0 and listed == path:
                return _entry("", is_dir, facts)
        if 0 in errors:
            errors[1] = errors[0]             # no parent, no path (and the run stopped there)
        if 1 not in errors:
            self_listing = posixpath.join(path, posixpath.basename(path))
            if not any(index == 1 and listed == self_listing for index, listed, _, _ in entries):
                return RemoteEntry("", "d", 0, 0, 0)
            return None
        error = _classify(errors[1], 1, None, self.url(path), f"cannot stat {path}")
        if isinstance(error, RemotePathMissingError):
            return None
        raise error

    def mkdir(self, path: str) -> None:
        """Copy an empty directory of that name with -r -cd; globus-url-copy ignores failed MKDs, so look."""
        path = posixpath.normpath(path)
        if path == "/":
            return
        with scratch("pallet-gridftp-") as work:
            argv = [PROGRAM, *self._options(), "-dbg", _stage_dir(work, 0, path),
                    self.url(posixpath.dirname(path), True)]
            code, stderr = self._run(argv)
            if self._directories([posixpath.basename(path)], posixpath.dirname(path), work):
                return
        faults = "\n".join(_MKD_FAULT.findall(stderr)) or "No such file or directory"
        raise _classify(faults, code, argv, self.url(path, True), f"cannot create directory {path}")

    # ------------------------------------------------------------ transfers

    def transfer(self, direction: Direction, local_root: str, remote_root: str,
                 items: Sequence[str] | None = None, temp_dir: str | None = None) -> TransferResult:
        """One globus-url-copy run for the batch; ``items=None`` is the whole tree, its symlinks skipped."""
        whole = items is None
        items = self.all_items(direction, local_root, remote_root) if items is None else list(items)
        if whole and direction is Direction.PUSH:
            items = [i for i in items if not os.path.islink(os.path.join(local_root, i))]
        with scratch("pallet-gridftp-") as work:
            plan = self._plan_push if direction is Direction.PUSH else self._plan_pull
            result, pairs = plan(local_root, remote_root, items, work)
            if pairs:
                self._run_pairs(direction, local_root, remote_root, pairs, result, work)
            if direction is Direction.PUSH:
                self._check_directories(pairs, remote_root, result, work)
        result.done.sort(key={item: n for n, item in enumerate(items)}.__getitem__)
        return result

    def _plan_push(self, local_root, remote_root, items, work):
        result, pairs = TransferResult(), {}
        for n, item in enumerate(items):
            local, remote = os.path.join(local_root, item), posixpath.join(remote_root, item)
            refusal: ItemError | None = self._refusal(item, remote)
            try:
                mode = os.lstat(local).st_mode
            except OSError as exc:
                refusal = refusal or _classify(exc.strerror or "", exc.errno, None, local, f"cannot read {item}")
            if refusal is None and stat.S_ISLNK(mode):
                refusal = NotSupportedError("GridFTP cannot create symbolic links", item,
                                            "bundle the tree (pallet pack) to keep links")
            if refusal is not None:
                result.failed[item] = refusal
            elif stat.S_ISDIR(mode):
                pairs[item] = (_stage_dir(work, n, remote), self.url(posixpath.dirname(remote), True))
            else:
                pairs[item] = (_file_url(local), self.url(remote))
        return result, pairs

    def _check_directories(self, pairs: dict, remote_root: str, result: TransferResult, work: str) -> None:
        """globus-url-copy ignores failed MKDs: list the directory items that no stored file vouches for."""
        done = set(result.done)
        vouched = {"/".join(item.split("/")[:n]) for item in done if not pairs[item][0].endswith("/")
                   for n in range(1, item.count("/") + 1)}
        unsure = [item for item, (source, _) in pairs.items() if source.endswith("/") and item not in vouched
                  and item in done]
        missing = set(unsure) - set(self._directories(unsure, remote_root, work)) if unsure else set()
        for item in missing:
            result.done.remove(item)
            result.failed[item] = RemotePathMissingError("directory was not created", posixpath.join(
                remote_root, item), "check that its parent exists and is writable")

    def _plan_pull(self, local_root, remote_root, items, work):
        result, pairs, leaves = TransferResult(), {}, []
        parents = {posixpath.dirname(item) for item in items}
        for item in items:
            refusal = self._refusal(item, posixpath.join(remote_root, item))
            if refusal is not None:
                result.failed[item] = refusal
            elif item in parents:
                _make_local_dir(os.path.join(local_root, item), item, result)
            else:
                leaves.append(item)
        kinds = self._kinds(remote_root, leaves, work)
        for item in leaves:
            remote, local = posixpath.join(remote_root, item), os.path.join(local_root, item)
            if kinds.get(item) == "f":
                pairs[item] = (self.url(remote), _file_url(local))
            elif kinds.get(item) == "d":
                _make_local_dir(local, item, result)
            else:
                result.failed[item] = RemotePathMissingError("path does not exist", remote, "check the remote path")
        return result, pairs

    # builtins.list: in this class, ``list`` is a method
    def _kinds(self, remote_root: str, leaves: builtins.list[str], work: str) -> dict[str, str]:
        """'f' or 'd' for each leaf item that exists (a RETR of a directory breaks its neighbours' copies):
        one listing of their parent directories finds the files, a second probes the rest as directories."""
        if not leaves:
            return {}
        root = posixpath.normpath(remote_root)
        parents = sorted({posixpath.dirname(item) for item in leaves})
        urls = [self.url(posixpath.join(root, p), True) for p in parents]
        entries, errors = self._dump(urls, False, work)
        files = {path for _, path, is_dir, _ in entries if not is_dir}
        kinds = {item: "f" for item in leaves if posixpath.join(root, item) in files}
        listed = [url for n, url in enumerate(urls) if n not in errors]
        rest = [item for item in leaves if item not in kinds and posixpath.dirname(item) not in
                {parents[n] for n in errors}]
        if rest:
            kinds.update((item, "d") for item in self._directories(rest, root, work, listed[0]))
        return kinds

    def _directories(self, candidates: builtins.list[str], remote_root: str, work: str,
                     sentinel: str | None = None) -> builtins.list[str]:
        """The candidates that are directories (listing a file shows the file itself)."""
        urls = [self.url(posixpath.join(remote_root, item), True) for item in candidates]
        entries, errors = self._dump(urls, False, work, sentinel)
        selves = {index for index, path, _, _ in entries
                  if path == posixpath.join(remote_root, candidates[index], posixpath.basename(candidates[index]))}
        return [item for n, item in enumerate(candidates) if n not in errors and n not in selves]

    def _run_pairs(self, direction, local_root, remote_root, pairs: dict, result: TransferResult, work) -> None:
        fits = {i: p for i, p in pairs.items() if len(p[0]) <= URL_MAX and len(p[1]) <= URL_MAX}
        batches = [fits] * bool(fits) + [{i: p} for i, p in pairs.items() if i not in fits]
        for batch in batches:
            argv = _with_urls([PROGRAM, *self._options()], list(batch.values()), work)
            code, stderr = self._run(argv)
            failed = self._attribute(batch, code, stderr, argv, local_root, remote_root)
            for item in failed if direction is Direction.PULL else ():
                path = os.path.join(local_root, item)          # globus-url-copy leaves a partial file
                if os.path.isfile(path) and not os.path.islink(path):
                    os.unlink(path)
            result.failed.update(failed)
            result.done += [item for item in batch if item not in failed]

    def _attribute(self, batch: dict, code: int, stderr: str, argv, local_root, remote_root) -> dict:
        """Per-item errors from the messages, which name the failing path; raise for the batch when one
        names no item, or says the host or the login failed."""
        if code == 0:
            return {}
        names = {os.path.join(root, item): item for item in batch for root in (local_root, remote_root)}
        failed = {}
        for block in _blocks(stderr) or [stderr]:
            match = _NAMED.search(block)
            item = names.get(_path_of(match[1])) if match else None
            item = item or (next(iter(batch)) if len(batch) == 1 else None)
            error = _classify(block, code, argv, item or self.endpoint.url(), f"cannot transfer {item}")
            if item is None or isinstance(error, (HostUnreachableError, AuthenticationError)):
                raise _classify(stderr, code, argv, self.endpoint.url(), f"{PROGRAM} failed with status {code}")
            failed[item] = error
        return failed


def _classify(text: str, *args) -> ItemError:
    """errors.classify on globus-url-copy's text without the FTP reply codes, with GridFTP hints."""
    error = classify(_REPLY_CODE.sub("", text), *args)
    error.hint = _HINTS.get(type(error), error.hint)
    return error


def _with_urls(argv: list[str], pairs: list[tuple[str, str]], work: str) -> list[str]:
    """``argv`` with one (source, destination) pair as arguments, or several in an -f list file."""
    if len(pairs) == 1:
        return [*argv, *pairs[0]]
    listing = os.path.join(work, "urls")
    with open(listing, "w", encoding="ascii") as handle:
        handle.writelines(f'"{src}" "{dst}"\n' for src, dst in pairs)
    return [*argv, "-f", listing]


def _quote(path: str, directory: bool = False) -> str:
    text = quote(os.fsencode(path), safe="/")
    return text + "/" if directory and not text.endswith("/") else text


def _file_url(path: str, directory: bool = False) -> str:
    return "file://" + _quote(os.path.abspath(path), directory)


def _path_of(text: str) -> str:
    """The decoded, normalised path of a URL or path printed by globus-url-copy."""
    text = text.strip()
    path = urlsplit(text).path if "://" in text else text
    return posixpath.normpath(unquote(path)) if path else ""


def _stage_dir(work: str, n: int, remote: str) -> str:
    """A local directory holding one empty directory named like ``remote``: copied with -r, it creates it."""
    holder = os.path.join(work, "mkdir", str(n))
    os.makedirs(os.path.join(holder, posixpath.basename(remote)))
    return _file_url(holder, True)


def _make_local_dir(local: str, item: str, result: TransferResult) -> None:
    try:
        os.makedirs(local, exist_ok=True)
        result.done.append(item)
    except OSError as exc:
        result.failed[item] = _classify(exc.strerror or "", exc.errno, None, local, "cannot create directory")


def _chunks(urls: list[str]) -> list[list[tuple[int, str]]]:
    """Group numbered URLs for one -f run; URLs too long for a list file run alone on the command line."""
    numbered = list(enumerate(urls))
    short = [pair for pair in numbered if len(pair[1]) <= URL_MAX]
    return [short] * bool(short) + [[pair] for pair in numbered if len(pair[1]) > URL_MAX]


def _blocks(stderr: str) -> list[str]:
    """The error messages of one run, one per failed transfer, without the closing summary."""
    starts = [m.start() for m in _BLOCK.finditer(stderr)] + [len(stderr)]
    blocks = [stderr[a:b].strip() for a, b in itertools.pairwise(starts)]
    return [b for b in blocks if not _SUMMARY.search(b.splitlines()[0])]


def _parse_dump(dump: str, nowhere: str) -> list[tuple[int, str, bool, dict]]:
    """Read a -do dump: lines '[#]"SRC" "DST" OFFSET,LENGTH facts;' ('#' marks directories)."""
    if not os.path.exists(dump):
        return []
    marker = f'" "{nowhere}/'
    entries = []
    with open(dump, encoding="utf-8", errors="surrogateescape") as handle:
        for line in handle:
            source, found, tail = line.rstrip("\n").partition(marker)
            if not found:
                continue
            index, _, rest = tail.partition("/")
            facts = dict(f.split("=", 1) for f in rest.rsplit('" ', 1)[-1].partition(" ")[2].split(";") if "=" in f)
            entries.append((int(index), _path_of(source.lstrip("#").lstrip('"')), source.startswith("#"), facts))
    return entries


def _entry(rel: str, is_dir: bool, facts: dict) -> RemoteEntry:
    return RemoteEntry("" if rel == "." else rel, "d" if is_dir else "f", 0 if is_dir else int(facts.get("size", 0)),
                       int(facts.get("mode", "0"), 8), int(facts.get("modify", 0)) * 1_000_000_000)
