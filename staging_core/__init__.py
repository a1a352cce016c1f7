"""pallet's staging core: the `pallet` command line, the planner, transports, push and pull, reading in place."""
