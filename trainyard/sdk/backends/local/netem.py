"""Emulated network for local jobs: one network namespace per host, a shaped link to a shared switch.

    switch namespace ty<tag>sw:  bridge br0 <- ty<tag>p<i> (one port per host) <- ty<tag>gp (gateway)
    host namespace   ty<tag>h<i>: eth0 = 198.18.<net>.<i+1>/24, egress shaped (rate, delay)
    this namespace:  ty<tag>gw = 198.18.<net>.254/24 (peer of ty<tag>gp): this machine, seen from the hosts
    the object store (127.0.0.1 here): reached at its own address from every host namespace (`Relay`)

Ranks of one host share its namespace and talk over its loopback; traffic between hosts crosses two
shaped links (each host shapes its own egress), as on a real cluster. Addresses come from the
benchmarking range 198.18.0.0/15 only, one /24 per job. Everything is removed by `down()`, which the
supervisor calls whatever the outcome; `leftovers()` lists what a killed supervisor left behind.
Needs root, `ip` and `tc` (iproute2). Shaping uses the netem qdisc (rate and delay); on kernels without
it (sch_netem), the tbf qdisc shapes the rate and the delay is not emulated (`up()` says so).
"""
from __future__ import annotations

import hashlib
import os
import select
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass

PREFIX = "ty"  # every namespace and link this module makes starts with it


def unavailable_reason() -> str | None:
    """Why the emulated network cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run as root or drop emulated_network"
    missing = [b for b in ("ip", "tc") if shutil.which(b) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found); install it or drop emulated_network"
    return None


@dataclass(frozen=True, slots=True)
class Plan:
    """Names and addresses of one job's network: a pure function of the job name and host count."""

    tag: str
    hosts: int
    net: int
    """Which of the 512 /24s of 198.18.0.0/15 the job uses (0..511)."""

    @classmethod
    def for_job(cls, job_name: str, hosts: int, taken: set[int] = frozenset()) -> "Plan":
        digest = hashlib.sha256(job_name.encode()).hexdigest()
        net = int(digest[:4], 16) % 512
        while net in taken:  # another job's /24 on this machine
            net = (net + 1) % 512
        return cls(tag=digest[:8], hosts=hosts, net=net)

    def prefix(self) -> str:
        return f"198.{18 + self.net // 256}.{self.net % 256}"

    def host_ns(self, i: int) -> str:
        return f"{PREFIX}{self.tag}h{i}"

    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.tag}sw"

    @property
    def gateway(self) -> str:
        return f"{PREFIX}{self.tag}gw"

    def host_addr(self, i: int) -> str:
        return f"{self.prefix()}.{i + 1}"

    @property
    def gateway_addr(self) -> str:
        return f"{self.prefix()}.254"

    def shape_command(self, i: int, bandwidth_mbit: float, delay_ms: float, netem: bool) -> list[str]:
        tc = ["tc", "-n", self.host_ns(i), "qdisc", "replace", "dev", "eth0", "root"]
        if netem:
            return [*tc, "netem", "delay", f"{delay_ms}ms", "rate", f"{bandwidth_mbit}mbit"]
        # tbf: the bucket must hold a whole GSO segment (64 KiB) and about 4 ms of traffic at the rate
        burst = max(128 * 1024, int(bandwidth_mbit * 1e6 / 8 / 250))
        return [*tc, "tbf", "rate", f"{bandwidth_mbit}mbit", "burst", str(burst), "latency", "100ms"]

    def up_commands(self) -> list[list[str]]:
        sw = self.switch_ns
        cmds = [["ip", "netns", "add", sw], ["ip", "-n", sw, "link", "set", "lo", "up"],
                ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], ["ip", "-n", sw, "link", "set", "br0", "up"]]
        for i in range(self.hosts):
            ns, port = self.host_ns(i), f"{PREFIX}{self.tag}p{i}"
            cmds += [
                ["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "link", "add", port, "netns", sw, "type", "veth", "peer", "name", "eth0", "netns", ns],
                ["ip", "-n", sw, "link", "set", port, "master", "br0", "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.host_addr(i)}/24", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ]
        gp = f"{PREFIX}{self.tag}gp"
        cmds += [
            ["ip", "link", "add", self.gateway, "type", "veth", "peer", "name", gp, "netns", sw],
            ["ip", "-n", sw, "link", "set", gp, "master", "br0", "up"],
            ["ip", "addr", "add", f"{self.gateway_addr}/24", "dev", self.gateway],
            ["ip", "link", "set", self.gateway, "up"],
        ]
        return cmds

    def down_commands(self) -> list[list[str]]:
        return ([["ip", "link", "del", self.gateway]] + [["ip", "netns", "del", self.host_ns(i)] for i in range(self.hosts)]
                + [["ip", "netns", "del", self.switch_ns]])


def taken_nets() -> set[int]:
    """/24s of 198.18.0.0/15 already on this machine's interfaces."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    nets = set()
    for word in out.split():
        if word.startswith(("198.18.", "198.19.")):
            a = word.split("/")[0].split(".")
            nets.add((int(a[1]) - 18) * 256 + int(a[2]))
    return nets


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def up(plan: Plan, bandwidth_mbit: float, delay_ms: float) -> list[str]:
    """Build the network; returns warnings (a delay this kernel cannot emulate). On error, nothing stays."""
    warnings = []
    try:
        for cmd in plan.up_commands():
            r = _run(cmd)
            if r.returncode:
                raise RuntimeError(f"emulated network: `{' '.join(cmd)}` failed: {r.stderr.strip()}")
        netem = _run(plan.shape_command(0, bandwidth_mbit, delay_ms, netem=True)).returncode == 0
        if not netem and delay_ms > 0:
            warnings.append(f"this kernel has no netem qdisc: links are shaped to {bandwidth_mbit} Mbit/s with tbf, "
                            f"but the {delay_ms} ms delay is not emulated")
        for i in range(plan.hosts):
            cmd = plan.shape_command(i, bandwidth_mbit, delay_ms, netem)
            r = _run(cmd)
            if r.returncode:
                raise RuntimeError(f"emulated network: `{' '.join(cmd)}` failed: {r.stderr.strip()}")
    except BaseException:
        down(plan)
        raise
    return warnings


def down(plan: Plan) -> None:
    """Remove the job's namespaces and links (what does not exist is skipped)."""
    for cmd in plan.down_commands():
        _run(cmd)


def leftovers(tag: str | None = None) -> list[str]:
    """Namespaces and links made by this module (of one job when `tag` is given) that still exist."""
    mark = PREFIX + (tag or "")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.split()
    found = [n for n in names if n.startswith(mark) and len(n) >= len(PREFIX) + 9]
    found += [w.rstrip(":").split("@")[0] for w in links if w.startswith(mark) and w.rstrip(":").split("@")[0][-2:] == "gw"]
    return found


def in_host(plan: Plan, i: int, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", plan.host_ns(i), *cmd]


class Relay:
    """How processes inside the host namespaces reach a service that listens on 127.0.0.1 only (the embedded
    object store): a listening socket on each namespace's own loopback, at the service's very address, made by a
    thread that enters the namespace for that call (setns(2) moves the calling thread only; a socket stays in
    the namespace it was made in), whose connections are relayed to the service from this namespace. The jobs
    keep the service's URL, so a request signed for it (the store checks the Host its signature covers) is
    the same inside and out."""

    CHUNK = 1 << 16

    def __init__(self, namespaces: list[str], target: tuple[str, int]):
        self.target = target
        self.listeners = [_listen_in(f"/run/netns/{ns}", target) for ns in namespaces]
        self._closed = threading.Event()
        for sock in self.listeners:
            threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, socket.create_connection(self.target, timeout=30) as upstream:
                self.pump(conn, upstream)
        except OSError:
            pass  # the service or the client went away: the client sees its connection end

    def pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        while True:
            ready, _, _ = select.select(list(peers), [], [], 60)
            if not ready:
                return
            for s in ready:
                data = s.recv(self.CHUNK)
                if not data:
                    return
                peers[s].sendall(data)

    def close(self) -> None:
        self._closed.set()
        for sock in self.listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


_CLONE_NEWNET = 0x40000000


def _listen_in(ns_path: str, address: tuple[str, int]) -> socket.socket:
    """A socket listening at `address` inside the network namespace at `ns_path`, made by a thread of its own that
    enters the namespace and leaves it again (the calling thread's namespace never changes)."""
    import ctypes

    made: list = []

    def enter_and_listen():
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(ns_path, os.O_RDONLY)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns({ns_path})")
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(64)
                made.append(sock)
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:  # a thread left in the namespace must not live on
                    made.append(OSError(ctypes.get_errno(), "setns back"))
        except OSError as e:
            made.append(e)
        finally:
            os.close(own)
            os.close(target)

    t = threading.Thread(target=enter_and_listen)
    t.start()
    t.join()
    errors = [m for m in made if isinstance(m, OSError)]
    socks = [m for m in made if isinstance(m, socket.socket)]
    if errors:
        for sock in socks:
            sock.close()
        raise RuntimeError(f"could not listen at {address[0]}:{address[1]} in {ns_path}: {errors[0]}")
    return socks[0]
