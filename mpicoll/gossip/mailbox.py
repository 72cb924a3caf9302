"""Where push-sum messages land: a window peers accumulate into, or posted receives.

A message is a packet: a header of four float64 ``[weight share, count,
round sum, 0]`` followed by the scaled parameters.  Packets of one round are
summed on arrival, so the count says how many have landed and the round sum
(the sum of their round numbers) proves they all belong to the round being
taken.  Every wait has the communicator's deadline and names the missing peers.

``OneSidedMailbox`` (the default): each rank exposes ``slots`` packet slots in
a window from ``Win.Allocate``; a sender accumulates its packet into slot
``round % slots`` of each out-peer under a shared lock, without the receiver
posting anything.  MPICH completes such an operation only when the target
enters MPI, so the receiver runs a progress thread (:mod:`mpicoll.channel.progress`)
while it computes.  A sender's count goes in last, after a flush has completed
the rest of its packet at the receiver, so a slot whose count is whole holds
whole packets: the receiver reads it under no lock (no sender writes into it
until it is freed) and so never holds its own window against its senders (a
lock left by a rank that dies holding it is never let go, and its senders'
next accesses would wait for ever).  Freeing a slot tells the ranks that will
next write into it (a ``Put`` into their window).  Windows must have MPI's
unified memory model (every MPI this was run on gives it).

``PointToPointMailbox`` (the default): nonblocking sends, and receives posted
when a round starts; messages between two ranks arrive in order, so packets
pair with rounds.  A packet to another node travels as pieces of at most
``PIECE_BYTES``: with one large message, MPI's rendezvous handshake for the
packet coming the other way queues behind it on the same connection, and the
two directions take turns (measured across emulated nodes over UCX's TCP
transport: a 4 MiB round took 57-67 ms as one message, 39 ms in 512 KiB pieces,
against 35 ms on the link).  Inside a node a packet goes whole: there pieces
only add messages (64 MiB rounds at 4 ranks on one node: 0.56-0.63x the ring
allreduce's speed whole, 0.32-0.52x in pieces).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from ..channel.context import Context
from ..channel.rma import access_watch, locked, see_own
from ..base.tags import Tag
from .topology import Graph

__all__ = ["OneSidedMailbox", "PointToPointMailbox", "HEADER"]

HEADER = 4                      # float64 values before the parameters: weight, count, round sum, padding
_HEADER_BYTES = HEADER * 8
PIECE_BYTES = 1 << 19  # largest point-to-point message: handshakes the other way slip between pieces


class _Packets:
    """Packet-sized views into one byte buffer: ``header(i)`` and ``payload(i)`` of packet i."""

    def __init__(self, memory: np.ndarray, count: int, dtype, packets: int):
        self.dtype, self.count = np.dtype(dtype), count
        self.stride = _HEADER_BYTES + -(-count * self.dtype.itemsize // 8) * 8
        self.memory = memory
        self.headers = [memory[i * self.stride:i * self.stride + _HEADER_BYTES].view(np.float64)
                        for i in range(packets)]
        self.payloads = [memory[i * self.stride + _HEADER_BYTES:i * self.stride + _HEADER_BYTES
                                + count * self.dtype.itemsize].view(self.dtype) for i in range(packets)]

    @classmethod
    def allocate(cls, count: int, dtype, packets: int) -> "_Packets":
        stride = _HEADER_BYTES + -(-count * np.dtype(dtype).itemsize // 8) * 8
        return cls(np.zeros(stride * packets, np.uint8), count, dtype, packets)

    def fill(self, index: int, share: float, x: np.ndarray, weight: float, round: int) -> None:
        """Packet ``index`` = ``share`` of (x, weight), one message of ``round``."""
        self.headers[index][:] = (share * weight, 1.0, float(round), 0.0)
        np.multiply(x, x.dtype.type(share), out=self.payloads[index])

    def packet(self, index: int) -> np.ndarray:
        return self.memory[index * self.stride:(index + 1) * self.stride]

    def pieces(self, index: int, whole: bool = False) -> list[np.ndarray]:
        """Packet ``index`` as messages: whole, or cut into pieces of at most ``PIECE_BYTES``."""
        packet = self.packet(index)
        if whole:
            return [packet]
        return [packet[start:start + PIECE_BYTES] for start in range(0, packet.size, PIECE_BYTES)]


def _by_share(shares: dict[int, float]) -> list[tuple[float, list[int]]]:
    """Out-peers grouped by the share they get: one scaled copy of x per distinct share."""
    groups: dict[float, list[int]] = {}
    for peer, share in shares.items():
        groups.setdefault(share, []).append(peer)
    return list(groups.items())


def _check_round(header: np.ndarray, round: int, rank: int, peers) -> None:
    expected = len(peers) * float(round)
    if header[2] != expected:
        raise RuntimeError(f"push-sum: rank {rank} took {int(header[1])} message(s) for round {round} whose "
                           f"rounds sum to {header[2]:g}, not {expected:g}: a peer of {list(peers)} runs a "
                           "different number of rounds (every rank must call mix() the same number of times)")


class OneSidedMailbox:
    """``slots`` packet slots per rank in one window, written by ``Accumulate``."""

    def __init__(self, ctx: Context, graph: Graph, count: int, dtype, slots: int):
        self.ctx, self.graph, self.slots = ctx, graph, slots
        self.rank = ctx.rank
        self.mpi_type = from_numpy_dtype(np.dtype(dtype))
        outgoing = _Packets.allocate(count, dtype, 1)
        self.outgoing = outgoing
        stride = outgoing.stride
        self.acks_at = slots * stride
        self._one = np.ones(1)                    # a sender's count, accumulated once its packet is whole
        ctx.rendezvous()                          # allocating a window blocks until every rank is here
        self.win = MPI.Win.Allocate(self.acks_at + ctx.size * 8, 1, comm=ctx.comm)
        if self.win.Get_attr(MPI.WIN_MODEL) != MPI.WIN_UNIFIED:
            self.win.Free()
            raise RuntimeError("push-sum over windows needs MPI's unified memory model, which this MPI's windows "
                               "do not have: use --transport p2p (transport='p2p')")
        memory = np.frombuffer(self.win.tomemory(), np.uint8)
        memory[:] = 0
        self.inbox = _Packets(memory[:self.acks_at], count, dtype, slots)
        # freed[q]: the latest round rank q has taken from its mailbox; starts "before round 0"
        self.freed = memory[self.acks_at:].view(np.float64)
        self.freed[:] = -1.0
        ctx.rendezvous()                          # every mailbox is ready before anyone writes
        # an access aimed at a rank cut off never returns under Open MPI's fault tolerance, nor does a lock on
        # this rank's window that one holds (mpicoll.channel.rma): the watchdog ends the job after the timeout
        self._access = access_watch(ctx, "push-sum's one-sided transfer (MPI_Win_lock/unlock)")

    def expect(self, round: int) -> None:
        """Nothing to post: packets land on their own."""

    def restart_at(self, round: int) -> None:
        """Continue a resumed run at ``round``: every slot is free (nothing was sent into them)."""
        with locked(self.win, self.rank, self._access, exclusive=True):
            self.freed[:] = np.maximum(self.freed, round - 1)

    def send(self, round: int, shares: dict[int, float], x: np.ndarray, weight: float) -> None:
        """Accumulate each out-peer's share of (x, weight) into its slot for ``round``."""
        offset = (round % self.slots) * self.outgoing.stride
        header = self.outgoing.headers[0]
        for share, peers in _by_share(shares):
            self.outgoing.fill(0, share, x, weight, round)
            header[1] = 0.0                       # the count goes alone, last
            for peer in peers:
                self._wait_for_free_slot(round, peer)
                with locked(self.win, peer, self._access):
                    self.win.Accumulate(header, peer, (offset, HEADER, MPI.DOUBLE), MPI.SUM)
                    if self.outgoing.count:
                        self.win.Accumulate(self.outgoing.payloads[0], peer,
                                            (offset + _HEADER_BYTES, self.outgoing.count, self.mpi_type), MPI.SUM)
                    self.win.Flush(peer)          # the packet is whole at the peer before its count says so
                    self.win.Accumulate(self._one, peer, (offset + 8, 1, MPI.DOUBLE), MPI.SUM)

    def _wait_for_free_slot(self, round: int, peer: int) -> None:
        """``peer`` must have taken round - slots, the last user of this slot, from its mailbox."""
        def free() -> bool:
            see_own(self.win, self.rank, self._access)
            return self.freed[peer] >= round - self.slots

        if not free():
            self.ctx.wait_until(free, [peer])

    def take(self, round: int) -> list:
        """Wait for every packet of ``round``; returns [(weight, payload)] (one, already summed).

        Call :meth:`release` once the payload has been folded in.
        """
        peers = self.graph.in_peers(self.rank, round)
        header = self.inbox.headers[round % self.slots]

        def landed() -> bool:
            # looked for under a shared lock, which holds no sender off; a whole count means whole packets
            see_own(self.win, self.rank, self._access)
            return header[1] >= len(peers)

        if not landed():
            self.ctx.wait_until(landed, list(peers))
        see_own(self.win, self.rank, self._access)     # no read of the packets before the count's
        _check_round(header, round, self.rank, peers)
        self._taking = round
        return [(float(header[0]), self.inbox.payloads[round % self.slots])] if peers else []

    def release(self) -> None:
        """Empty the slot just taken and tell the ranks that write into it next that it is free."""
        round = self._taking
        slot = round % self.slots
        self.inbox.headers[slot][:] = 0
        self.inbox.payloads[slot][...] = 0
        see_own(self.win, self.rank, self._access)     # emptied before any sender hears it is free
        marker = np.array([float(round)])
        for peer in self.graph.in_peers(self.rank, round + self.slots):
            with locked(self.win, peer, self._access):
                self.win.Put(marker, peer, (self.acks_at + self.rank * 8, 1, MPI.DOUBLE))

    def close(self) -> None:
        """Free the window (collective).  The handle is swapped for ``MPI.WIN_NULL`` first (as mpi4py frees its
        own objects): a second call does nothing, and a use after it is refused by MPI instead of reaching
        freed memory."""
        win, self.win = self.win, MPI.WIN_NULL
        if win == MPI.WIN_NULL:
            return
        self.inbox = self.freed = None            # views of the window's memory
        self.ctx.rendezvous()
        win.Free()


class PointToPointMailbox:
    """Nonblocking sends of packets in pieces, receives posted when a round starts."""

    def __init__(self, ctx: Context, graph: Graph, count: int, dtype, slots: int):
        self.ctx, self.graph, self.slots = ctx, graph, slots
        self.rank, self.count, self.dtype = ctx.rank, count, np.dtype(dtype)
        self.sending = [_Packets.allocate(count, dtype, 1) for _ in range(slots)]
        self.sends: list[tuple[list, list]] = [([], []) for _ in range(slots)]
        self.incoming = [_Packets.allocate(count, dtype, 1) for _ in range(slots)]
        self.receiving: dict[int, tuple] = {}       # round -> its posted receives, and the peer behind each
        self.on_my_node = ctx.on_this_node         # packets to these go whole

    def expect(self, round: int) -> None:
        """Post the receives of ``round`` (before our own sends, so packets land in place)."""
        peers = self.graph.in_peers(self.rank, round)
        slot = round % self.slots
        if len(self.incoming[slot].headers) < len(peers):
            self.incoming[slot] = _Packets.allocate(self.count, self.dtype, len(peers))
        packets = self.incoming[slot]
        pieces = [(piece, peer) for i, peer in enumerate(peers)
                  for piece in packets.pieces(i, whole=peer in self.on_my_node)]
        self.receiving[round] = ([self.ctx.irecv(piece, peer, Tag.GOSSIP) for piece, peer in pieces],
                                 [peer for _, peer in pieces])

    def send(self, round: int, shares: dict[int, float], x: np.ndarray, weight: float) -> None:
        """Start sending each out-peer its share of (x, weight); the buffer is reused ``slots`` rounds later."""
        slot = round % self.slots
        requests, peers = self.sends[slot]
        self.ctx.waitall(requests, peers)            # this buffer's previous round has left
        groups = _by_share(shares)
        if len(self.sending[slot].headers) < len(groups):
            self.sending[slot] = _Packets.allocate(self.count, self.dtype, len(groups))
        packets, requests, peers = self.sending[slot], [], []
        for index, (share, group) in enumerate(groups):
            packets.fill(index, share, x, weight, round)
            for peer in group:
                for piece in packets.pieces(index, whole=peer in self.on_my_node):
                    requests.append(self.ctx.isend(piece, peer, Tag.GOSSIP))
                    peers.append(peer)
        self.sends[slot] = (requests, peers)

    def take(self, round: int) -> list:
        peers = self.graph.in_peers(self.rank, round)
        packets = self.incoming[round % self.slots]
        self.ctx.waitall(*self.receiving.pop(round))
        total = np.zeros(HEADER)
        for i in range(len(peers)):
            total += packets.headers[i]
        _check_round(total, round, self.rank, peers)
        self._taking = round
        return [(float(packets.headers[i][0]), packets.payloads[i]) for i in range(len(peers))]

    def release(self) -> None:
        """Nothing to do: the buffers are reposted when their slot comes round again."""

    def restart_at(self, round: int) -> None:
        """Nothing to do: receives are posted round by round."""

    def close(self) -> None:
        for requests, peers in self.sends:
            self.ctx.waitall(requests, peers)
