"""Terminal rendering for the CLI: a rich progress bar on a terminal, nothing otherwise."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from bundles.progress import NoProgress, Progress

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress, TaskID


class BarProgress:
    """A Progress drawn as a rich bar on stderr: files done of total, bytes, rate and ETA."""

    def __init__(self) -> None:
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._done_bytes = 0

    def start(self, label: str, total_files: int, total_bytes: int) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)     # only when a bar is drawn
        self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("entries {task.fields[volume]}"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), transient=True)
        self._bar.start()
        self._label, self._files, self._done_bytes, self._started = label, 0, 0, time.monotonic()
        self._total = human_bytes(total_bytes)
        self._task = self._bar.add_task(label, total=total_files or None, volume="")

    def advance(self, files: int, nbytes: int) -> None:
        if self._bar is not None and self._task is not None:      # both set by start()
            self._done_bytes += nbytes
            self._files += files
            self._bar.update(self._task, advance=files, volume=f"{human_bytes(self._done_bytes)}/{self._total}")

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            seconds = time.monotonic() - self._started
            done = f"{self._files} entries, {human_bytes(self._done_bytes)}, " if self._files else ""
            print(f"{self._label}: {done}{seconds:.1f} s", file=sys.stderr)


def make_progress(enabled: bool | None = None) -> Progress:
    """A bar when stderr is a terminal (or ``enabled`` is True), else a silent Progress."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    return BarProgress() if enabled else NoProgress()


def human_bytes(n: float) -> str:
    """Render a byte count as 1.5 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def parse_size(text: str) -> int:
    """Parse 64M, 4MiB, 1G, 512k or plain bytes into a byte count (binary units)."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 16M, 64MiB, 1G)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value)


def size_arg(text: str) -> int:
    """argparse type for sizes such as 16M or 1GiB (at least one byte)."""
    import argparse
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OverflowError:                          # "inf", "1e400"
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 16M, 64MiB, 1G)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return size


def jobs_arg(text: str) -> int:
    """argparse type for worker counts: 0 (all CPUs) or more."""
    import argparse
    try:
        jobs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if jobs < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all CPUs) or more, not {jobs}")
    return jobs


def seconds_range(low: float, high: float) -> str:
    """A predicted range of seconds as ``1.2–2.0 s`` (two decimals below a second, none from 100 s; a range
    that ends below 0.01 s is ``under 0.01 s``)."""
    if high < 0.01:
        return "under 0.01 s"
    digits = 2 if high < 1 else 1 if high < 100 else 0
    return f"{low:.{digits}f}–{high:.{digits}f} s"


def summary_line(command: str, result) -> str:
    """The summary of a push or pull (a StagingResult) in words, by the rule its ``--json`` follows: the files
    sent, the files already in place (together, the source's files), the entries deleted; the time taken
    beside the range predicted for what was sent; a dry run's list of what it would do."""
    verb = "pushed" if command == "push" else "pulled"
    if result.would_send is not None:
        would, where = ("send", "to") if command == "push" else ("fetch", "into")
        lines = [f"would {would} {len(result.would_send)} entries ({result.files} files, "
                 f"{human_bytes(result.file_bytes)}) {where} {result.dest}; {result.in_place} files already in place",
                 *(f"  {would} {name}" for name in result.would_send),
                 *(f"  delete {name}" for name in result.would_delete)]
        return "\n".join(lines)
    if result.sent_nothing:
        text = f"{verb} nothing: all {result.in_place} files already in place at {result.dest}"
    else:
        predicted = result.predicted
        text = (f"{verb} {result.files} files ({human_bytes(result.file_bytes)}) to {result.dest} as "
                f"{result.strategy} ({result.route}) in {result.seconds:.2f} s"
                + (f" (predicted {seconds_range(predicted.low_seconds, predicted.high_seconds)})" if predicted else "")
                + f", {result.transfers} transfer(s)")
        text += f", {result.skipped_shards} shard(s) already done" if result.skipped_shards else ""
        text += f", {result.in_place} files already in place" if result.in_place else ""
    return text + (f", {result.deleted} entries deleted" if result.deleted else "")


def report(as_json: bool, summary: dict, line: str) -> None:
    """Print the command's summary: ``summary`` as one JSON object, or the human ``line``."""
    import json
    print(json.dumps(summary) if as_json else line)
