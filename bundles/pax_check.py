"""Linear checks of pax extended-header records, made before Python's ``tarfile`` parses them.

Some Pythons (3.11 before 3.11.10, 3.12 before 3.12.6) parse pax records
with regular expressions that take quadratic time, and memory, on crafted
records: records that never reach their ``=``, and long runs of digits
(CVE-2024-6232). A record that passes ``framing_problem`` is matched by
those expressions in time linear in its length. Runs of digits cost them
the square of their length: runs of up to ``SHORT_RUN`` digits (times,
sizes, ids: what tar writes for every member) cost at most that many steps
per byte, and ``digit_cost`` counts the longer ones, which the reader sums
over the whole archive against ``DIGIT_COST_LIMIT``.
"""
from __future__ import annotations

import re
import tarfile
from collections.abc import Mapping

DIGIT_COST_LIMIT = 1 << 28          # about a second of tarfile's pax search, for the whole archive
GLOBAL_LIMIT = 1 << 20              # the most bytes of global pax headers (typeflag g) in one archive, all together
_APPLIED = frozenset(tarfile.PAX_FIELDS) | {"atime", "ctime", "hdrcharset"}
SHORT_RUN = 32
_LENGTH = re.compile(rb"([0-9]{1,20}) ")
_LONG_DIGIT_RUN = re.compile(rb"[0-9]{%d,}" % (SHORT_RUN + 1))
_SHORTEST_RECORD = len(b"5 k=\n")


def framing_problem(data: bytes) -> str | None:
    """Why ``data`` (a pax header's content, NUL padding allowed at its end) is not a sequence of records
    ``LENGTH KEYWORD=VALUE\\n``, each exactly LENGTH bytes; None when it is."""
    end, position = len(data.rstrip(b"\0")), 0
    while position < end:
        length = _LENGTH.match(data, position)
        if length is None:
            return f"a record at offset {position} does not start with its length"
        stop = position + int(length.group(1))
        if (stop - position < _SHORTEST_RECORD or stop > end or data[stop - 1] != 0x0A
                or data.find(b"=", length.end() + 1, stop) < 0):
            return f"the record at offset {position} is not framed by its length"
        position = stop
    return None


def digit_cost(data: bytes) -> int:
    """The work tarfile's pax search may do on ``data``'s runs of more than SHORT_RUN digits: the sum of their
    squared lengths."""
    return sum((match.end() - match.start()) ** 2 for match in _LONG_DIGIT_RUN.finditer(data))


def applied_records(pax: Mapping[str, str]) -> dict[str, str]:
    """The records of ``pax`` that tarfile applies to a member (its fields, the charset of names, GNU sparse
    maps): the others change nothing pallet writes, but tarfile copies every global record into each member
    that follows, so keeping them would cost time and memory per member."""
    return {key: value for key, value in pax.items() if key in _APPLIED or key.startswith("GNU.sparse.")}
