"""The command line's SIGINT and SIGTERM: whichever thread the kernel hands one to, the main thread stops at once."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from bundles.errors import Interrupted
from staging_core.cli import main as cli

_READ = "0"         # x86-64's read(2), as /proc/TID/syscall shows a thread blocked in it


def _blocked_in_read(tid: int, fd: int) -> bool:
    """Whether thread ``tid`` of this process waits in read(2) on ``fd``."""
    words = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
    return len(words) > 1 and words[0] == _READ and int(words[1], 16) == fd


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads x86-64 syscall numbers from /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_a_helper_thread_takes_wakes_the_main_thread_from_a_read(signum):
    read, write = os.pipe()                 # nothing is written to it: only the signal can end the read
    main = threading.main_thread().native_id
    fired = threading.Event()               # a safety net only, should the read never end: then it failed

    def end_the_read() -> None:
        fired.set()
        os.write(write, b"x")
    guard = threading.Timer(30, end_the_read)

    def helper() -> None:                   # a thread that does not block the signal: it takes it, as it may
        while not _blocked_in_read(main, read):
            time.sleep(0.001)
        signal.pthread_kill(threading.get_ident(), signum)

    try:
        with cli._Interrupts(keep=False) as interrupts, pytest.raises(Interrupted) as caught:
            guard.start()
            threading.Thread(target=helper, name="test-helper").start()
            os.read(read, 1)
        assert not fired.is_set(), "the read went on until the guard ended it: the signal was lost there"
        assert caught.value.exit_code == 128 + signum and interrupts.caught is caught.value
    finally:
        guard.cancel()
        os.close(read)
        os.close(write)


def test_the_command_line_gives_the_signals_back_when_it_returns():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert {signum: signal.getsignal(signum) for signum in before} == before
    assert signal.set_wakeup_fd(-1) == -1


def test_a_signal_handled_inside_a_finalizer_is_raised_again_and_not_printed(capsys):
    """The first signal handled while the collector closes a generator (where Python cannot raise and prints
    "Exception ignored"): nothing is printed, and the main thread stops as soon as it runs its own code."""
    def shard_writer():
        try:
            yield 1
        finally:                            # a generator's cleanup, as the packer's shards have
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            for _ in range(1000):           # Python code: the handler runs here, inside the finalizer
                pass

    with cli._Interrupts(keep=False) as interrupts, pytest.raises(Interrupted) as caught:
        running = shard_writer()
        next(running)
        del running                         # closed by the collector: the handler raises inside its finally
        time.sleep(30)                      # the main thread's own wait: the signal must end it (a guard only)
        pytest.fail("the signal handled inside the finalizer was lost")
    assert interrupts.caught is caught.value and caught.value.exit_code == 130
    assert "Exception ignored" not in capsys.readouterr().err
