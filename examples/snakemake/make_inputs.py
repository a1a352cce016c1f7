"""Write N tiny CSV files s00000.csv ... into a directory: the example workflow's remote inputs."""
import argparse
import os


def make_inputs(directory: str, count: int) -> None:
    """File n holds the line ``n,3n``; the workflow's summary is then ``count 3*count*(count-1)/2``."""
    os.makedirs(directory, exist_ok=True)
    for n in range(count):
        with open(os.path.join(directory, f"s{n:05d}.csv"), "w") as out:
            out.write(f"{n},{3 * n}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    make_inputs(args.directory, args.count)
