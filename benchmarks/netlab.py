"""Simulated nodes joined by a link with a named condition: the rig of every communication benchmark.

Each node is a network namespace with one veth to a router namespace; every packet between two nodes crosses
the router. The link conditions (:data:`PROFILES`) are built from what this machine's kernel has (no ``netem``,
``fq`` or ``sfq``):

* **rate**: a token bucket (``tbf``) on both ends of each node's veth, so a node sends and receives at most
  ``rate``;
* **round trip and loss**: the router sends every packet between nodes through a TUN device (policy routing:
  a packet that came in from a node is routed to the TUN, one that comes back out of it is routed on), where
  :func:`forward`, a small process of this file, holds each packet for half the round trip and drops
  ``loss`` of them at random (one-way delay; the reply pays the other half);
* **per-flow cap**: ``htb`` with one class per flow bucket under the node's aggregate rate, the class picked
  by a classic-BPF classifier from the TCP ports (``(sport ^ dport) & 0xff``): each TCP connection gets at
  most ``flow_rate``, several connections share the aggregate (cloud providers cap each flow; one TCP
  stream cannot fill the link).

Every profile is calibrated before use (:func:`calibrate`: round trip by TCP echo, throughput with one stream
and with four, node 0 to node 1), and the calibration is printed beside the figures measured on it.

Needs root. Namespaces are ``aiak<tag>n<i>`` (nodes) and ``aiak<tag>r`` (router), addresses 10.231.<i+1>.2
(node ``i``) and 10.231.<i+1>.1 (router); all deleted on exit, on failure and on Ctrl-C.

    sudo python benchmarks/netlab.py --profile per-flow        # build it, print its calibration, tear it down
    sudo python benchmarks/netlab.py --profile all --nodes 2
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

HERE = os.path.abspath(__file__)


@dataclass(frozen=True)
class Profile:
    """A link condition between every two nodes."""

    rate: str                       # each node's rate, each direction (tc units: 500mbit)
    rtt_ms: float = 0.0             # round trip added between two nodes
    loss: float = 0.0               # fraction of packets dropped, each way
    flow_rate: Optional[str] = None  # each TCP connection's cap (per-flow profile)
    mtu: int = 1500
    about: str = ""


PROFILES: Dict[str, Profile] = {
    "rate": Profile("500mbit", about="a rate alone (token bucket), as a quiet data-centre link"),
    "latency": Profile("100mbit", rtt_ms=20, about="100 Mbit/s with a 20 ms round trip, as between cloud regions"),
    "lossy": Profile("100mbit", rtt_ms=20, loss=0.001, about="the same with 0.1% of packets lost each way"),
    "per-flow": Profile("400mbit", flow_rate="25mbit",
                        about="each TCP connection capped at 25 Mbit/s under 400 Mbit/s per node"),
}
FLOW_BUCKETS = 256


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def _flow_classifier() -> str:
    """Classic BPF (``tc ... bpf bytecode``) over an Ethernet frame: TCP over IPv4 -> class
    ``1:(0x100 + ((sport ^ dport) & 0xff))``; anything else -> 0 (no match: htb's default class)."""
    program = [
        (0x28, 0, 0, 12),                 # ldh [12]            ethertype
        (0x15, 0, 11, 0x0800),            # jeq IPv4 ? next : other
        (0x30, 0, 0, 23),                 # ldb [23]            IP protocol
        (0x15, 0, 9, 6),                  # jeq TCP ? next : other
        (0xb1, 0, 0, 14),                 # ldxb 4*([14]&0xf)   X = IP header length
        (0x48, 0, 0, 16),                 # ldh [x+16]          destination port
        (0x02, 0, 0, 0),                  # st M[0]
        (0x48, 0, 0, 14),                 # ldh [x+14]          source port
        (0x61, 0, 0, 0),                  # ldx M[0]
        (0xac, 0, 0, 0),                  # xor x
        (0x54, 0, 0, FLOW_BUCKETS - 1),   # and #0xff
        (0x04, 0, 0, 0x10100),            # add #1:0x100
        (0x16, 0, 0, 0),                  # ret a               the class
        (0x06, 0, 0, 0),                  # other: ret #0
    ]
    return ",".join([str(len(program))] + [" ".join(map(str, op)) for op in program])


class Lab:
    """``nodes`` namespaces behind a router namespace under ``profile``; a context manager that always cleans up."""

    def __init__(self, profile: Profile, nodes: int, tag: str):
        self.profile, self.n = profile, nodes
        self.ns = [f"aiak{tag}n{i}" for i in range(nodes)]
        self.router = f"aiak{tag}r"
        self.dev = [f"aiak{tag}v{i}" for i in range(nodes)]       # node side
        self.rdev = [f"aiak{tag}w{i}" for i in range(nodes)]      # router side
        self.tun = f"aiak{tag}t"
        self.addr = [f"10.231.{i + 1}.2" for i in range(nodes)]
        self.forwarder: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Lab":
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _build(self) -> None:
        p = self.profile
        sh("ip", "netns", "add", self.router)
        sh("ip", "-n", self.router, "link", "set", "lo", "up")
        for name in ("ip_forward", "conf/all/rp_filter", "conf/default/rp_filter"):
            sh("ip", "netns", "exec", self.router, "sysctl", "-qw", f"net.ipv4.{name.replace('/', '.')}="
               + ("1" if name == "ip_forward" else "0"))
        for i in range(self.n):
            ns, dev, rdev = self.ns[i], self.dev[i], self.rdev[i]
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", dev, "type", "veth", "peer", "name", rdev)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "link", "set", rdev, "netns", self.router)
            sh("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", dev)
            sh("ip", "-n", self.router, "addr", "add", f"10.231.{i + 1}.1/24", "dev", rdev)
            for where, d in ((ns, dev), (self.router, rdev)):
                sh("ip", "-n", where, "link", "set", d, "mtu", str(p.mtu), "up")
                self._shape(where, d)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"10.231.{i + 1}.1")
        if p.rtt_ms or p.loss:
            self._start_forwarder()

    def _shape(self, ns: str, dev: str) -> None:
        p = self.profile
        tc = ("ip", "netns", "exec", ns, "tc")
        if p.flow_rate is None:
            sh(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", p.rate, "burst", "256kb", "latency", "100ms")
            return
        sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
        sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", p.rate, "ceil", p.rate)
        sh(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:2", "htb", "rate", p.flow_rate, "ceil",
           p.rate, "quantum", str(p.mtu + 14))
        batch = "".join(f"class add dev {dev} parent 1:1 classid 1:{0x100 + b:x} htb rate {p.flow_rate} ceil "
                        f"{p.flow_rate} quantum {p.mtu + 14}\n" for b in range(FLOW_BUCKETS))
        subprocess.run(["ip", "netns", "exec", ns, "tc", "-batch", "-"], input=batch, check=True, capture_output=True,
                       text=True, timeout=60)
        sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1", "bpf", "bytecode",
           _flow_classifier())

    def _start_forwarder(self) -> None:
        p = self.profile
        self.forwarder = subprocess.Popen(
            ["ip", "netns", "exec", self.router, sys.executable, HERE, "--forward", self.tun,
             "--delay-s", str(p.rtt_ms / 2e3), "--loss", str(p.loss)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = _readline(self.forwarder, timeout=10)
        if line.strip() != "ready":
            raise RuntimeError(f"the forwarder did not start: {line!r}")
        sh("ip", "-n", self.router, "link", "set", self.tun, "mtu", str(p.mtu), "up")
        sh("ip", "netns", "exec", self.router, "sysctl", "-qw", f"net.ipv4.conf.{self.tun}.rp_filter=0")
        sh("ip", "-n", self.router, "route", "add", "default", "dev", self.tun, "table", "100")
        for rdev in self.rdev:
            sh("ip", "-n", self.router, "rule", "add", "iif", rdev, "table", "100")

    def cleanup(self) -> None:
        if self.forwarder is not None and self.forwarder.poll() is None:
            self.forwarder.kill()
            self.forwarder.wait(timeout=10)
        for ns in self.ns + [self.router]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes the veths along

    def run(self, node: int, *args: str, timeout: float = 60.0, env=None) -> str:
        """``python netlab.py ARGS`` in node ``node``'s namespace; its output."""
        done = subprocess.run(["ip", "netns", "exec", self.ns[node], sys.executable, HERE, *args], capture_output=True,
                              text=True, timeout=timeout, env=env)
        if done.returncode:
            raise RuntimeError(f"{args[0]} in {self.ns[node]} failed: {done.stdout}{done.stderr}")
        return done.stdout


def stop(procs: List[subprocess.Popen]) -> None:
    """Kill every process of ``procs`` still running (the ranks of a benchmark, on every path out of it)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    box: List[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


# -- calibration ------------------------------------------------------------------------------------------
def calibrate(lab: Lab, seconds: float = 3.0) -> Dict[str, float]:
    """Round trip (TCP echo, median of 30) and throughput with 1 and 4 streams, node 0 to node 1."""
    server = subprocess.Popen(["ip", "netns", "exec", lab.ns[1], sys.executable, HERE, "--serve", "5301"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if _readline(server, timeout=10).strip() != "ready":
            raise RuntimeError("the calibration server did not start")
        out = {"rtt_ms": float(lab.run(0, "--rtt", lab.addr[1], "5301", "30"))}
        for streams in (1, 4):
            out[f"mbit_{streams}"] = float(lab.run(0, "--stream", lab.addr[1], "5301", str(streams), str(seconds),
                                                   timeout=seconds + 30))
        return out
    finally:
        server.kill()
        server.wait(timeout=10)


def describe_calibration(name: str, profile: Profile, c: Dict[str, float]) -> str:
    return (f"link '{name}' ({profile.about}): measured round trip {c['rtt_ms']:.2f} ms, 1 stream "
            f"{c['mbit_1']:.1f} Mbit/s, 4 streams {c['mbit_4']:.1f} Mbit/s")


# -- the small programs run inside the namespaces ----------------------------------------------------------
def forward(tun: str, delay_s: float, loss: float) -> None:
    """Hold every packet routed into ``tun`` for ``delay_s``, drop ``loss`` of them, send the rest back out."""
    import fcntl

    tunsetiff, iff_tun, iff_no_pi = 0x400454CA, 0x0001, 0x1000
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, tunsetiff, struct.pack("16sH", tun.encode(), iff_tun | iff_no_pi))
    os.set_blocking(fd, False)
    print("ready", flush=True)
    held: "collections.deque" = collections.deque()   # (when to send, packet): one delay, so in order
    rng = random.Random(0)
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 1.0
        readable, _, _ = select.select([fd], [], [], wait)
        now = time.monotonic()
        while readable:
            try:
                packet = os.read(fd, 65536)
            except BlockingIOError:
                break
            if rng.random() >= loss:
                held.append((now + delay_s, packet))
        while held and held[0][0] <= now:
            os.write(fd, held.popleft()[1])


def serve(port: int) -> None:
    """Echo (for the round trip) and sink (for throughput) on one port; the client's first byte says which."""
    import socket

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(64)
    print("ready", flush=True)

    def handle(conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = conn.recv(1)
        while True:
            data = conn.recv(1 << 20)
            if not data:
                return
            if kind == b"e":
                conn.sendall(data)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def rtt(host: str, port: int, count: int) -> None:
    import socket

    conn = socket.create_connection((host, port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(b"e")
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(64)
        samples.append(time.perf_counter() - start)
    print(statistics.median(samples) * 1e3)


def stream(host: str, port: int, streams: int, seconds: float) -> None:
    import socket

    sent = [0] * streams
    block = b"x" * (1 << 16)

    def pump(i):
        conn = socket.create_connection((host, port), timeout=10)
        conn.sendall(b"s")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sent[i] += conn.send(block)
        conn.close()

    threads = [threading.Thread(target=pump, args=(i,)) for i in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(sum(sent) * 8 / (time.monotonic() - start) / 1e6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="all", help=f"one of {', '.join(PROFILES)}, or all (default)")
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the calibrations there")
    ap.add_argument("--forward", metavar="TUN", help=argparse.SUPPRESS)
    ap.add_argument("--delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--loss", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rtt", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--stream", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.forward:
        forward(args.forward, args.delay_s, args.loss)
        return 0
    if args.serve:
        serve(args.serve)
        return 0
    if args.rtt:
        rtt(args.rtt[0], int(args.rtt[1]), int(args.rtt[2]))
        return 0
    if args.stream:
        stream(args.stream[0], int(args.stream[1]), int(args.stream[2]), float(args.stream[3]))
        return 0
    if os.geteuid() != 0:
        print("netlab needs root (network namespaces): sudo python benchmarks/netlab.py", file=sys.stderr)
        return 2
    names = list(PROFILES) if args.profile == "all" else [args.profile]
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        print(f"unknown profile {unknown[0]!r}; valid: {', '.join(PROFILES)}, all", file=sys.stderr)
        return 2
    results = {}
    for name in names:
        with Lab(PROFILES[name], args.nodes, tag=str(os.getpid() % 10000)) as lab:
            results[name] = {"profile": asdict(PROFILES[name]), "calibration": calibrate(lab)}
            print(describe_calibration(name, PROFILES[name], results[name]["calibration"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
