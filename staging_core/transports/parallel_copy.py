"""The local transport's parallel copy: regular files copied by the native engine's threads."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from bundles import native

from .base import TransferResult
from .errors import classify

_FILE, _DIR, _OTHER, _LINKED = 0, 1, 2, 3


@dataclass
class CopyPlan:
    """The items of one transfer by how they are copied: ``one_by_one`` in order first (directories,
    symlinks, and whatever could not be classified), then ``files`` in parallel, then ``followers``: the
    later names of a file with several hard links, linked to the first name's copy ``(item, first item)``."""

    one_by_one: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    followers: list[tuple[str, str]] = field(default_factory=list)


def plan(engine, source: str, items, threads: int) -> CopyPlan:
    """Classify ``items`` under ``source`` with one lstat each, on ``threads`` native threads."""
    names = [os.fsencode(item) for item in items]
    kinds = engine.kinds_of(os.fsencode(source) + b"/", len(names), native.blob(names), threads)
    copy_plan = CopyPlan()
    first_names: dict[tuple[int, int] | str, str] = {}
    for item, kind in zip(items, kinds, strict=False):     # the engine gives one kind per item
        if kind == _FILE:
            copy_plan.files.append(item)
        elif kind == _LINKED:
            inode = _inode(os.path.join(source, item))
            if inode in first_names:
                copy_plan.followers.append((item, first_names[inode]))
            else:
                first_names[inode] = item
                copy_plan.files.append(item)
        else:
            copy_plan.one_by_one.append(item)
    return copy_plan


def _inode(path: str) -> tuple[int, int] | str:
    try:
        st = os.lstat(path)
    except OSError:
        return path                 # unique: copied on its own, and a failure is reported by the copy
    return st.st_dev, st.st_ino


def copy(engine, source: str, tree, copy_plan: CopyPlan, result: TransferResult, threads: int) -> None:
    """Copy ``copy_plan.files`` from ``source`` into ``tree`` (a bundles.safe_tree.SafeTree: parent directories
    are made or checked there without following a link) on ``threads`` native threads and record each in
    ``result``, a failure with the path it concerns."""
    target = tree.root
    unplaced = {}
    for parent in sorted({item.rpartition("/")[0] for item in copy_plan.files}):
        try:
            tree.directory(parent)
        except OSError as exc:
            unplaced[parent] = exc          # the files meant for it fail, each with its path
    if unplaced:
        copy_plan = _without_unplaced(copy_plan, unplaced, result, target)
    names = [os.fsencode(item) for item in copy_plan.files]
    _, failures = engine.copy_files(os.fsencode(source) + b"/", os.fsencode(target) + b"/", len(names),
                                    native.blob(names), threads)
    failed = {}
    for entry, number, on_target in failures:
        item = copy_plan.files[entry]
        path = os.path.join(target if on_target else source, item)
        failed[entry] = item
        result.failed[item] = classify(os.strerror(number), number, None, path, "copy failed")
    result.done.extend(item for n, item in enumerate(copy_plan.files) if n not in failed)
    for item, first in copy_plan.followers:
        if first in result.failed:
            result.failed[item] = result.failed[first]
            continue
        try:
            tree.link(first, item)
            result.done.append(item)
        except OSError as exc:
            result.failed[item] = classify(exc.strerror or "", exc.errno, None, os.path.join(target, item),
                                           "hard link failed")


def _without_unplaced(copy_plan: CopyPlan, unplaced: dict[str, OSError], result: TransferResult,
                      target: str) -> CopyPlan:
    """``copy_plan`` without the files whose parent directory could not be made; each is recorded failed."""
    kept = []
    for item in copy_plan.files:
        exc = unplaced.get(item.rpartition("/")[0])
        if exc is None:
            kept.append(item)
        else:
            result.failed[item] = classify(exc.strerror or "", exc.errno, None,
                                           os.fsdecode(exc.filename or os.path.join(target, item)), "copy failed")
    return CopyPlan(copy_plan.one_by_one, kept, copy_plan.followers)
