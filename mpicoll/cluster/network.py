"""The emulated cluster's plumbing: network namespaces, one switch, shaped links.

Every node is a network namespace ``mpicoll-nodeI`` with one interface,
``eth0``, at ``SUBNET.(I+1)``; its other end is a port of a bridge that lives
in a namespace of its own (``mpicoll-switch``), so the subnet touches no
interface of this machine and has no route off it.  Each link is shaped on
both ends (``tc``: netem for delay and loss when asked, under a token-bucket
filter for the rate).  A node's ``/etc/netns/mpicoll-nodeI/hosts`` names every
node, so names resolve the same way inside every namespace (``ip netns exec``
mounts that file over ``/etc/hosts``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..base.errors import ClusterError

__all__ = ["PREFIX", "SWITCH", "namespace", "gbit_per_s", "check_tools", "create", "destroy", "shape", "set_link",
           "processes", "existing"]

PREFIX = "mpicoll-"
SWITCH = PREFIX + "switch"
_TIME = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
_NETNS_ETC = Path("/etc/netns")


def namespace(node: str) -> str:
    return PREFIX + node


def gbit_per_s(rate: str) -> float:
    """A tc rate ("1gbit", "100mbit", "125mbps": bytes) in Gbit/s."""
    match = re.match(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", rate)
    if not match:
        raise ClusterError(f"link rate {rate!r}: give it in tc's units, e.g. 1gbit, 100mbit, 10gbit")
    value, prefix, unit = float(match[1]), match[2], match[3]
    scale = {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3}[prefix]
    return value * scale * (8 if unit == "bps" else 1)


def check_tools() -> None:
    """Refuse clearly where namespaces cannot be made: not root, or iproute2/util-linux missing."""
    if os.geteuid() != 0:
        raise ClusterError("mpicoll cluster needs root (it creates network namespaces); run it with sudo")
    missing = [tool for tool in ("ip", "tc", "unshare", "taskset") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"mpicoll cluster needs {', '.join(missing)} (Debian/Ubuntu: apt install iproute2 "
                           "util-linux)")


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"{' '.join(command)} failed: {result.stderr.strip() or result.stdout.strip()}")


def existing() -> list[str]:
    """The namespaces of mpicoll's cluster on this machine (whatever state they are in)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def create(nodes: list[str], addresses: list[str], prefix_length: int) -> None:
    """The switch namespace and bridge, and one namespace per node linked to it."""
    _run("ip", "netns", "add", SWITCH)
    _run("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", SWITCH, "link", "set", "br0", "up")
    hosts = "127.0.0.1 localhost\n" + "".join(f"{address} {node}\n" for node, address in zip(nodes, addresses))
    for node, address in zip(nodes, addresses):
        ns = namespace(node)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", "tmp-" + node, "netns", ns, "type", "veth", "peer", "name", node, "netns", SWITCH)
        _run("ip", "-n", ns, "link", "set", "tmp-" + node, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{address}/{prefix_length}", "dev", "eth0")
        for link in ("lo", "eth0"):
            _run("ip", "-n", ns, "link", "set", link, "up")
        _run("ip", "-n", SWITCH, "link", "set", node, "master", "br0")
        _run("ip", "-n", SWITCH, "link", "set", node, "up")
        folder = _NETNS_ETC / ns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts)


def destroy() -> list[str]:
    """Kill what runs inside the cluster's namespaces and remove them (and their hosts files)."""
    gone = existing()
    for ns in gone:
        pids = _pids(ns)
        if pids:
            subprocess.run(["kill", "-9", *pids], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
    return gone


def shape(node: str, rate: str | None, delay: str | None = None, loss: float | None = None) -> None:
    """Shape the node's link, both ends: ``rate`` (tc units, e.g. 1gbit), ``delay`` (e.g. 1ms), ``loss`` (%)."""
    if rate is not None:
        gbit_per_s(rate)                                   # refuses what tc would not take
    if delay is not None and not _TIME.match(delay):
        raise ClusterError(f"delay {delay!r}: give it with a unit, e.g. 200us, 1ms")
    if loss is not None and not 0 <= loss < 100:
        raise ClusterError(f"loss {loss}: a percentage from 0 to below 100")
    for where in (["-n", namespace(node), "dev", "eth0"], ["-n", SWITCH, "dev", node]):
        ns, device = where[1], where[3]
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", device, "root"], capture_output=True)
        parent = ["root"]
        if delay or loss:
            netem = ["delay", delay or "0ms"] + (["loss", f"{loss}%"] if loss else [])
            _run("tc", "-n", ns, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", *netem)
            parent = ["parent", "1:"]
        if rate:
            _run("tc", "-n", ns, "qdisc", "add", "dev", device, *parent, "handle", "2:", "tbf", "rate", rate,
                 "burst", "256kb", "latency", "100ms")


def set_link(node: str, up: bool) -> None:
    """Take the node's switch port down (a cut cable: the node is gone as the others see it) or up.  Up, the
    nodes also forget the neighbour entries that failed while it was down: with them, a connection made at once
    after the heal could fail with "no route to host" (EHOSTUNREACH, seen in the cluster test) until the
    kernel tried again."""
    _run("ip", "-n", SWITCH, "link", "set", node, "up" if up else "down")
    if up:
        for ns in existing():
            subprocess.run(["ip", "-n", ns, "neigh", "flush", "all"], capture_output=True)


def processes(node: str) -> list[str]:
    return _pids(namespace(node))


def _pids(ns: str) -> list[str]:
    """The processes running inside namespace ``ns``."""
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
