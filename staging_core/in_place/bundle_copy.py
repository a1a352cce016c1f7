"""Copy selected files out of a local bundle by its index, without unpacking it: what a job reads of a kept bundle."""
from __future__ import annotations

import os
from dataclasses import dataclass
from collections.abc import Iterable

from bundles.errors import DestinationError, SourceError
from bundles.tarformat import Kind
from bundles.view import BundleView, Node

CHUNK = 1 << 20          # bytes per read: memory stays bounded by this and the view's shard cache


@dataclass(frozen=True)
class CopiedOut:
    """What :func:`copy_out` wrote: files, their bytes, symlinks and directories made."""

    files: int = 0
    bytes: int = 0
    links: int = 0
    directories: int = 0


def missing_members(bundle: str, items: Iterable[str]) -> list[str]:
    """The ``items`` (paths relative to the bundle's root) that the bundle at ``bundle`` does not show."""
    with BundleView.open(bundle) as view:
        return [item for item in items if view.lookup(item) is None]


def open_bundle(bundle: str) -> BundleView:
    """A local bundle opened for :func:`copy_out` calls (close it when done): opening reads and checks the whole
    index, so many copies out of one bundle share one."""
    return BundleView.open(bundle)


def copy_out(bundle: str | BundleView, item: str, target: str) -> CopiedOut:
    """Copy the entry ``item`` of the local bundle ``bundle`` (a path, or a view from :func:`open_bundle`,
    left open) to the new path ``target``.

    A file is copied with its mode and mtime, a symlink made as stored, a
    directory copied with everything below it. Every byte comes from a
    shard whose hash was checked first (CorruptBundleError names the shard
    otherwise). ``target`` must not exist and its parent must: nothing is
    ever written through an existing name (O_EXCL, no link followed), so
    the parent should be a directory only the caller writes into. Raises
    SourceError when the bundle does not hold ``item`` and DestinationError
    when ``target`` exists; a partial copy is left for the caller to remove.
    """
    if isinstance(bundle, BundleView):
        return _copy_entry(bundle, item, target)
    with BundleView.open(bundle) as view:
        return _copy_entry(view, item, target)


def _copy_entry(view: BundleView, item: str, target: str) -> CopiedOut:
    node = view.lookup(item)
    if node is None:
        raise SourceError(f"the bundle holds no {item!r}", view.name, "check the path relative to the bundle root")
    return _copy(view, item, node, target, CopiedOut())


def _copy(view: BundleView, item: str, node: Node, target: str, done: CopiedOut) -> CopiedOut:
    if node.kind == Kind.SYMLINK:
        _refuse_existing(target)
        os.symlink(node.link, target)
        os.utime(target, ns=(node.mtime_ns, node.mtime_ns), follow_symlinks=False)
        return CopiedOut(done.files, done.bytes, done.links + 1, done.directories)
    if node.kind == Kind.DIR:
        _refuse_existing(target)
        os.mkdir(target, 0o700)
        done = CopiedOut(done.files, done.bytes, done.links, done.directories + 1)
        for name in view.listdir(item):
            child = f"{item.rstrip('/')}/{name}" if item.strip("/") else name
            child_node = view.lookup(child)
            assert child_node is not None           # a name listdir() just gave
            done = _copy(view, child, child_node, os.path.join(target, name), done)
        os.chmod(target, node.mode, follow_symlinks=False)
        os.utime(target, ns=(node.mtime_ns, node.mtime_ns), follow_symlinks=False)
        return done
    return CopiedOut(done.files + 1, done.bytes + _copy_file(view, node, target), done.links, done.directories)


def _copy_file(view: BundleView, node: Node, target: str) -> int:
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise DestinationError("already exists: a copy out of a bundle never writes through an existing name",
                               target, "remove it, or copy into a new directory") from None
    with os.fdopen(fd, "wb") as handle:
        for offset in range(0, node.size, CHUNK):
            handle.write(view.read(node, offset, CHUNK))
        os.fchmod(handle.fileno(), node.mode)
        handle.flush()
        os.utime(handle.fileno(), ns=(node.mtime_ns, node.mtime_ns))
    return node.size


def _refuse_existing(target: str) -> None:
    if os.path.lexists(target):
        raise DestinationError("already exists: a copy out of a bundle never writes through an existing name",
                               target, "remove it, or copy into a new directory")
