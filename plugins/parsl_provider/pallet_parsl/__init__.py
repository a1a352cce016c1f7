"""Parsl staging provider for pallet: list ``PalletStaging()`` in an executor's ``storage_access``."""
from .provider import DEFAULT_SCHEMES, PalletStaging
from .tasks import BatchDone, BatchError, KeptBundle

__all__ = ["DEFAULT_SCHEMES", "BatchDone", "BatchError", "KeptBundle", "PalletStaging"]
