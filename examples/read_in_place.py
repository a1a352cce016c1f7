"""Sum a column of every CSV file in a bundle, read in place through the pallet:// fsspec file system."""
from __future__ import annotations

import csv
import io
import sys

import fsspec


def main(bundle: str, column: int = 2) -> int:
    """``bundle`` is a local path or ssh://HOST/PATH; nothing is unpacked, each file is read from its shard."""
    fs = fsspec.filesystem("pallet", fo=bundle)
    total, files = 0.0, 0
    for path in fs.glob("**/*.csv"):
        with fs.open(path, "rb") as handle:
            for row in csv.reader(io.TextIOWrapper(handle, encoding="utf-8")):
                total += float(row[column])
        files += 1
    print(f"{files} files, column {column} sums to {total:.6f}")
    if fs.bytes_fetched:
        print(f"{fs.bytes_fetched} bytes fetched from the remote bundle")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python examples/read_in_place.py BUNDLE [COLUMN]")
    sys.exit(main(sys.argv[1], *(int(a) for a in sys.argv[2:])))
