"""10,000 tiny remote CSV inputs read by 10,000 Parsl apps, staged by PalletStaging in a few batches; sums go back."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import parsl
from parsl import python_app
from parsl.config import Config
from parsl.data_provider.data_manager import default_staging
from parsl.data_provider.files import File
from parsl.executors import HighThroughputExecutor, ThreadPoolExecutor
from parsl.providers import LocalProvider

from pallet_parsl import PalletStaging
from staging_core import StagingOptions


@python_app
def row_sum(inputs=()):
    """One app per input: the sum of the numbers in one CSV file."""
    with open(inputs[0]) as handle:
        return sum(int(value) for line in handle for value in line.split(","))


@python_app
def report(total, outputs=()):
    """Write the grand total to an output that goes back to the remote side."""
    with open(outputs[0], "w") as handle:
        handle.write(f"{total}\n")
    return total


def generate(directory: str, count: int) -> None:
    """Write ``count`` tiny CSV files (100 per directory) for a try over ssh://localhost."""
    for n in range(count):
        path = os.path.join(directory, f"part{n // 100:03d}", f"row{n:05d}.csv")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(f"{n},{n % 7}\n")


def config(args, staging: PalletStaging) -> Config:
    """Parsl's configuration: its run records (runinfo/) and the local copies both under ``args.workdir``, so a
    run leaves nothing in the directory it was started from."""
    providers = [staging, *default_staging]
    if args.executor == "threads":
        executor = ThreadPoolExecutor(label="work", max_threads=8, working_dir=args.workdir, storage_access=providers)
    else:
        executor = HighThroughputExecutor(label="work", working_dir=args.workdir, storage_access=providers,
                                          provider=LocalProvider(init_blocks=1, max_blocks=1))
    return Config(executors=[executor], run_dir=os.path.join(args.workdir, "runinfo"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("remote", help="ssh://[user@]host[:port]/abs/dir holding partNNN/rowNNNNN.csv "
                                       "(or globus://COLLECTION/abs/dir)")
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--generate", metavar="DIR", help="first write the inputs into local DIR "
                                                          "(the remote directory, when trying ssh://localhost)")
    parser.add_argument("--executor", choices=("threads", "htex"), default="threads")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), f"pallet-parsl-{os.getuid()}"),
                        help="where local copies and Parsl's runinfo/ go (default: %(default)s)")
    parser.add_argument("--remote-python", default="python3", help="Python with pallet on the remote host")
    parser.add_argument("--keep-packed", action="store_true",
                        help="keep each batch as one bundle; every app copies its own input out of it")
    args = parser.parse_args()
    if args.generate:
        generate(args.generate, args.count)
    remote = args.remote.rstrip("/")
    # This script flushes after each wave of apps, so a long window keeps a
    # slow submit loop from splitting the wave into several batches.
    staging = PalletStaging(window=600.0, keep_packed=args.keep_packed,
                            options=StagingOptions(remote_python=args.remote_python))
    started = time.monotonic()
    with parsl.load(config(args, staging)):
        sums = [row_sum(inputs=[File(f"{remote}/part{n // 100:03d}/row{n:05d}.csv")]) for n in range(args.count)]
        staging.flush()
        total = sum(future.result() for future in sums)
        written = report(total, outputs=[File(f"{remote}/total.txt")])
        staging.flush()
        written.outputs[0].result()
    batches = [future.result() for future in staging.batches()]
    print(f"{args.count} apps, total {total}, {time.monotonic() - started:.1f} s")
    for done in batches:
        print(f"  batch {done.number} ({done.direction}): {done.files} file(s), {done.strategy}, "
              f"{done.transfers} transfer(s)")
    print(f"result: {remote}/total.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
