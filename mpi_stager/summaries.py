"""The far side's JSON summaries, defined in mpi_stager.wire with every other message: still importable here."""
from __future__ import annotations

from .wire import (KINDS, SUMMARY_VERSION, PackSummary, ReceiveSummary, StagerSummary, Summary, decode_summary,
                   encode_summary)

encode = encode_summary
decode = decode_summary

__all__ = ["KINDS", "SUMMARY_VERSION", "PackSummary", "ReceiveSummary", "StagerSummary", "Summary", "decode",
           "encode"]
