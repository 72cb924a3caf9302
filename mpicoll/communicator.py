"""``mpicoll.Communicator``: an mpi4py communicator whose collectives run mpicoll's algorithms.

It *is* an ``MPI.Intracomm`` (same handle as the communicator it wraps), so it
goes wherever mpi4py expects one, and everything but the four collectives
below is mpi4py's own.  ``Allreduce``, ``Reduce_scatter_block``,
``Allgather`` and ``Bcast`` take exactly the arguments mpi4py takes, check
them (locally on every call; across ranks on the first call and, with
``MPICOLL_DEBUG=1``, on every call), and run the chosen algorithm over a
private duplicate of the communicator.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import algorithms, device
from .algorithms import auto
from .buffers import Message, is_in_place, read_message
from .checks import Signature, check_call
from .context import Context
from .reduction import Reduction, op_name

__all__ = ["Communicator"]


class Communicator(MPI.Intracomm):
    """A drop-in replacement for an ``MPI.Intracomm``, with mpicoll's collectives.

    ``algorithm`` is a name from :mod:`mpicoll.algorithms` (``ring``,
    ``parallel``, ``recursive_doubling``, ``mpi``) or ``auto``, which picks
    one per call by collective and size.  Construction is local; the private
    channel the algorithms use is duplicated on the first collective call,
    which all ranks make together.  ``close()`` (or leaving a ``with`` block)
    releases that channel and keeps the communicator; ``Free()`` frees both.
    """

    algorithm = "auto"   # also the value for communicators mpi4py builds from this one

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

    def close(self) -> None:
        """Release mpicoll's private duplicate, scratch and shared memory; the communicator stays valid.

        Called by ``Free()`` and on leaving a ``with`` block; a later
        collective call sets them up again.
        """
        context = self.__dict__.pop("_context", None)
        if context is not None:
            context.free()
        for name in ("Allreduce", "Reduce_scatter_block", "Allgather", "Bcast"):
            self.__dict__.pop(name, None)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def Free(self) -> None:
        """Free the communicator, as mpi4py does, and mpicoll's resources with it."""
        self.close()
        MPI.Intracomm.Free(self)

    def _checked_context(self, signature: Signature, contribution: np.ndarray | None = None) -> Context:
        """The private context for one call, after the cross-rank check when one is due.

        Due on a communicator's first call (the call sequence is the same on
        every rank, so all check together) and on every call in debug mode.
        """
        context = self.__dict__.get("_context")
        first = context is None
        if first:
            context = self.__dict__["_context"] = Context(self)
        context.begin(signature.collective)
        if first or context.debug:
            check_call(context, signature, contribution)
            if first and not context.debug and self.algorithm == "auto":
                self._hand_small_calls_to_mpi()
        return context

    # -- the collectives ----------------------------------------------------

    def Allreduce(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        if device.is_device_array(recvbuf):
            return self._on_device("Allreduce", sendbuf, recvbuf, op=op)
        recv = read_message(recvbuf, writable=True, role="recvbuf")
        send = None if is_in_place(sendbuf) else read_message(sendbuf, role="sendbuf")
        _same_shape(send, recv, "Allreduce")
        reduction = _reduction(op, recv, send)
        name = self._choose("allreduce", recv, reduction, send)
        self._run(name, Signature("Allreduce", recv.count, recv.array.dtype, op_name(op)),
                  recv if send is None else send,
                  lambda a, ctx: a.allreduce(ctx, _array(send), recv.array, reduction),
                  lambda: MPI.Intracomm.Allreduce(self, sendbuf, recvbuf, op))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op: MPI.Op = MPI.SUM) -> None:
        if device.is_device_array(recvbuf):
            return self._on_device("Reduce_scatter_block", sendbuf, recvbuf, op=op)
        size = self.Get_size()
        whole = read_message(recvbuf, writable=True, role="recvbuf")
        if is_in_place(sendbuf):
            if whole.count % size:
                raise ValueError(f"Reduce_scatter_block in place: recvbuf has {whole.count} elements, "
                                 f"not a multiple of the {size} ranks")
            send, recv = whole, Message(whole.array[: whole.count // size], whole.datatype, whole.native)
        else:
            send, recv = read_message(sendbuf, role="sendbuf"), whole
            _check_datatypes(send, recv, "Reduce_scatter_block")
            if send.count != recv.count * size:
                raise ValueError(f"Reduce_scatter_block: sendbuf has {send.count} elements, expected "
                                 f"recvbuf's {recv.count} times the {size} ranks = {recv.count * size}")
        reduction = _reduction(op, recv, send)
        name = self._choose("reduce_scatter_block", send, reduction, recv)
        self._run(name, Signature("Reduce_scatter_block", recv.count, recv.array.dtype, op_name(op)), send,
                  lambda a, ctx: a.reduce_scatter_block(ctx, send.array, recv.array, reduction),
                  lambda: MPI.Intracomm.Reduce_scatter_block(self, sendbuf, recvbuf, op))

    def Allgather(self, sendbuf, recvbuf) -> None:
        if device.is_device_array(recvbuf):
            return self._on_device("Allgather", sendbuf, recvbuf)
        size = self.Get_size()
        recv = read_message(recvbuf, writable=True, role="recvbuf")
        if recv.count % size:
            raise ValueError(f"Allgather: recvbuf has {recv.count} elements, not a multiple of the {size} ranks")
        block = recv.count // size
        send = None
        if not is_in_place(sendbuf):
            send = read_message(sendbuf, role="sendbuf")
            _check_datatypes(send, recv, "Allgather")
            if send.count != block:
                raise ValueError(f"Allgather: sendbuf has {send.count} elements, but recvbuf holds "
                                 f"{recv.count} = {size} ranks x {block}")
        name = self._choose("allgather", recv, None, send)
        mine = recv.array[self.Get_rank() * block: (self.Get_rank() + 1) * block] if send is None else send.array
        self._run(name, Signature("Allgather", block, recv.array.dtype),
                  Message(mine, recv.datatype),
                  lambda a, ctx: a.allgather(ctx, _array(send), recv.array),
                  lambda: MPI.Intracomm.Allgather(self, sendbuf, recvbuf))

    def Bcast(self, buf, root: int = 0) -> None:
        if device.is_device_array(buf):
            return self._on_device("Bcast", None, buf, root=root)
        message = read_message(buf, writable=self.Get_rank() != root, role="buf")
        size = self.Get_size()
        if not 0 <= root < size:
            raise ValueError(f"Bcast: root {root} is not a rank of this {size}-rank communicator")
        name = self._choose("bcast", message, None)
        self._run(name, Signature("Bcast", message.count, message.array.dtype, root=root),
                  message if self.Get_rank() == root else None,
                  lambda a, ctx: a.bcast(ctx, message.array, root),
                  lambda: MPI.Intracomm.Bcast(self, buf, root))

    def _hand_small_calls_to_mpi(self) -> None:
        """Shadow the collectives with closures that send small numpy calls straight to MPI.

        ``auto`` runs MPI's own collective below a size threshold anyway; once
        the first call has been checked across ranks, skipping the parsing for
        those calls keeps mpicoll's cost at a fraction of a microsecond, so
        ``auto`` is as fast as MPI where MPI is the right choice.
        """
        for name in ("Allreduce", "Reduce_scatter_block", "Allgather", "Bcast"):
            first, limit = auto.rule(name.lower())[0]
            if first == "mpi":
                if name == "Reduce_scatter_block":      # its rule is by the whole input: p blocks
                    limit /= self.Get_size()
                self.__dict__[name] = _straight_to_mpi(name, getattr(MPI.Intracomm, name).__get__(self),
                                                       getattr(Communicator, name).__get__(self), limit)

    def _on_device(self, collective: str, sendbuf, recvbuf, op: MPI.Op | None = None, root: int = -1) -> None:
        """A collective on CUDA arrays: MPI moves bytes (directly or staged), the GPU reduces."""
        size = self.Get_size()
        recv = _flat_device(recvbuf, "recvbuf" if collective != "Bcast" else "buf")
        send = None if is_in_place(sendbuf) else _flat_device(sendbuf, "sendbuf")
        dtype = np.dtype(recv.dtype)
        if send is not None and np.dtype(send.dtype) != dtype:
            raise ValueError(f"{collective}: sendbuf holds {send.dtype} elements but recvbuf {dtype}")
        expected = {"Allreduce": recv.size, "Reduce_scatter_block": recv.size * size,
                    "Allgather": recv.size // size}.get(collective)
        if send is not None and send.size != expected:
            raise ValueError(f"{collective}: sendbuf has {send.size} elements, expected {expected}")
        if collective == "Allgather" and recv.size % size:
            raise ValueError(f"Allgather: recvbuf has {recv.size} elements, not a multiple of the {size} ranks")
        if collective == "Bcast" and not 0 <= root < size:
            raise ValueError(f"Bcast: root {root} is not a rank of this {size}-rank communicator")
        reduction = None
        if op is not None:
            reduction = Reduction(op, MPI.Datatype.fromcode(dtype.char), dtype)
            if collective == "Reduce_scatter_block" and send is None:
                send, recv = recv, recv[: recv.size // size]
        count = {"Allgather": recv.size // size}.get(collective, recv.size)
        context = self._checked_context(Signature(collective, count, dtype, op_name(op) if op else "-", root))
        if collective == "Allreduce":
            device.allreduce(context, send, recv, reduction)
        elif collective == "Reduce_scatter_block":
            device.reduce_scatter_block(context, send, recv, reduction)
        elif collective == "Allgather":
            device.allgather(context, send, recv)
        else:
            device.bcast(context, recv, root)

    # -- shared machinery ---------------------------------------------------

    def _choose(self, collective: str, sized: Message, reduction: Reduction | None, *messages) -> str:
        """The algorithm for this call; ``mpi`` for datatypes mpicoll leaves to MPI."""
        if not all(m is None or m.native for m in (sized, *messages)):
            return "mpi"
        if self.algorithm != "auto":
            return self.algorithm
        commutative = reduction is None or reduction.commutative
        return auto.choose(collective, sized.nbytes, self.Get_size(), commutative)

    def _run(self, name: str, signature: Signature, contribution: Message | None, run_algorithm, run_mpi) -> None:
        """Check the call if due, then run algorithm ``name`` (``mpi``: the library's own call)."""
        context = self._checked_context(signature, None if contribution is None else contribution.array)
        if name == "mpi":
            run_mpi()
        else:
            run_algorithm(algorithms.get(name), context)


def _straight_to_mpi(name: str, mpi_call, checked_call, limit: float):
    """``name``, calling MPI directly for numpy buffers under ``limit`` bytes."""
    ndarray = np.ndarray
    if name in ("Allreduce", "Reduce_scatter_block"):
        def collective(sendbuf, recvbuf, op=MPI.SUM):
            if type(recvbuf) is ndarray and recvbuf.nbytes < limit:
                return mpi_call(sendbuf, recvbuf, op)
            return checked_call(sendbuf, recvbuf, op)
    elif name == "Allgather":
        def collective(sendbuf, recvbuf):
            if type(recvbuf) is ndarray and recvbuf.nbytes < limit:
                return mpi_call(sendbuf, recvbuf)
            return checked_call(sendbuf, recvbuf)
    else:
        def collective(buf, root=0):
            if type(buf) is ndarray and buf.nbytes < limit:
                return mpi_call(buf, root)
            return checked_call(buf, root)
    collective.__doc__ = getattr(Communicator, name).__doc__
    return collective


def _flat_device(obj, role: str):
    """A 1-D view of a contiguous device array (CuPy or Numba)."""
    _, array = device.as_device_array(obj)
    contiguous = array.flags.c_contiguous if hasattr(array, "flags") else array.is_c_contiguous()
    if not contiguous:
        raise BufferError(f"{role}: device array of shape {array.shape} is not contiguous; pass a contiguous "
                          "array (cupy.ascontiguousarray) or use mpicoll.allreduce(), which accepts any layout")
    return array.reshape(-1) if array.ndim != 1 else array


def _array(message: Message | None) -> np.ndarray | None:
    return None if message is None else message.array


def _check_datatypes(send: Message, recv: Message, collective: str) -> None:
    if send.datatype != recv.datatype and send.array.dtype != recv.array.dtype:
        raise ValueError(f"{collective}: sendbuf holds {send.array.dtype} elements but recvbuf "
                         f"{recv.array.dtype}; pass buffers of one datatype")
    if np.may_share_memory(send.array, recv.array) and send.count and recv.count:
        raise ValueError(f"{collective}: sendbuf and recvbuf overlap; pass MPI.IN_PLACE as sendbuf instead")


def _same_shape(send: Message | None, recv: Message, collective: str) -> None:
    if send is None:
        return
    _check_datatypes(send, recv, collective)
    if send.count != recv.count:
        raise ValueError(f"{collective}: sendbuf has {send.count} elements but recvbuf {recv.count}; "
                         "they must match")


_REDUCTIONS: dict[tuple[int, int], Reduction] = {}


def _reduction(op: MPI.Op, message: Message, other: Message | None = None) -> Reduction | None:
    """The Reduction for (op, datatype), cached for predefined ops; None where MPI reduces."""
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op must be an MPI.Op such as MPI.SUM, got {op!r}")
    if not (message.native and (other is None or other.native)):
        return None
    if not op.is_predefined:
        return Reduction(op, message.datatype, message.array.dtype)
    key = (op.handle, message.datatype.handle)
    reduction = _REDUCTIONS.get(key)
    if reduction is None or reduction.dtype != message.array.dtype:
        reduction = _REDUCTIONS[key] = Reduction(op, message.datatype, message.array.dtype)
    return reduction
