"""``mpicoll cluster``: an emulated cluster on one machine, to try multi-node code before a real one.

    sudo mpicoll cluster up --nodes 2 --link 1gbit         # 2 nodes, 1 Gbit/s links
    sudo mpicoll cluster run -n 4 -- mpicoll bench --sizes 64K,16M
    sudo mpicoll cluster cut node1 ; ... ; sudo mpicoll cluster heal node1
    sudo mpicoll cluster down

Each node is a Linux network namespace with its own hostname (``node0``,
``node1``, ...), its own address on a private subnet and its share of this
machine's cores (an affinity mask, so every core count mpicoll takes, such as
thread budgets and the transport choice, sees the node's share); the nodes
reach each other only through a bridge, over links shaped to the rate asked
for (:mod:`mpicoll.cluster.network`).  ``run`` starts the job's launcher on
``node0`` and has it reach the other nodes through a small script in place of
ssh, so MPI sees separate hosts: ranks on one node talk through shared memory,
ranks on different nodes over the shaped links (UCX is kept to TCP, which
would otherwise reach across namespaces through shared memory and bypass the
links), and ``MPICOLL_LINK_GBPS`` tells benchmarks the link rate.  Needs root
and iproute2.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

from ..base.launcher import keep_survivors, launcher
from . import network
from .network import ClusterError

__all__ = ["add_parser", "main", "ClusterError", "state"]

STATE_DIR = Path(os.environ.get("MPICOLL_CLUSTER_DIR", "/run/mpicoll-cluster"))

# What run() sets in the job's environment: TCP between namespaces (UCX's shared-memory transports would
# bypass the shaped links), on the node's own interface.
JOB_ENVIRONMENT = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}


def state() -> dict | None:
    """The cluster that is up (nodes, addresses, cores, links), or None."""
    path = STATE_DIR / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def _save(record: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / "state.json").write_text(json.dumps(record, indent=1))


def _cores_per_node(nodes: int) -> list[list[int]]:
    """This machine's cores divided among the nodes (nodes share cores when there are more nodes)."""
    cores = sorted(os.sched_getaffinity(0))
    if nodes >= len(cores):
        return [[cores[i % len(cores)]] for i in range(nodes)]
    share = len(cores) // nodes
    return [cores[i * share:(i + 1) * share] for i in range(nodes)]


def up(nodes: int, link: str | None = "1gbit", delay: str | None = None, loss: float | None = None,
       subnet: str = "10.203.0.0/24") -> dict:
    """Build the cluster (idempotent: the same cluster again is a no-op; another one is refused)."""
    network.check_tools()
    wanted = {"nodes": [f"node{i}" for i in range(nodes)], "link": link, "delay": delay, "loss": loss,
              "subnet": subnet}
    current = state()
    if current is not None:
        if all(current.get(key) == value for key, value in wanted.items()) and \
                set(network.existing()) == {network.SWITCH, *map(network.namespace, current["nodes"])}:
            return current
        raise ClusterError(f"a different cluster is up ({len(current['nodes'])} nodes, link {current['link']}): "
                           "mpicoll cluster down first")
    if network.existing():
        raise ClusterError(f"namespaces {', '.join(network.existing())} exist without a cluster record: "
                           "mpicoll cluster down removes them")
    if nodes < 1:
        raise ClusterError(f"--nodes must be at least 1, got {nodes}")
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError:
        raise ClusterError(f"--subnet {subnet}: not a network; give one such as 10.203.0.0/24") from None
    if not net.is_private or net.is_loopback or net.is_link_local or net.version != 4 \
            or net.num_addresses < nodes + 2:
        raise ClusterError(f"--subnet {subnet}: give a private IPv4 subnet (not loopback or link-local) with "
                           f"room for {nodes} nodes, such as 10.203.0.0/24")
    addresses = [str(address) for address, _ in zip(net.hosts(), range(nodes))]
    record = {**wanted, "addresses": addresses, "cores": _cores_per_node(nodes),
              "down": [], "rates": {node: link for node in wanted["nodes"]}}
    try:
        network.create(wanted["nodes"], addresses, net.prefixlen)
        for node in wanted["nodes"]:
            network.shape(node, link, delay, loss)
    except Exception:
        network.destroy()
        raise
    _save(record)
    _write_launch_script(record)
    return record


def down() -> list[str]:
    """Remove everything the cluster made (processes in it included); returns the namespaces removed."""
    network.check_tools()
    gone = network.destroy()
    for name in ("state.json", "remote-shell", "hosts"):
        (STATE_DIR / name).unlink(missing_ok=True)
    _remove_orphaned_shared_memory()
    return gone


def _remove_orphaned_shared_memory(folder: Path = Path("/dev/shm")) -> list[str]:
    """Remove the shared-memory segments of MPICH jobs (``mpich_shm_*``) that no live process has open or
    mapped: a job killed by a cut or a signal never unlinks them, and they fill /dev/shm."""
    segments = sorted(folder.glob("mpich_shm_*")) if folder.is_dir() else []
    if not segments:
        return []
    in_use = set()
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            in_use.update(line.split(maxsplit=5)[-1].strip() for line in (process / "maps").read_text().splitlines()
                          if "/dev/shm/" in line)
            in_use.update(os.readlink(fd) for fd in (process / "fd").iterdir())
        except OSError:                      # gone meanwhile, or not ours to read
            continue
    removed = []
    for segment in segments:
        if str(segment) not in in_use and f"{segment} (deleted)" not in in_use:
            segment.unlink(missing_ok=True)
            removed.append(segment.name)
    return removed


def _require() -> dict:
    current = state()
    if current is None:
        raise ClusterError("no cluster is up: mpicoll cluster up --nodes N first")
    return current


def _node(current: dict, node: str) -> str:
    if node not in current["nodes"]:
        raise ClusterError(f"no node {node!r}; the nodes are {', '.join(current['nodes'])}")
    return node


def cut(node: str) -> None:
    """Take a node's link down: to the others it is dead (its processes keep running, unreachable)."""
    current = _require()
    network.set_link(_node(current, node), up=False)
    current["down"] = sorted({*current["down"], node})
    _save(current)


def heal(node: str) -> None:
    current = _require()
    network.set_link(_node(current, node), up=True)
    current["down"] = [n for n in current["down"] if n != node]
    _save(current)


def slow(node: str, rate: str) -> None:
    """Change one node's link rate (both ends)."""
    current = _require()
    network.shape(_node(current, node), rate, current["delay"], current["loss"])
    current["rates"][node] = rate
    _save(current)


def status() -> str:
    current = state()
    if current is None:
        left = network.existing()
        return "no cluster" + (f" (but namespaces {', '.join(left)} exist: mpicoll cluster down)" if left else "")
    lines = [f"{len(current['nodes'])} nodes on {current['subnet']}, link {current['link']}"
             + (f", delay {current['delay']}" if current["delay"] else "")
             + (f", loss {current['loss']}%" if current["loss"] else "")]
    for node, address, cores in zip(current["nodes"], current["addresses"], current["cores"]):
        link = "CUT" if node in current["down"] else current["rates"][node]
        lines.append(f"  {node}  {address:<15} cores {','.join(map(str, cores)):<8} link {link:<8} "
                     f"processes {len(network.processes(node))}")
    return "\n".join(lines)


def _write_launch_script(current: dict) -> Path:
    """The script the launcher runs in place of ssh: ``SCRIPT [options] HOST COMMAND...`` runs COMMAND
    on node HOST (its namespace, hostname and cores), as ssh would run it on a real node."""
    cases = "".join(f"    {node}) cores={','.join(map(str, cores))} ;;\n"
                    for node, cores in zip(current["nodes"], current["cores"]))
    script = STATE_DIR / "remote-shell"
    script.write_text(f"""#!/bin/sh
# mpicoll cluster: what the MPI launcher runs instead of ssh.  Called as SCRIPT [options] HOST COMMAND...
while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done
host=$1; shift
case $host in
{cases}    *) echo "mpicoll cluster: no node $host in this cluster" >&2; exit 255 ;;
esac
# As ssh does, the command line runs in a shell on the node: a plain command (Hydra's proxy) replaces
# the shell, so the launcher's signals reach it; a snippet (Open MPI's "VAR=...;export VAR;...;prted")
# runs in it.
case "$*" in *";"*) line="$*" ;; *) line="exec $*" ;; esac
exec ip netns exec {network.PREFIX}$host unshare --uts \
    sh -c 'hostname "$0"; exec taskset -c "$1" sh -c "$2"' "$host" "$cores" "$line"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def run(ranks: int, command: list[str], ranks_per_node: int | None = None, keep_going: bool = False) -> int:
    """Run ``command`` on ``ranks`` ranks spread over the nodes; returns the launcher's exit status.

    ``keep_going``: a rank that dies does not end the others (:func:`mpicoll.base.launcher.keep_survivors`: under
    Open MPI with fault tolerance, under MPICH's Hydra told so), so that they can name it and finish or go on, as
    on a cluster whose launcher tolerates a lost process.
    """
    current = _require()
    nodes = current["nodes"]
    if ranks < 1 or (ranks_per_node is not None and ranks_per_node < 1):
        raise ClusterError(f"-n and --ranks-per-node must be at least 1, got {ranks} and {ranks_per_node}")
    per_node = ranks_per_node or math.ceil(ranks / len(nodes))
    used = math.ceil(ranks / per_node)
    if used > len(nodes):
        raise ClusterError(f"{ranks} ranks at {per_node} per node need {used} nodes; this cluster has "
                           f"{len(nodes)}")
    if not command:
        raise ClusterError("no command given: mpicoll cluster run -n 4 -- COMMAND...")
    mpiexec, flavour = launcher()
    if keep_going:
        try:
            survive, command = keep_survivors(flavour, command)
        except RuntimeError as refusal:
            raise ClusterError(f"--keep-going: {refusal}") from None
        mpiexec = [*mpiexec, *survive]
    hostfile = STATE_DIR / "hosts"                 # Hydra's "host:slots", Open MPI's "host slots=N"
    slots = " slots={}" if flavour == "openmpi" else ":{}"
    hostfile.write_text("".join(f"{node}{slots.format(per_node)}\n" for node in nodes[:used]))
    script = STATE_DIR / "remote-shell"
    if flavour == "mpich":
        flags = ["-launcher", "ssh", "-launcher-exec", str(script), "-f", str(hostfile)]
    elif flavour == "openmpi":
        # Open MPI maps by core (all ranks on the first node, oversubscribed) unless told per node; binding
        # is the node's affinity mask
        flags = ["--mca", "plm_rsh_agent", str(script), "--hostfile", str(hostfile),
                 "--map-by", f"ppr:{per_node}:node:OVERSUBSCRIBE", "--bind-to", "none",
                 "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
    else:
        raise ClusterError(f"{mpiexec[0]} is neither MPICH's nor Open MPI's launcher; set MPIEXEC to one")
    head = nodes[0]
    job = [*mpiexec, *flags, "-n", str(ranks), *command]
    inner = f"hostname {head}; exec taskset -c {','.join(map(str, current['cores'][0]))} {shlex.join(job)}"
    environment = {**os.environ, **JOB_ENVIRONMENT}
    rates = {current["rates"][node] for node in nodes[:used]}
    if len(rates) == 1 and None not in rates:              # benchmarks report the share of the link bound
        environment["MPICOLL_LINK_GBPS"] = f"{network.gbit_per_s(rates.pop()):g}"
    return subprocess.run(["ip", "netns", "exec", network.namespace(head), "unshare", "--uts", "sh", "-c", inner],
                          env=environment).returncode


def add_parser(commands) -> None:
    cluster = commands.add_parser(
        "cluster", help="an emulated cluster on this machine (network namespaces, shaped links; needs root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = cluster.add_subparsers(dest="action", required=True)
    start = actions.add_parser("up", help="create N nodes joined by shaped links")
    start.add_argument("--nodes", type=int, required=True, help="how many nodes (network namespaces) to make")
    start.add_argument("--link", default="1gbit", help="each node's link rate, tc units (default 1gbit)")
    start.add_argument("--delay", help="added one-way delay per link end, e.g. 100us")
    start.add_argument("--loss", type=float, help="packet loss per link end, in percent")
    start.add_argument("--subnet", default="10.203.0.0/24", help="private subnet (default 10.203.0.0/24)")
    launch = actions.add_parser("run", help="run a command on the nodes under the MPI launcher")
    launch.add_argument("-n", "--ranks", type=int, required=True, help="MPI ranks in all")
    launch.add_argument("--ranks-per-node", type=int, help="default: ranks spread evenly over the nodes")
    launch.add_argument("--keep-going", "--elastic", action="store_true", dest="keep_going",
                        help="a rank that dies, or a node cut off, does not end the others: under Open MPI, MPI's "
                        "fault tolerance (for mpicoll train --elastic; docs/elastic.md); under MPICH's Hydra, "
                        "survivors keep running until they time out")
    launch.add_argument("job", nargs=argparse.REMAINDER, help="-- COMMAND...")
    actions.add_parser("status", help="the nodes, their links, cores and processes")
    for name, text in (("cut", "take a node's link down"), ("heal", "bring a cut link back")):
        action = actions.add_parser(name, help=text)
        action.add_argument("node", help="its name, e.g. node1 (mpicoll cluster status lists them)")
    change = actions.add_parser("slow", help="change one node's link rate")
    change.add_argument("node", help="its name, e.g. node1 (mpicoll cluster status lists them)")
    change.add_argument("rate", help="the new rate, tc units, e.g. 100mbit")
    actions.add_parser("down", help="remove the cluster and everything running in it")


def main(args) -> int:
    try:
        if args.action == "up":
            up(args.nodes, args.link, args.delay, args.loss, args.subnet)
            print(status())
        elif args.action == "down":
            gone = down()
            print(f"removed {len(gone)} namespaces" if gone else "no cluster was up")
        elif args.action == "status":
            print(status())
        elif args.action == "run":
            job = args.job[1:] if args.job[:1] == ["--"] else args.job
            return run(args.ranks, job, args.ranks_per_node, args.keep_going)
        elif args.action in ("cut", "heal"):
            (cut if args.action == "cut" else heal)(args.node)
            print(status())
        elif args.action == "slow":
            slow(args.node, args.rate)
            print(status())
    except ClusterError as error:
        print(f"mpicoll cluster: {error}", file=sys.stderr)
        return 2
    return 0
