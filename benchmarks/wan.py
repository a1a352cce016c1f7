"""An emulated WAN: a network namespace behind a veth pair with tbf rate caps and NFQUEUE packet delay."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.servers import stop_process              # noqa: E402

HOST_IP, NS_IP = "10.200.0.1", "10.200.0.2"
SUBNET = "10.200.0.0/24"
DELAYQ_SOURCE = Path(__file__).resolve().with_name("delayq.c")
TOOLS = {"ip": "iproute2", "tc": "iproute2", "iptables-legacy": "iptables", "ping": "iputils-ping", "gcc": "gcc"}
TBF_QUEUE_MS = 50            # tbf `latency`: how long a packet may wait for tokens before it is dropped
SINK_PORT = 5201
NETNS_ETC = Path("/etc/netns")      # per-namespace files that `ip netns exec` mounts over /etc

# Runs inside the namespace: accept one connection, read to EOF, answer with the byte count.
_SINK = """import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
print("ready", flush=True)
conn, _ = server.accept()
total = 0
while chunk := conn.recv(1 << 20):
    total += len(chunk)
conn.sendall(str(total).encode())
"""


@dataclass(frozen=True)
class LinkSpec:
    """One link setting: round-trip delay added in ms (0: none) and a tbf rate such as ``1gbit``."""

    rtt_ms: float
    rate: str

    @property
    def label(self) -> str:
        return f"{self.rtt_ms:g} ms, {self.rate}"

    @property
    def slug(self) -> str:
        return f"{self.rtt_ms:g}ms-{self.rate}"

    @property
    def rate_bits(self) -> float:
        """The rate in bit/s (tc units: bit, kbit, mbit, gbit)."""
        match = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", self.rate.lower())
        if not match:
            raise ValueError(f"rate {self.rate!r}: use tc units such as 100mbit or 1gbit")
        return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


@dataclass(frozen=True)
class LinkCheck:
    """What was measured through the link: median ping -U round trip (ms) and one TCP stream's Mbit/s."""

    spec: LinkSpec
    ping_ms: float
    stream_mbit: float

    @property
    def rtt_ok(self) -> bool:
        """The measured round trip is the one asked for, within 20 % or 2 ms."""
        return abs(self.ping_ms - self.spec.rtt_ms) <= max(2.0, 0.2 * self.spec.rtt_ms)


@dataclass
class WanLink:
    """A namespace ``name`` reached over ``host_if`` (HOST_IP) ↔ ``ns_if`` (NS_IP) inside it."""

    name: str
    host_if: str
    ns_if: str
    delayq: Path
    queues: tuple[int, int]
    spec: LinkSpec | None = None
    _delayers: list[subprocess.Popen] = field(default_factory=list)
    _rules: list[tuple[bool, list[str]]] = field(default_factory=list)

    def ns(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def apply(self, spec: LinkSpec) -> None:
        """Set the rate caps (both directions) and the delay; the previous delay, if any, is removed first."""
        self._remove_delay()
        burst = max(128 << 10, int(spec.rate_bits / 8 / 250))
        for inside, device in ((False, self.host_if), (True, self.ns_if)):
            tbf = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", spec.rate,
                   "burst", str(burst), "latency", f"{TBF_QUEUE_MS}ms"]
            _run(self.ns(tbf) if inside else tbf)
        if spec.rtt_ms > 0:
            self._add_delay(spec.rtt_ms)
        self.spec = spec

    def _add_delay(self, rtt_ms: float) -> None:
        """Each side holds what it receives for half the round trip (INPUT hook, this veth only)."""
        half_us = str(int(rtt_ms * 1000 / 2))
        for inside, device, queue in ((False, self.host_if, self.queues[0]), (True, self.ns_if, self.queues[1])):
            argv = [str(self.delayq), str(queue), half_us]
            process = subprocess.Popen(self.ns(argv) if inside else argv, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._delayers.append(process)
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"delayq on queue {queue} did not start: {process.stderr.read().strip()}")
            rule = ["INPUT", "-i", device, "-j", "NFQUEUE", "--queue-num", str(queue)]
            iptables = ["iptables-legacy", "-I", *rule]
            _run(self.ns(iptables) if inside else iptables)
            self._rules.append((inside, rule))

    def _remove_delay(self) -> None:
        """Delete our NFQUEUE rules by their exact spec, then stop the delay programs by PID; say if any
        packet was dropped by a full queue or passed undelayed."""
        while self._rules:
            inside, rule = self._rules.pop()
            if drops := self._queue_drops(inside, int(rule[-1])):
                print(f"warning: NFQUEUE {rule[-1]} dropped {drops} packet(s) (queue full)")
            argv = ["iptables-legacy", "-D", *rule]
            subprocess.run(self.ns(argv) if inside else argv, check=False)
        while self._delayers:
            process = self._delayers.pop()
            stop_process(process)
            if message := process.stderr.read().strip():
                print(f"warning: {message}")

    def _queue_drops(self, inside: bool, queue: int) -> int:
        """Packets the kernel dropped on ``queue`` (queue_dropped + user_dropped in nfnetlink_queue)."""
        argv = ["cat", "/proc/net/netfilter/nfnetlink_queue"]
        done = subprocess.run(self.ns(argv) if inside else argv, capture_output=True, text=True)
        for fields in (line.split() for line in done.stdout.splitlines()):
            if len(fields) > 6 and fields[0] == str(queue):
                return int(fields[5]) + int(fields[6])
        return 0

    def check(self) -> LinkCheck:
        """Measure the round trip with ``ping -U`` and one TCP stream's throughput, HOST_IP → NS_IP, sending
        about one second's worth of the rate cap (16 to 128 MiB)."""
        assert self.spec is not None, "apply() a LinkSpec first"
        probe = min(128 << 20, max(16 << 20, int(self.spec.rate_bits / 8)))
        return LinkCheck(self.spec, ping_rtt_ms(NS_IP), self._stream_mbit(probe))

    def checked(self) -> LinkCheck:
        """:meth:`check`, raising RuntimeError when the round trip is not the one asked for."""
        check = self.check()
        if not check.rtt_ok:
            raise RuntimeError(f"link check: ping -U shows {check.ping_ms:.1f} ms, {check.spec.rtt_ms:g} ms set")
        return check

    def _stream_mbit(self, nbytes: int) -> float:
        sink = subprocess.Popen(self.ns([sys.executable, "-c", _SINK, NS_IP, str(SINK_PORT)]),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        try:
            if sink.stdout.readline().strip() != "ready":
                raise RuntimeError("throughput sink did not start in the namespace")
            block = b"\0" * (1 << 20)
            with socket.create_connection((NS_IP, SINK_PORT), timeout=120) as conn:
                started = time.perf_counter()
                for done in range(0, nbytes, len(block)):
                    conn.sendall(block[: nbytes - done])
                conn.shutdown(socket.SHUT_WR)
                received = int(conn.recv(64) or b"0")
                seconds = time.perf_counter() - started
        finally:
            stop_process(sink)
        if received != nbytes:
            raise RuntimeError(f"throughput probe: sent {nbytes} bytes, the sink counted {received}")
        return nbytes * 8 / seconds / 1e6

    def teardown(self) -> None:
        """Remove the delay, stop every process left in the namespace (by PID), delete the namespace."""
        self._remove_delay()
        _end_namespace_processes(self.name)
        subprocess.run(["ip", "link", "delete", self.host_if], check=False, stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "netns", "delete", self.name], check=False)
        shutil.rmtree(NETNS_ETC / self.name, ignore_errors=True)
        with suppress(OSError):
            NETNS_ETC.rmdir()           # only when empty: nothing else uses it


def ping_rtt_ms(address: str, count: int = 5) -> float:
    """Median round trip in ms as the user sees it (``ping -U``: plain ping timestamps replies on arrival, before
    the INPUT hook holds them, so it would show only the outbound half of the delay)."""
    done = subprocess.run(["ping", "-U", "-n", "-q", "-c", str(count), "-i", "0.2", "-W", "5", address],
                          capture_output=True, text=True, check=True)
    match = re.search(r"= [\d.]+/([\d.]+)/", done.stdout)
    if not match:
        raise RuntimeError(f"cannot read ping output: {done.stdout}")
    return float(match[1])


def missing_tools() -> list[str]:
    """Debian packages to install for the programs the emulation needs that are not on PATH."""
    return sorted({package for tool, package in TOOLS.items() if not shutil.which(tool)})


def build_delayq(workdir: Path) -> Path:
    """Compile delayq.c into ``workdir`` (needs gcc and libnetfilter-queue-dev)."""
    binary = workdir / "delayq"
    done = subprocess.run(["gcc", "-O2", "-o", str(binary), str(DELAYQ_SOURCE), "-lnetfilter_queue"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot build {DELAYQ_SOURCE.name} (apt-get install gcc libnetfilter-queue-dev):\n"
                           f"{done.stderr.strip()}")
    return binary


@contextmanager
def emulated_wan(workdir: Path, spec: LinkSpec) -> Iterator[WanLink]:
    """Create the namespace and veth pair, apply ``spec``, yield the link; tear everything down afterwards."""
    if missing := missing_tools():
        raise RuntimeError(f"missing programs; apt-get install {' '.join(missing)}")
    if subprocess.run(["ip", "-4", "-o", "addr", "show", "to", SUBNET], capture_output=True, text=True).stdout:
        raise RuntimeError(f"{SUBNET} is already configured on this machine (another emulated WAN running?)")
    pid = os.getpid()
    link = WanLink(f"pallet-wan-{pid}", f"pwh{pid}", f"pwn{pid}", build_delayq(workdir),
                   (4000 + 2 * (pid % 20000), 4001 + 2 * (pid % 20000)))
    try:
        _create(link)
        link.apply(spec)
        yield link
    finally:
        link.teardown()


def _create(link: WanLink) -> None:
    _write_hosts(link.name)
    _run(["ip", "netns", "add", link.name])
    _run(["ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if])
    _run(["ip", "link", "set", link.ns_if, "netns", link.name])
    _run(["ip", "addr", "add", f"{HOST_IP}/24", "dev", link.host_if])
    _run(["ip", "link", "set", link.host_if, "up"])
    _run(link.ns(["ip", "addr", "add", f"{NS_IP}/24", "dev", link.ns_if]))
    _run(link.ns(["ip", "link", "set", link.ns_if, "up"]))
    _run(link.ns(["ip", "link", "set", "lo", "up"]))


def _write_hosts(name: str) -> None:
    """/etc/netns/NAME/hosts, which `ip netns exec` shows as /etc/hosts in the namespace: both addresses resolve
    there without DNS (unreachable from the namespace; globus-gridftp-server looks its address up)."""
    folder = NETNS_ETC / name
    folder.mkdir(parents=True)
    (folder / "hosts").write_text(f"{Path('/etc/hosts').read_text()}\n{NS_IP} {name}\n{HOST_IP} {name}-host\n")


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _namespace_pids(name: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]


def _end_namespace_processes(name: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process still in our namespace, SIGKILL those left after ``grace_s``."""
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        for pid in _namespace_pids(name):
            with suppress(ProcessLookupError):
                os.kill(pid, signal_number)
        deadline = time.monotonic() + grace_s
        while _namespace_pids(name) and time.monotonic() < deadline:
            time.sleep(0.1)
