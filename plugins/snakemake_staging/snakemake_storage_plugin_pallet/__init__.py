"""Snakemake storage plugin `pallet`: a round's remote inputs fetched, and outputs sent, as one planned operation."""
from .provider import StorageProvider
from .settings import StorageProviderSettings
from .storage_object import StorageObject

__all__ = ["StorageObject", "StorageProvider", "StorageProviderSettings"]
