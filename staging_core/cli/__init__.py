"""The `pallet` command line: its commands, their arguments and what they print."""
