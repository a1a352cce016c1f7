"""Parallel pack and unpack of pallet bundles across MPI ranks (mpi4py optional)."""
