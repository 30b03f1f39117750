"""Two "nodes" on one Linux machine: two network namespaces joined by a veth pair, optionally throttled.

A network namespace has its own interfaces, addresses, routes and loopback. Two of them joined by a veth
pair (a virtual cable: what enters one end leaves the other) behave like two machines on one link:

* processes *within* a namespace talk over its own loopback -- the fast **intra-node** link;
* processes in different namespaces talk over the veth pair -- the **inter-node** link, which ``tc``'s
  token-bucket filter (``tbf``) can slow to, say, 100 Mbit/s, like a real network between nodes;
* the veth ends' byte counters say exactly what crossed between the "nodes".

Safety, by construction: every name carries this process's id and a counter (two labs at once never collide);
the /30 subnet is private (``10.64.0.0/10``) and exists *only inside the two namespaces created here*, which
have no route anywhere else, so traffic can only reach addresses this code created; both veth ends are created
directly inside the namespaces (never in the host's); and :class:`TwoNodes` always deletes what it made --
on normal exit, on an exception, on ``KeyboardInterrupt`` (a context manager) and at interpreter exit
(``atexit``), killing first the processes it started there; what a SIGKILLed process left behind is reaped
by the next :class:`TwoNodes` (:func:`reap_stale`: names carry the pid, so only dead creators' namespaces).

Needs Linux, root or ``CAP_NET_ADMIN``, and ``ip``/``tc`` (Debian package ``iproute2``): :func:`available`
says which is missing. Nothing here imports torch or JAX.
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["available", "Node", "TwoNodes", "ours", "reap_stale", "PREFIX"]

PREFIX = "fsdpc"                 #: every namespace this module creates starts with this (then the pid)
_POOL = ipaddress.ip_network("10.64.0.0/10")   # private; a /30 from here lives only inside our namespaces
_COUNTER = itertools.count()
_LIVE: dict[int, "TwoNodes"] = {}


def _cap_net_admin() -> bool:
    """True if this process has CAP_NET_ADMIN (bit 12 of CapEff in /proc/self/status)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 12 & 1)
    except OSError:
        pass
    return False


def available() -> tuple[bool, str]:
    """``(True, "")`` where two namespaces can be built here, else ``(False, reason in one line)``.

    ``COURSE_LIB_TWO_NODE=0`` in the environment turns the two-node runs off (a test that already ran them
    elsewhere, or a machine whose administrator says no), with that reason."""
    if os.environ.get("COURSE_LIB_TWO_NODE", "1") == "0":
        return False, "turned off by COURSE_LIB_TWO_NODE=0"
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are a Linux feature; this is {sys.platform}"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found: install the Debian package iproute2 (apt-get install iproute2)"
    if os.geteuid() != 0 and not _cap_net_admin():
        return False, "creating network namespaces needs root or CAP_NET_ADMIN (e.g. docker run --cap-add NET_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}p{next(_COUNTER)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return False, f"`ip netns add` refused: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def ours(all_processes: bool = False) -> list[str]:
    """Namespaces of this module still present: this process's (default) or any process's ([] without ``ip``)."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    mine = f"{PREFIX}{os.getpid()}" if not all_processes else PREFIX
    return [n for n in out if n.startswith(mine) and (all_processes or n[len(mine):len(mine) + 1] in "abp")]


def reap_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (a kernel killed with SIGKILL skips
    every clean-up). Names carry the creator's pid, so only those of dead processes are touched. Returns them."""
    import re
    gone = []
    if shutil.which("ip") is None:
        return gone
    for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
        m = re.fullmatch(rf"{PREFIX}(\d+)[abp]\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


@dataclass(frozen=True)
class Node:
    """One namespace: its name, the veth end inside it, and that end's address."""

    index: int      #: 0 or 1 (node rank)
    netns: str      #: namespace name, e.g. ``fsdpc4242a0``
    iface: str      #: the veth end in it (<= 15 characters, Linux's limit)
    addr: str       #: its IPv4 address in the /30

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this namespace: ``ip netns exec <netns> argv...``."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _run(argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


class TwoNodes:
    """Context manager: two namespaces joined by a veth pair; deletes everything on the way out.

    >>> with TwoNodes(rate_mbit=100) as net:             # doctest: +SKIP
    ...     a, b = net.nodes
    ...     p = net.popen(b, ["ping", "-c", "1", a.addr])
    ...     p.wait(); print(net.link_bytes())

    ``rate_mbit``: throttle *both* directions of the link with ``tc qdisc ... tbf rate <r>mbit burst 64kb
    latency 50ms`` (None: unthrottled). Processes started with :meth:`popen` are killed on exit.
    """

    def __init__(self, rate_mbit: float | None = None, *, burst: str = "64kb", latency: str = "50ms"):
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit={rate_mbit!r} must be > 0 (or None: no throttle)")
        self.rate_mbit, self.burst, self.latency = rate_mbit, burst, latency
        k = next(_COUNTER)
        pid = os.getpid()
        tag = f"{pid:x}{k}"[-9:]
        # a /30 picked from the pid and the counter: unique per process and per TwoNodes
        offset = ((pid * 64 + k) % (_POOL.num_addresses // 4)) * 4
        base = _POOL.network_address + offset
        self.subnet = ipaddress.ip_network(f"{base}/30")
        self.nodes = (Node(0, f"{PREFIX}{pid}a{k}", f"v{tag}a", str(base + 1)),
                      Node(1, f"{PREFIX}{pid}b{k}", f"v{tag}b", str(base + 2)))
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # -- life cycle ------------------------------------------------------------------------------------
    def __enter__(self) -> "TwoNodes":
        ok, why = available()
        if not ok:
            raise RuntimeError(f"cannot build two network namespaces here: {why}")
        reap_stale()
        _LIVE[id(self)] = self
        self._up = True
        try:
            a, b = self.nodes
            for n in self.nodes:
                _run(["ip", "netns", "add", n.netns])
            # both ends born inside the namespaces: the host's interfaces are never touched
            _run(["ip", "link", "add", a.iface, "netns", a.netns, "type", "veth", "peer", "name", b.iface,
                  "netns", b.netns])
            for n in self.nodes:
                _run(["ip", "-n", n.netns, "addr", "add", f"{n.addr}/30", "dev", n.iface])
                _run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
                _run(["ip", "-n", n.netns, "link", "set", n.iface, "up"])
                if self.rate_mbit is not None:
                    _run(["tc", "-n", n.netns, "qdisc", "add", "dev", n.iface, "root", "tbf", "rate",
                          f"{self.rate_mbit:g}mbit", "burst", self.burst, "latency", self.latency])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> list[str]:
        """Kill what :meth:`popen` started, delete both namespaces (the veth pair goes with them); idempotent.
        Returns the namespaces of ours that are *still* listed (should be ``[]``)."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)   # its own session: only what we started
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._up:
            for n in self.nodes:
                _run(["ip", "netns", "del", n.netns], check=False)
            self._up = False
        _LIVE.pop(id(self), None)
        listed = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        return [n.netns for n in self.nodes if n.netns in listed]

    # -- using it --------------------------------------------------------------------------------------
    def popen(self, node: Node, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace, in its own session (killed on exit)."""
        if not self._up:
            raise RuntimeError("TwoNodes is not set up: use it as `with TwoNodes(...) as net:`")
        p = subprocess.Popen(node.argv(argv), env=env, start_new_session=True, **kwargs)
        self._procs.append(p)
        return p

    def counters(self, node: Node) -> dict[str, int]:
        """``{"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}`` of ``node``'s veth end (``ip -s -j link``)."""
        r = _run(["ip", "-n", node.netns, "-s", "-j", "link", "show", "dev", node.iface])
        st = json.loads(r.stdout)[0]["stats64"]
        return {"rx_bytes": st["rx"]["bytes"], "tx_bytes": st["tx"]["bytes"],
                "rx_packets": st["rx"]["packets"], "tx_packets": st["tx"]["packets"]}

    def link_bytes(self) -> dict[str, int]:
        """Bytes that crossed the link so far, per direction (``"0->1"``, ``"1->0"``) and in all."""
        a, b = (self.counters(n)["tx_bytes"] for n in self.nodes)
        return {"0->1": a, "1->0": b, "total": a + b}


@atexit.register
def _cleanup_at_exit():
    for net in list(_LIVE.values()):
        net.close()
