"""StorageObject: one pallet URL (a file or a directory) as Snakemake reads, writes and checks it."""
from __future__ import annotations

import os
import posixpath
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import replace
from functools import cached_property

from snakemake_interface_common.exceptions import WorkflowError
from snakemake_interface_storage_plugins.io import IOCacheStorageInterface, Mtime, get_constant_prefix
from snakemake_interface_storage_plugins.storage_object import (StorageObjectGlob, StorageObjectRead,
                                                                StorageObjectWrite)

from staging_core import (Endpoint, PalletError, RemoteEntry, RemotePathMissingError, capable, declared_capabilities,
                          parse_url)

from .inventory import seconds
from .queries import local_suffix, query_for
from .transfers import Request


class StorageObject(StorageObjectRead, StorageObjectWrite, StorageObjectGlob):
    """A file or directory behind a pallet URL.

    exists/mtime/size come from the provider's inventory (one listing per
    parent directory). Snakemake's concurrent ``managed_retrieve`` calls of
    one round are gathered by the provider into one planned fetch; its
    ``managed_store`` calls likewise into one send. ``retrieve_object`` and
    ``store_object`` move this object alone, synchronously. Every failure
    reaches Snakemake as a WorkflowError naming the object and the cause.
    Free local space is checked per batch (the sum of its objects, waiting
    up to ``--wait-for-free-local-storage``), not per object.
    """

    _noted = False          # told to the provider's prefetch (prefetch.py) already

    @cached_property
    def endpoint(self) -> Endpoint:
        """Where the object lives (the query must be concrete: no wildcards left)."""
        return parse_url(self.query)

    def local_suffix(self) -> str:
        return local_suffix(self.query)

    def request(self) -> Request:
        """This object as an item of a batch."""
        return Request(self.print_query, self.endpoint, os.path.abspath(self.local_path()))

    # ------------------------------------------------------------ inventory

    async def inventory(self, cache: IOCacheStorageInterface):
        """Fill Snakemake's cache for this object and every sibling the same listing shows (no extra call)."""
        if self._overwrite_local_path is not None or self.cache_key() in cache.exists_in_storage:
            return
        entry = self._entry(trust_absence=True)
        cache.exists_in_storage[self.cache_key()] = entry is not None
        for path, sibling, mtime_ns in self.provider.inventory.siblings(self.endpoint):
            key = self.cache_key(local_suffix(query_for(replace(self.endpoint, path=path))))
            cache.exists_in_storage[key] = True
            cache.mtime[key] = Mtime(storage=seconds(mtime_ns))
            cache.size[key] = sibling.size if sibling.kind == "f" else 0

    def get_inventory_parent(self) -> str | None:
        parent = posixpath.dirname(self.endpoint.path)
        return None if parent == "/" else query_for(replace(self.endpoint, path=parent))

    def cleanup(self):
        """Nothing to do: batches remove their scratch directories when they end."""

    def exists(self) -> bool:
        return self._entry() is not None

    def mtime(self) -> float:
        entry = self._existing()
        return seconds(self.provider.inventory.mtime_ns(self.endpoint, entry))

    def size(self) -> int:
        entry = self._existing()
        return entry.size if entry.kind == "f" else 0

    def local_footprint(self) -> int:
        entry = self._existing()
        if entry.kind != "d":
            return entry.size
        return sum(e.size for e in self._call("list", self.provider.inventory.children, self.endpoint))

    def _entry(self, trust_absence: bool = False) -> RemoteEntry | None:
        """The remote entry (None: absent); a file found is noted for the prefetch (prefetch.py)."""
        entry = self._call("check", self.provider.inventory.lookup, self.endpoint, trust_absence)
        if entry is not None and not self._noted:
            self._noted = True                  # once per object: Snakemake asks about each many times
            self.provider.prefetch.note(self.request(), entry)
        return entry

    def _existing(self) -> RemoteEntry:
        entry = self._entry()
        if entry is None:
            raise WorkflowError(f"{self.print_query} does not exist")
        return entry

    def _call(self, what: str, function, *args):
        try:
            return function(*args)
        except PalletError as exc:
            raise WorkflowError(f"pallet cannot {what} {self.print_query}: {exc}") from None

    # ------------------------------------------------------------ moving data

    async def managed_retrieve(self):
        """Join this round's batch; the batch checks free space for all its objects at once. A file:// object
        Snakemake marks on-demand eligible is linked in place instead (see :meth:`_link_in_place`)."""
        if self._links_in_place():
            self._link_in_place()
            return
        nbytes = await self.managed_local_footprint() if self.provider.limits.max_bytes else 0
        await self.provider.retrievals.submit(self.request(), nbytes)

    async def managed_store(self):
        local = self.local_path()
        nbytes = os.path.getsize(local) if self.provider.limits.max_bytes and os.path.isfile(local) else 0
        await self.provider.stores.submit(self.request(), nbytes)

    def retrieve_object(self):
        if self._links_in_place():
            self._link_in_place()
            return
        self.provider.run_now("retrieve", self.request())

    def _links_in_place(self) -> bool:
        return (self.is_ondemand_eligible and self.provider.links_on_demand
                and capable(declared_capabilities(self.endpoint.scheme), frozenset({"local_copy"})))

    def _link_in_place(self) -> None:
        """Make the local copy a symlink to the file:// source: Snakemake marks an input on-demand eligible when
        one job reads it once, sequentially, so a copy would only cost a create and a write. The link replaces
        whatever the local path held (an older copy, an older link) in one rename; no existing name is ever
        written through. Snakemake removes the link, never the source, when the job no longer needs it."""
        source, local = self.endpoint.path, os.path.abspath(self.local_path())
        if not os.path.exists(source):
            raise WorkflowError(f"{self.print_query} does not exist")
        fresh = f"{local}.pallet-link-{uuid.uuid4().hex[:12]}"
        try:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            if os.path.isdir(local) and not os.path.islink(local):
                shutil.rmtree(local)                     # an earlier copy of a directory object: ours to replace
            os.symlink(source, fresh)
            os.replace(fresh, local)
        except OSError as exc:
            if os.path.islink(fresh):
                os.unlink(fresh)
            raise WorkflowError(f"pallet cannot link {self.print_query} in place at {local}: {exc.strerror}; "
                                "pass --storage-pallet-no-ondemand-links to copy it instead") from None

    def store_object(self):
        self.provider.run_now("store", self.request())

    def remove(self):
        self._call("remove", self.provider.remove, self.endpoint)

    def list_candidate_matches(self) -> Iterable[str]:
        """Queries of the files below the query's constant directory prefix (for ``glob_wildcards``): one
        recursive listing; none if that directory does not exist."""
        prefix = get_constant_prefix(self.query, strip_incomplete_parts=True)
        if not prefix.endswith("/"):
            return [self.query] if self.exists() else []
        try:
            entries = self.provider.inventory.children(parse_url(prefix))
        except RemotePathMissingError:
            return []
        except PalletError as exc:
            raise WorkflowError(f"pallet cannot list {prefix}: {exc}") from None
        return [prefix + e.path for e in entries if e.kind == "f"]
