"""Pack a directory into a bundle, unpack it elsewhere and verify it, with the bundles API."""
from __future__ import annotations

import sys

from bundles import Bundle, PackOptions, UnpackOptions, pack, unpack, verify_tree


def main(src: str, bundle: str, dest: str) -> int:
    packed = pack(src, bundle, PackOptions(codec="zstd", jobs=0))
    print(f"{len(packed.index)} entries in {len(packed.index.shards)} shards, {packed.bundle_bytes} bytes")
    unpacked = unpack(bundle, dest, UnpackOptions(jobs=0, verify=True))
    print(f"unpacked {unpacked.files} files in {unpacked.seconds:.2f} s")
    with Bundle.open(bundle) as opened:
        report = verify_tree(opened.index, dest)
    print("identical" if report.ok else "\n".join(report.problems))
    return 0 if report.ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python examples/pack_and_unpack.py SRC BUNDLE DEST")
    sys.exit(main(*sys.argv[1:]))
