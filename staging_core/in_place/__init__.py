"""Reading bundles in place: the pallet:// file system, `pallet mount` and copying entries out."""
