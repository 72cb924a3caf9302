"""The ring's reduce-scatter when all ranks share one node: neighbours read each other's memory.

Same steps and reduction order as :func:`mpicoll.collectives.algorithms.ring.reduce_scatter`,
but no message carries data.  Each rank keeps its partials in its own region
of a shared-memory window (``MPI.Win.Allocate_shared``); its right neighbour
reduces straight out of that region once a zero-byte "ready" note arrives.
Nothing is copied between ranks but the final chunks, which every rank reads
from their owners' regions (shared memory needs no forwarding around the ring).

Measured (docs/benchmarks.md): with more ranks than cores this beats the
point-to-point ring, whose single-copy transfers (CMA) cost kernel time the
oversubscribed ranks do not have.  A variant with small reused slots and
back-pressure kept partials in cache but needed a lockstep per segment, which
was slower when ranks share cores; ranks here run ahead freely.

Past :data:`STREAM_FROM` bytes every store that crosses between ranks or lands
in the output goes around the caches (non-temporal stores, :mod:`mpicoll.compute.streaming`):
with more ranks than cores the ranks' buffers do not stay in cache between
one rank writing a segment and the next reading it, so the write-allocate
read of each stored line was pure cost.

For a non-commutative op the ring is cut as in the point-to-point version:
rank 0 starts each partial afresh, and rank p-1 hands its partial straight to
each chunk's owner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ... import compute
from ...base.chunks import segment_elements, segments
from ...base.tags import Tag

if TYPE_CHECKING:                    # annotations only
    from ...channel.context import Context
    from ..reduction import Reduction

__all__ = ["shared_reduce_scatter"]


_NOTHING = np.empty(0, np.uint8)

# Bytes of buffer from which stores go around the caches.  Measured (docs/benchmarks.md), the CPU time of
# all ranks summed, interleaved in one run, 4 ranks on 2 cores, float32: 1 MiB 1.03x (A/A 1.04), 4 MiB 0.92x,
# 16 MiB 0.87x, 64 MiB 0.79x of the cached stores' (at 2 ranks, MPICOLL_CHANNEL=shared: 16 and 64 MiB 0.74x
# and 0.82x).
STREAM_FROM = 4 << 20


def shared_reduce_scatter(ctx: Context, send: np.ndarray, bounds: list[int], reduction: Reduction, *,
                          gather_into: np.ndarray | None = None, keep_into: np.ndarray | None = None,
                          then=None) -> None:
    """The ring's reduce-scatter through shared memory, then this rank's chunk or all chunks out.

    Same steps as :func:`reduce_scatter`, but each rank keeps its partials in
    its own shared region and its right neighbour reduces straight out of
    it: a zero-byte message says "segment ready", nothing is copied.  Then
    either ``keep_into`` receives this rank's chunk, or ``gather_into``
    receives every chunk, each read from its owner's region as soon as the
    owner says it is final (shared memory needs no forwarding around the ring).
    ``then(chunk)``, before the gather, works on this rank's reduced chunk in
    place in its region (the hierarchical allreduce's phase between nodes).
    """
    p, r = ctx.size, ctx.rank
    left, right = (r - 1) % p, (r + 1) % p
    cut = not reduction.commutative
    starts_partials = cut and r == 0
    shared = ctx.shared_regions()
    regions = shared.regions(send.size, send.dtype)
    mine = regions[r]
    step = segment_elements(ctx.segment_bytes, send.itemsize)
    others = [(r + i) % p for i in range(1, p)]
    streams = send.nbytes >= STREAM_FROM
    copy = compute.copy_around_caches if streams else np.copyto

    def chunk_segments(c):
        return segments(bounds[c], bounds[c + 1], step)

    def destination(chunk):
        return chunk if cut and r == p - 1 else right

    tag = Tag.SHARED_HIGH if cut and r == p - 1 else Tag.SHARED_READY
    notes, peers = [], []

    def ready(chunk):
        shared.sync()
        notes.append(ctx.isend(_NOTHING, destination(chunk), tag))
        peers.append(destination(chunk))

    def await_from(source, note_tag):
        ctx.wait(ctx.irecv(_NOTHING, source, note_tag), source)
        shared.sync()

    own = slice(bounds[r], bounds[r + 1])
    # This rank's final chunk goes to the output segment by segment in the pass that makes it final (the
    # combine stores it twice), unless then() works on it first.  Measured, 4 ranks, float32, interleaved
    # with an A/A control: a copy per segment was 1.04x faster than one copy after the whole chunk (16 MiB);
    # storing twice instead of that copy, 0.96-0.98 of the CPU time at 16 MiB, 0.95-0.97 at 64 MiB.
    out_early = then is None
    out, out_start = (gather_into, 0) if keep_into is None else (keep_into, bounds[r])

    def output(s):                      # where segment s of this rank's own chunk goes in the output
        return out[s.start - out_start: s.stop - out_start]
    first = (r - 1) % p
    for s in chunk_segments(first):
        copy(mine[s], send[s])
        ready(first)
    for k in range(p - 1):
        # Invariant: step k reduces chunk (r-k-2), reading the left neighbour's partial in place.
        c = (r - k - 2) % p
        for s in chunk_segments(c):
            if starts_partials:             # (rank 0 of a cut ring, whose own chunk is final elsewhere)
                copy(mine[s], send[s])
            else:
                await_from(left, Tag.SHARED_READY)
                # the final chunk stays in cache for then(), which works on it next; otherwise, when it is,
                # it goes to this rank's output in the same pass (out_early)
                final = k == p - 2 and not (cut and r < p - 1)
                reduction.combine(regions[left][s], send[s], out=mine[s],
                                  streaming=streams and (k < p - 2 or then is None),
                                  also=output(s) if final and out_early else None)
            if k < p - 2:
                ready(c)
    if cut and r < p - 1:                   # the chunk's high part, from rank p-1, makes it final
        for s in chunk_segments(r):
            await_from(p - 1, Tag.SHARED_HIGH)
            reduction.combine(mine[s], regions[p - 1][s], out=mine[s], streaming=streams and out_early,
                              also=output(s) if out_early else None)

    if not out_early:
        then(mine[own])
        copy(out[own.start - out_start: own.stop - out_start], mine[own])
    if keep_into is None:
        shared.sync()
        notes += [ctx.isend(_NOTHING, q, Tag.SHARED_FINAL) for q in others]
        peers += others
        for q in others:
            await_from(q, Tag.SHARED_FINAL)
            chunk = slice(bounds[q], bounds[q + 1])
            copy(gather_into[chunk], regions[q][chunk])
    ctx.waitall(notes, peers)
    # No rank may reuse its region while another still reads it.
    ctx.waitall([ctx.comm.Ibarrier()], others)
