"""Latency-optimal algorithms for small messages: log2(p) rounds instead of p-1.

Allreduce by recursive doubling.  With p a power of two, at round i every
rank exchanges its whole buffer with the rank whose number differs in bit i
and reduces, lower rank's data on the left.  Both partners compute the same
value from the same operands in the same order, so after log2(p) rounds
every rank holds identical bits.  For other p, with q the largest power of
two below p and e = p - q extra ranks::

    ranks 0..2e-1:  even rank 2i sends to 2i+1, which reduces x[2i] op x[2i+1]
                    and plays rank i below; 2i waits for the result
    ranks 2e..p-1:  play rank (r - e)
    recursive doubling among the q players, then each 2i+1 returns the result to 2i

Player numbers keep the rank order, so non-commutative ops come out in rank
order.  Each round moves the whole buffer: the ring wins once bandwidth matters.

The other collectives: Bruck's allgather (ceil(log2 p) rounds, any p), a
binomial-tree broadcast, and reduce-scatter as recursive-doubling allreduce
followed by taking this rank's block.
"""

from __future__ import annotations

from ...base.chunks import block_bounds
from ...base.tags import Tag
from .base import Algorithm

__all__ = ["RecursiveDoubling"]



class RecursiveDoubling(Algorithm):
    name = "recursive_doubling"

    def allreduce(self, ctx, send, recv, reduction):
        if send is not None:
            recv[...] = send
        p, r = ctx.size, ctx.rank
        if p == 1:
            return
        players = 1 << (p.bit_length() - 1)
        extra = p - players
        incoming = ctx.scratch("rd.incoming", recv.size, recv.dtype)

        if r < 2 * extra and r % 2 == 0:            # hand our data to r+1, wait for the answer
            ctx.wait(ctx.isend(recv, r + 1, Tag.RECURSIVE_DOUBLING), r + 1)
            ctx.wait(ctx.irecv(recv, r + 1, Tag.RECURSIVE_DOUBLING), r + 1)
            return
        if r < 2 * extra:                            # odd: absorb r-1 (lower rank, left operand)
            ctx.wait(ctx.irecv(incoming, r - 1, Tag.RECURSIVE_DOUBLING), r - 1)
            reduction.combine(incoming, recv, out=recv)
            player = r // 2
        else:
            player = r - extra

        mask = 1
        while mask < players:
            partner_player = player ^ mask
            partner = partner_player * 2 + 1 if partner_player < extra else partner_player + extra
            ctx.waitall([ctx.irecv(incoming, partner, Tag.RECURSIVE_DOUBLING),
                         ctx.isend(recv, partner, Tag.RECURSIVE_DOUBLING)], partner)
            if partner_player < player:
                reduction.combine(incoming, recv, out=recv)
            else:
                reduction.combine(recv, incoming, out=recv)
            mask <<= 1

        if r < 2 * extra:
            ctx.wait(ctx.isend(recv, r - 1, Tag.RECURSIVE_DOUBLING), r - 1)

    def reduce_scatter_block(self, ctx, send, recv, reduction):
        whole = ctx.scratch("rd.whole", send.size, send.dtype)
        self.allreduce(ctx, send, whole, reduction)
        bounds = block_bounds(recv.size, ctx.size)
        recv[...] = whole[bounds[ctx.rank]: bounds[ctx.rank + 1]]

    def allgather(self, ctx, send, recv):
        """Bruck: after round i each rank holds the 2**(i+1) blocks that follow its own."""
        p, r = ctx.size, ctx.rank
        block = recv.size // p
        bounds = block_bounds(block, p)
        rotated = ctx.scratch("rd.rotated", recv.size, recv.dtype)
        rotated[:block] = recv[bounds[r]: bounds[r + 1]] if send is None else send
        have = 1
        while have < p:
            count = min(have, p - have)
            to, source = (r - have) % p, (r + have) % p
            ctx.waitall([ctx.irecv(rotated[have * block: (have + count) * block], source, Tag.RECURSIVE_DOUBLING),
                         ctx.isend(rotated[: count * block], to, Tag.RECURSIVE_DOUBLING)], [source, to])
            have += count
        # rotated holds blocks r, r+1, ..., r-1 (mod p): undo the rotation.
        split = (p - r) * block
        recv[r * block:] = rotated[:split]
        recv[: r * block] = rotated[split:]

    def bcast(self, ctx, buf, root):
        """Binomial tree: the set of ranks holding the data doubles every round."""
        p, r = ctx.size, ctx.rank
        position = (r - root) % p
        mask = 1
        while mask < p:                      # receive from the parent (lowest set bit)
            if position & mask:
                parent = (r - mask) % p
                ctx.wait(ctx.irecv(buf, parent, Tag.RECURSIVE_DOUBLING), parent)
                break
            mask <<= 1
        mask >>= 1
        children = []
        while mask > 0:
            if position + mask < p:
                children.append((r + mask) % p)
            mask >>= 1
        ctx.waitall([ctx.isend(buf, child, Tag.RECURSIVE_DOUBLING) for child in children], children)
