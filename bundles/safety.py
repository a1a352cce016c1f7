"""Safety rules for extraction: which member names, types, links and modes may be written."""
from __future__ import annotations

import os

from .index import Index
from .reserved import reserved_problem
from .tarformat import Kind

STRIPPED_MODE_BITS = 0o6000        # setuid and setgid are never restored


def safe_mode(mode: int) -> int:
    """Permission bits to apply on extraction: the stored ones without setuid/setgid."""
    return mode & 0o7777 & ~STRIPPED_MODE_BITS


def path_problem(path: bytes) -> str | None:
    """Why a member path is unsafe as a name under the destination, or None if it is fine."""
    if not path:
        return "empty name"
    if path.startswith(b"/"):
        return "absolute path"
    if b"\0" in path:
        return "NUL byte in name"
    parts = path.split(b"/")
    if b".." in parts:
        return "'..' component"
    if any(p in (b"", b".") for p in parts):
        return "empty or '.' component"
    return reserved_problem(path)


def symlink_problem(path: bytes, target: bytes, symlinks: set[bytes]) -> str | None:
    """Why symlink ``path`` -> ``target`` is unsafe, or None if it resolves inside the destination.

    The target is resolved lexically from the link's directory; it must not
    be absolute, climb above the root, or climb with '..' after passing
    through another symlink of the archive (whose real location may differ).
    """
    if not target:
        return "empty symlink target"
    if target.startswith(b"/"):
        return f"symlink to absolute path {os.fsdecode(target)!r}"
    stack = path.split(b"/")[:-1]
    through_link = False
    for part in target.split(b"/"):
        if part == b"..":
            if not stack or through_link:
                return f"symlink to {os.fsdecode(target)!r} points outside the destination"
            stack.pop()
        elif part not in (b"", b"."):
            stack.append(part)
            through_link = through_link or b"/".join(stack) in symlinks
    return None


def index_problems(index: Index) -> list[tuple[str, str]]:
    """Return (name, reason) for every entry of ``index`` that must not be extracted."""
    problems: list[tuple[str, str]] = []
    directories: set[bytes] = set()
    symlinks = {index.paths[i] for i, k in enumerate(index.kinds) if k == Kind.SYMLINK}
    seen: set[bytes] = set()
    refused: set[int] = set()
    known_kinds = frozenset(int(k) for k in Kind)
    for i, path in enumerate(index.paths):
        kind = index.kinds[i]
        reason = _name_problem(path, seen, directories, symlinks)
        if reason is None and kind != Kind.FILE:
            reason = _kind_problem(index, i, kind, symlinks, refused, known_kinds)
        if reason:
            problems.append((os.fsdecode(path), reason))
            refused.add(i)
        seen.add(path)
        if kind == Kind.DIR:
            directories.add(path)
    return problems


def _name_problem(path: bytes, seen: set, directories: set, symlinks: set) -> str | None:
    """Name checks, with a fast path for the common clean relative name."""
    padded = b"/" + path + b"/"
    if not path or path[0] == 47 or b"\0" in path or b"/../" in padded or b"/./" in padded or b"//" in padded \
            or b"/.pallet" in padded:
        return path_problem(path)
    if path in seen:
        return "duplicate name"
    parent = path.rpartition(b"/")[0]
    if parent and parent not in directories:
        return ("written through a symlink" if _under(parent, symlinks)
                else "parent directory is not a directory of the archive")
    return None


def _kind_problem(index: Index, i: int, kind: int, symlinks: set, refused: set, known_kinds) -> str | None:
    if kind == Kind.SYMLINK:
        return symlink_problem(index.paths[i], index.links[i], symlinks)
    if kind == Kind.HARDLINK:
        return _hardlink_problem(index, i, refused)
    if kind not in known_kinds:
        return f"unsupported entry type {kind}"
    return None


def _under(path: bytes, prefixes: set[bytes]) -> bool:
    parts = path.split(b"/")
    return any(b"/".join(parts[:n]) in prefixes for n in range(1, len(parts) + 1))


def _hardlink_problem(index: Index, i: int, refused: set[int]) -> str | None:
    leader, target = index.link_groups[i], os.fsdecode(index.links[i])
    if not 0 <= leader < i or index.kinds[leader] != Kind.FILE or index.paths[leader] != index.links[i]:
        return f"hard link to {target!r}, which is not a regular file earlier in the archive"
    if leader in refused:
        return f"hard link to {target!r}, which is refused itself"
    return None
