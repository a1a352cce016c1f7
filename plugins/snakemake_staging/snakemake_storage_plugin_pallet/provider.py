"""StorageProvider: settings, the shared inventory, and the batchers that turn a round of objects into one operation."""
from __future__ import annotations

import os
import weakref
from typing import Any, cast

from snakemake_interface_common.exceptions import WorkflowError
from snakemake_interface_storage_plugins.storage_provider import (ExampleQuery, Operation, QueryType,
                                                                  StorageProviderBase, StorageQueryValidationResult)

from staging_core import Endpoint, HostSessions, UsageError, parse_url

from .batching import Batcher, Limits
from .inventory import RemoteInventory, host_key
from .kept import KeptBundles
from .prefetch import Prefetch
from .queries import EXAMPLES, validate
from .settings import PluginSettings, StorageProviderSettings, check, staging_options
from .storage_object import StorageObject
from .transfers import BatchFailed, Request, Stager, remove_local

PACKED = ".pallet-packed"       # default home of kept bundles, below the local storage prefix


class StorageProvider(StorageProviderBase):
    """The `pallet` storage provider (one per tag; Snakemake makes it and passes the settings).

    It owns the inventory of remote listings shared by all its objects,
    and two batchers: the ``managed_retrieve`` calls of one scheduler
    round become one ``fetch`` per location, the ``managed_store`` calls
    one ``send``, each run in a worker thread. With keep-packed, a
    retrieval copies objects out of kept bundles instead (see kept.py).
    It owns the run's host sessions (one warm ssh connection and far side
    per host, for every query, fetch and store), and the prefetch: the
    first retrieval from a location also brings the inputs the workflow
    named there (prefetch.py). Sessions and transports are closed when the
    provider is collected or the process exits.
    """

    def __post_init__(self):
        settings = cast(PluginSettings, self.settings or StorageProviderSettings())
        check(settings)
        options = staging_options(settings)
        self.sessions = HostSessions(settings.session_idle)
        self.inventory = RemoteInventory(options, self.sessions)
        self.prefetch = Prefetch(settings.prefetch_budget)
        store = os.path.expanduser(os.path.expandvars(settings.packed_dir or os.path.join(self.local_prefix, PACKED)))
        if settings.keep_packed and "$" in store:
            raise WorkflowError(f"--storage-pallet-packed-dir {store}: a variable in it is not set here")
        kept = KeptBundles(os.path.abspath(store), options) if settings.keep_packed else None
        self.stager = Stager(self.inventory, options, os.path.abspath(self.local_prefix), self.logger,
                             self.wait_for_free_local_storage, kept, self.sessions, self.prefetch.extend)
        self.limits = Limits(settings.batch_window, settings.batch_max_files, settings.batch_max_bytes)
        self.links_on_demand = not settings.no_ondemand_links
        self.retrievals: Batcher[Request] = Batcher(lambda requests: self._errors(requests, self.stager.retrieve),
                                                    self.limits)
        self.stores: Batcher[Request] = Batcher(lambda requests: self._errors(requests, self.stager.store),
                                                self.limits)
        weakref.finalize(self, _close, self.inventory, self.sessions)

    @classmethod
    def get_storage_object_cls(cls):
        return StorageObject

    @classmethod
    def example_queries(cls) -> list[ExampleQuery]:
        return [ExampleQuery(query=query, description=text, type=QueryType.ANY) for query, text in EXAMPLES]

    @classmethod
    def is_valid_query(cls, query: str) -> StorageQueryValidationResult:
        return validate(query)

    def rate_limiter_key(self, query: str, operation: Operation) -> Any:
        try:
            return host_key(parse_url(query))
        except UsageError:
            return query

    def default_max_requests_per_second(self) -> float:
        return 100.0

    def use_rate_limiter(self) -> bool:
        """No: requests are batched instead, and a batch is one operation."""
        return False

    def run_now(self, action: str, request: Request) -> None:
        """Retrieve or store one object synchronously; WorkflowError naming it on failure."""
        work = self.stager.retrieve if action == "retrieve" else self.stager.store
        failures = work([request])
        if failures:
            raise WorkflowError(failures[0].for_object(request.query))

    def remove(self, endpoint: Endpoint) -> None:
        """Delete a remote file or tree: locally, or with ``rm -rf`` where the transport runs commands (ssh);
        NotSupportedError elsewhere (GridFTP, Globus)."""
        try:
            if endpoint.is_local:
                remove_local(endpoint.path)
            else:
                self.inventory.run(endpoint, ["rm", "-rf", "--", endpoint.path])
        finally:
            self.inventory.forget(endpoint)

    @staticmethod
    def _errors(requests: list[Request], work) -> dict[int, WorkflowError]:
        failures: dict[int, BatchFailed] = work(requests)
        return {n: WorkflowError(failure.for_object(requests[n].query)) for n, failure in failures.items()}


def _close(inventory: RemoteInventory, sessions: HostSessions) -> None:
    """The provider's end (collected, or the process exits): its transports, then its host sessions."""
    inventory.close()
    sessions.close()
