"""The unpack journal lives in bundles.journal, beside the one unpack driver; its names stay importable from here."""
from __future__ import annotations

from bundles.journal import Journal as Journal, bundle_id as bundle_id, new_run_name as new_run_name
