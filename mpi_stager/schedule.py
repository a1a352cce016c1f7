"""Shard assignment lives with the unpack driver (bundles.unpacking); its names stay importable from here."""
from __future__ import annotations

from bundles.unpacking import Assignment as Assignment, assign_shards as assign_shards
