"""Nonblocking collectives: start one, compute, then wait for it, as with mpi4py's ``Iallreduce``.

    request = comm.Iallreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
    ...                                    # compute: the reduction moves meanwhile
    request.Wait()

How they progress.  mpicoll's algorithms are Python driving MPI's
point-to-point calls, so something has to keep driving them while the caller
computes.  A communicator's first nonblocking call gives it a :class:`Worker`:
a private duplicate of the communicator (its own channel, the same algorithm)
and one background thread that runs the started calls one after another, in
the order they were started.  That is MPI's rule for nonblocking collectives
(every rank starts the same ones in the same order), so the ranks' workers
meet call by call.  The thread spends its time inside MPI and numpy, which
release the GIL, so data moves while the caller's thread runs torch or numpy
kernels; pure-Python work in the caller shares the GIL with it (measured in
``docs/nonblocking.md``).  Without ``MPI_THREAD_MULTIPLE`` there can be no
such thread: calls then run to completion when started (a warning says so).

An argument the calling rank can see is wrong (counts that do not match, a
root out of range, a read-only output, an op the type lacks) is refused at the
call, as mpi4py refuses it, and the communicator goes on.  A started call's
other errors (ranks that disagree, a lost peer) are raised by its
``Wait``/``Test``; the calls started after it on the same communicator are
not run and raise an error that says so.  Buffers belong to the call until
it completes: do not touch them before ``Wait`` returns.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import traceback
import warnings
import weakref
from typing import Callable, NoReturn

from mpi4py import MPI

from ..base import config, timeline
from ..base.collectives import ALLREDUCE
from ..base.abandoned import abandon_requests
from ..channel.context import Context
from ..base.errors import CollectiveTimeout, MpicollError

__all__ = ["Request", "Worker"]

_iallreduce = MPI.Intracomm.Iallreduce

_GRACE_S = 10.0        # past the communicator's timeout, how long Wait trusts a call that is still running

_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()      # the workers whose thread runs, stopped at exit


class Request:
    """A started collective, like ``MPI.Request``: ``Wait()`` blocks until it is done, ``Test()`` says whether.

    ``wait()`` and ``test()`` (lower case, as mpi4py's object requests) also
    return the call's result: the output array for the array API, None for
    the buffer calls.  Waiting raises the call's error, if it failed.
    """

    def __init__(self, collective: str, run: Callable, result=None):
        self.collective = collective
        self._run = run                     # takes the worker's private Communicator
        self._result = result
        self._then: list[Callable] = []
        self._callbacks: list[Callable] = []
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._worker: Worker | None = None

    def __repr__(self) -> str:
        return f"<mpicoll.Request {self.collective} {'done' if self._done.is_set() else 'pending'}>"

    def started_by(self, thread: str) -> "Request":
        """Run it as a call of ``thread`` (its name): checked across ranks with that name in its signature,
        whichever thread runs it (the starter's communicator is called from several threads)."""
        run = self._run
        self._run = lambda comm: comm.run_for_thread(thread, run)
        return self

    def then(self, transform: Callable) -> "Request":
        """Replace the result by ``transform(result)`` once the call completes (in the thread that
        completes it); returns this request.  Used to finish a result, e.g. divide a sum."""
        with self._lock:
            if not self._done.is_set():
                self._then.append(transform)
                return self
        if self._error is None:
            self._result = transform(self._result)
        return self

    def add_done_callback(self, callback: Callable) -> None:
        """Call ``callback(request)`` once the call has completed or failed (at once if it has), in the
        thread that completes it, like ``concurrent.futures``; ``request.error`` says which."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    @property
    def error(self) -> BaseException | None:
        """The call's error, once it has failed; None while it runs or after it succeeded."""
        return self._error

    def Test(self, status: MPI.Status | None = None) -> bool:
        """Whether the call has completed (raising its error if it failed)."""
        if not self._done.is_set():
            return False
        self._raise()
        return True

    def Wait(self, status: MPI.Status | None = None) -> bool:
        """Block until the call has completed; raise its error if it failed.  A call the worker's thread has
        not taken yet is run here, with the calls started before it (:meth:`Worker.run_queued`)."""
        if not self._done.is_set() and self._worker is not None:
            self._worker.run_queued(until=self)
        if not self._done.is_set():
            with timeline.span(f"wait {self.collective}", "wait"):
                while not self._done.wait(1.0):
                    if self._worker is not None:
                        self._worker.check_alive(self)
        self._raise()
        return True

    def wait(self):
        """``Wait()``, then the call's result."""
        self.Wait()
        return self._result

    def test(self) -> tuple[bool, object]:
        """(whether the call has completed, its result or None)."""
        return (True, self._result) if self.Test() else (False, None)

    @staticmethod
    def Waitall(requests: list["Request"]) -> bool:
        """Wait for every request, in order."""
        for request in requests:
            request.Wait()
        return True

    @staticmethod
    def Testall(requests: list["Request"]) -> bool:
        """Whether every request has completed."""
        return all([request.Test() for request in requests])

    def _execute(self, comm) -> None:
        try:
            self._run(comm)
        except BaseException as error:
            self._finish(error)
            raise
        self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            try:
                if error is None:
                    for transform in self._then:
                        self._result = transform(self._result)
            except BaseException as failure:       # a transform that fails fails the request
                self._error = failure
            self._run = None                       # let go of the buffers
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:           # the caller's bug, not the call's: report it, keep the worker going
                traceback.print_exc()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


class Worker:
    """The private channel and thread that run one communicator's nonblocking calls in start order.

    Made in the caller's thread by the first nonblocking call, which every
    rank makes at the same point of its call sequence: duplicating the
    communicator is a collective, done with the same deadline as any call.

    The started calls wait in a queue; whichever thread holds the turn runs them, one at a time, in the
    order they were started: the worker's thread, or a thread that waits for a call no one has taken yet
    (:meth:`run_queued`).  So a call started and then waited for at once (torch's blocking collectives) runs
    in the waiting thread, without the two hand-offs between threads that cost tens of microseconds each,
    and a call nobody waits for yet runs in the worker's thread while its caller computes.
    """

    _warned = False

    def __init__(self, comm, communicator: type):
        self.rank = comm.Get_rank()
        self.others = [q for q in range(comm.Get_size()) if q != self.rank]
        self._channel = Context(comm, "nonblocking set-up")         # every rank here, then a duplicate
        # ``communicator``: the class of ``comm`` that runs the calls (mpicoll.collectives.communicator, which uses this
        # module: it hands its class in rather than this module importing it)
        self.comm = communicator(self._channel.comm, algorithm=comm.algorithm)
        self.comm.background = True         # shares the core with the caller: wait without spinning
        self.comm.timeout = comm.timeout
        self._comm_state = self.comm.__dict__       # where the channel of its calls is kept, read by reduce_now
        self.failed: BaseException | None = None
        self._running: tuple[Request, float] | None = None
        self._queued: collections.deque = collections.deque()
        self._queue_changed = threading.Condition(threading.Lock())     # guards _queued and _stopping
        self._stopping = False
        self._turn = threading.Lock()       # held by the thread running calls
        self._runner: int | None = None     # that thread's ident
        self._thread = None
        self._thread_ident: int | None = None
        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            self._thread = threading.Thread(target=self._serve, name="mpicoll-nonblocking", daemon=True)
            self._thread.start()
            self._thread_ident = self._thread.ident
            _LIVE.add(self)
        elif not Worker._warned:
            warnings.warn("MPI was initialised without MPI_THREAD_MULTIPLE: mpicoll's nonblocking collectives "
                          "run to completion when started, overlapping nothing", RuntimeWarning, stacklevel=3)
            Worker._warned = True

    def runs_calls_here(self) -> bool:
        """Whether this thread is running the started calls now (a call's callback, starting another)."""
        return self._runner == threading.get_ident()

    def start(self, request: Request) -> Request:
        """Queue ``request`` behind the calls started before it; or run it now, without a thread, or when it
        is started by the thread running the calls: by a callback of a call that just completed (``then``,
        ``add_done_callback``, a torch future's chain), which may wait for it.  Queued, it would wait for the
        thread that waits for it; run there and then, it runs right after the call whose callback started it,
        on every rank alike."""
        request._worker = self
        timeline.instant(f"start {request.collective}", "nonblocking")
        if self._thread is None or self._runner == threading.get_ident():
            self._serve_one(request)
            return request
        with self._queue_changed:
            self._queued.append(request)
            self._queue_changed.notify()
        return request

    def run_queued(self, until: Request | None = None) -> None:
        """Run the queued calls, in order, in this thread, until ``until`` has completed (all of them with
        None); at once if no other thread is running calls, else not at all (that thread runs them)."""
        mine = self._runner == threading.get_ident()      # a callback of a call this thread runs
        if not mine and not self._turn.acquire(blocking=False):
            return
        outer, self._runner = self._runner, threading.get_ident()
        try:
            while until is None or not until._done.is_set():
                with self._queue_changed:
                    if not self._queued:
                        return
                    request = self._queued.popleft()
                self._serve_one(request)
        finally:
            self._runner = outer
            if not mine:
                self._turn.release()

    def _serve(self) -> None:
        while True:
            with self._queue_changed:
                while not self._queued and not self._stopping:
                    self._queue_changed.wait()
                if not self._queued:
                    return
            with self._turn:            # (a waiting thread may be running them: then they are gone when it is done)
                self._runner = threading.get_ident()
                try:
                    self.run_queued()
                finally:
                    self._runner = None

    def run_now(self, collective: str, run: Callable) -> None:
        """Run ``run(self.comm)`` in this thread, as a call started and waited for at once runs, without a
        :class:`Request`: after the calls queued before it (run here, or by the worker's thread, which this
        waits for); its error is raised here, and fails the calls after it as a started call's does."""
        me = threading.get_ident()
        if self._thread is None or self._runner == me:
            self._run_here(collective, run)
            return
        with self._turn:
            self._runner = me
            try:
                if self._queued:
                    self.run_queued()
                self._run_here(collective, run)
            finally:
                self._runner = None

    def reduce_now(self, buffer, op: MPI.Op) -> bool:
        """MPI's own allreduce of ``buffer`` in place (``[memory, datatype]``), started nonblocking and waited
        for here with the deadline, as :meth:`run_now` runs a call, where nothing stands before it: no call
        queued or running, a channel that has made its checked first call and whose last call ran in a
        caller's thread, no earlier failure.  Whether it ran; False: nothing was done, and the caller takes
        :meth:`run_now`.

        The short way of torch's small blocking ``all_reduce`` (mpicoll.torch's backend), whose price is
        counted in frames and attribute reads: no closure, no Request, no frame between the turn and MPI's
        call.  It keeps :meth:`run_now`'s rules: the calls' order (the turn, taken without blocking), the
        failure that refuses the calls after it, the caller's spinning waits, the deadline.  (No ``_runner``
        and no ``_running``: nothing runs in this thread while it holds the turn but MPI, and the call's own
        wait raises past the deadline, where :meth:`check_alive` bounds calls that have none.)"""
        turn = self._turn
        if self._queued or self.failed is not None or not turn.acquire(False):
            return False
        try:
            context = self._comm_state.get("_context")      # (Communicator.context(), without its frame)
            if context is None or context.napping or context.broken or self._queued:
                return False
            context.collective = ALLREDUCE.method           # (what its errors name: Context.begin's part)
            request = _iallreduce(self.comm, MPI.IN_PLACE, buffer, op)
            try:
                if request.Test():          # the last rank to come finds the others' parts there: no wait
                    return True
            except MPI.Exception as error:
                self.reduce_test_failed(context, error, request)
            context.waitall([request], self.others)
            return True
        except BaseException as error:
            if not getattr(error, "settled", False):
                self.failed = error
            raise
        finally:
            turn.release()

    def reduce_test_failed(self, context: Context, error: MPI.Exception, request: MPI.Request) -> NoReturn:
        """Raise what MPI's ``error``, met testing a short way's ``request``, means (Context.raise_failed_wait);
        the request is abandoned."""
        abandon_requests([request])
        context.raise_failed_wait(error, [request], self.others)

    def reduce_now_parts(self) -> dict:
        """What :meth:`reduce_now` reads, for its compiled twin (``mpicoll.torch._shortway``, which does the
        torch backend's reads and this together): this worker, its queue, turn, communicator, the
        communicator's ``__dict__`` (where its channel is kept), the others' ranks, :meth:`reduce_test_failed`."""
        return {"worker": self, "queued": self._queued, "turn": self._turn, "comm_state": self._comm_state,
                "comm": self.comm, "others": self.others, "on_test_error": self.reduce_test_failed}

    def _serve_one(self, request: Request) -> None:
        try:
            self._run_here(request.collective, request._execute, request)
        except BaseException as error:          # raised again by the request's Wait
            if request._run is not None:        # not run: refused for an earlier failure
                request._finish(error)

    def _run_here(self, collective: str, run: Callable, request: Request | None = None) -> None:
        if self.failed is not None:
            raise MpicollError(f"{collective}: not run, because an earlier nonblocking call on this communicator "
                               f"failed: {self.failed}")
        napping = self._runner is not None and self._runner == self._thread_ident
        context = self.comm.context()          # the worker's thread naps in its waits; a caller's spins first
        if context is not None and context.napping is not napping:
            context.run_in_background(napping)
        outer, self._running = self._running, (request, time.monotonic())    # outer: a call whose callback
        try:                                                                  # started this one
            run(self.comm)
        except BaseException as error:
            if not getattr(error, "settled", False):    # (a disagreement every rank met before any data moved)
                self.failed = error
            raise
        finally:
            self._running = outer

    def check_alive(self, request: Request) -> None:
        """Called while ``request`` is waited for: raise a timeout if the call running now has run
        past the deadline without ending (MPI's own calls, used for small messages, have none)."""
        running = self._running
        limit = config.timeout()
        if running is None or not limit or time.monotonic() - running[1] < limit + _GRACE_S:
            return
        error = CollectiveTimeout(request.collective, self.rank, self.others, limit, some_of=True)
        self.failed = self.failed or error
        raise error

    def stop(self) -> bool:
        """Let the thread run the calls started before this and leave (within the communicator's timeout);
        whether it has left."""
        if self._thread is not None:
            self._stop_thread()
            limit = config.timeout()
            self._thread.join(limit + _GRACE_S if limit else None)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def _stop_thread(self) -> None:
        """Tell the thread to leave once the queue is empty."""
        with self._queue_changed:
            self._stopping = True
            self._queue_changed.notify()

    def close(self, abandon: bool = False) -> None:
        """Finish the started calls, stop the thread and release the private channel; with ``abandon`` (a
        rank leaving on an error) the thread is told to stop and the channel dropped, without waiting."""
        if abandon and self._thread is not None:
            self._stop_thread()
        stuck = not abandon and not self.stop()
        self._thread = None
        abandon = abandon or stuck or self.failed is not None
        if not abandon:
            self.comm.close()
        self._channel.free(abandon=abandon)


@atexit.register           # registered after mpi4py's own exit hook, so it runs before MPI_Finalize
def _stop_workers() -> None:
    """Stop every worker's thread before the interpreter finalizes.  A daemon thread still inside a call
    when it does is ended by Python wherever it next takes the GIL: inside torch's ``Future.set_result``
    (which releases it while it wakes the waiters, so the caller may already be exiting), that is inside C++
    code that may not unwind, and the process aborts ("terminate called without an active exception"; 4 of 5
    runs of a 3-rank torch.distributed program whose last call was an ``all_reduce``, without
    ``destroy_process_group``)."""
    for worker in list(_LIVE):
        worker.stop()
