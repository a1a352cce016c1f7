"""pallet's staging core: the `pallet` command line and, in later layers, planning and transfers."""
