"""One thread per process that ends the job when nothing else can: a blocking MPI call past its deadline,
or another rank that failed.

Two waits cannot be bounded from inside: MPI's own blocking collectives (``auto`` hands small calls to
them, and the ``mpi`` algorithm every call), which nothing interrupts once entered; and a rank whose
program raised, which sits in ``MPI_Finalize`` while its peers wait for it in their next collective.
This module's thread watches both from outside the stuck call:

- :class:`watching` marks a blocking MPI call as in flight (a time stamp set and cleared), and
  :func:`watch_calls_of` has the thread time a fast path's calls by the frames they run in, at no cost to
  the call (``docs/failures.md``); once one has lasted the communicator's ``MPICOLL_TIMEOUT``, the thread
  holds the roll call on the communicator's private channel (``Context``), names the ranks that never
  answered, and ends the job with ``MPI_Abort``: the stuck call cannot return, so it cannot raise.
- :func:`guard_job` (what ``mpicoll train`` and the benchmarks call first, on every rank) opens a side
  channel on which a rank that ends the job tells every other rank why; each rank's thread prints that
  reason, and the telling rank ends the job a moment later.  So a rank's ``ZeroDivisionError``
  (:func:`job_failed`) is seen in seconds on every rank instead of as a 300 s timeout blaming it for being
  "dead or hung", and a rank that timed out on a lost peer (:func:`mpicoll.base.failure.end_job`) has the
  others say what was lost, the ones still computing or whose own wait began later included.

The thread polls (every 0.1 s): a thread blocked in an MPI call would hold MPICH's progress lock.  It asks
MPI nothing unless the guard is on or a deadline passed, and it needs ``MPI_THREAD_MULTIPLE`` (mpi4py's
default) to call MPI beside the stuck main thread; without it a passed deadline ends the job unnamed.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import traceback
import weakref

import numpy as np
from mpi4py import MPI

from ..base import config, failure
from ..base.errors import CollectiveTimeout
from ..base.tags import Tag

__all__ = ["watching", "watch_of", "answer_roll_calls_of", "watch_numbered_calls_of", "watch_calls_of", "bounded", "start", "guard_job", "job_failed", "end_job_on_uncaught_errors", "FAILED_EXIT_CODE"]

FAILED_EXIT_CODE = 1     # mpiexec's status for a job a rank's uncaught exception ended
_LOOK_EVERY = 0.1        # seconds between the thread's looks
# seconds between its answers to roll calls: a roll call listens for a second at least, and each answer costs a probe
# of every communicator alive (about 260 a process in the 4-rank test tier)
_ANSWER_EVERY = 0.5
_NOTE_BYTES = 4000       # the longest reason sent to the other ranks
_SETTLE_S = 1.0          # a failing rank's pause between telling the others and ending the job

_watches: weakref.WeakSet = weakref.WeakSet()    # every watching object alive: the calls that may be in flight
_watches_lock = threading.Lock()
_fast_paths: set = set()        # the code of the functions watch_calls_of watches
_numbered: weakref.WeakSet = weakref.WeakSet()     # what watch_numbered_calls_of watches
_roll_call_answerers: weakref.WeakSet = weakref.WeakSet()     # contexts whose roll calls the thread answers
_guard: MPI.Intracomm | None = None  # the side channel for notes from failed ranks (guard_job)
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
# Held by the thread around its looks, which call MPI; taken at exit, before MPI_Finalize, to stop them: a probe
# beside MPI_Finalize is erroneous (MPICH ends the process on a call after it).
_calls_lock = threading.Lock()
_finalizing = False
_job_ending = failure.ending               # (read on every blocking call's way out: watching, the fast paths)


class watching:
    """``with watching(owner, "Allreduce"):`` around a blocking MPI call on ``owner``'s communicator.

    ``owner``: anything with a ``context()`` method answering the :class:`~mpicoll.channel.context.Context` whose
    timeout bounds the call and whose roll call names the missing ranks (a Communicator, or a Context).
    One object serves one call at a time and may be reused: a hot path keeps one and sets ``started``
    (``time.monotonic()``, 0 when idle) itself, which is all ``with`` does.
    """

    __slots__ = ("owner", "collective", "causes", "started", "__weakref__")

    def __init__(self, owner, collective: str, causes: str | None = None):
        self.owner, self.collective, self.causes, self.started = owner, collective, causes, 0.0
        with _watches_lock:
            _watches.add(self)

    def __enter__(self):
        self.started = time.monotonic()

    def __exit__(self, *exc_info):
        self.started = 0.0
        if _job_ending.is_set():         # the watchdog ended the job on this call: it does not return
            failure.hold_if_ending()


def watch_numbered_calls_of(caller) -> None:
    """Time the calls of ``caller``, an object that numbers its call in flight (``in_flight``: 1, 2, ...; 0 when
    idle: the compiled fast path) and names its ``owner`` (what :class:`watching` takes) and ``collective``.
    The thread sees a number when it looks; one number seen for longer than the owner's timeout is one call
    stuck that long.  Weakly held."""
    with _watches_lock:
        _numbered.add(caller)
    start()


def answer_roll_calls_of(context, answer: bool = True) -> None:
    """From now on the thread answers other survivors' roll calls on ``context``'s channel every
    :data:`_ANSWER_EVERY` s (``context.answer_roll_calls()``), so that this rank is heard alive while it computes
    outside any call there; or, with ``answer`` False, no longer.  Weakly held."""
    with _watches_lock:
        if answer:
            _roll_call_answerers.add(context)
        else:
            _roll_call_answerers.discard(context)


def watch_of(owner, collective: str, causes: str | None = None) -> watching:
    """``owner``'s :class:`watching` for ``collective``, made once and kept on the owner (a Communicator
    or a Context): a call path that runs often reuses one instead of registering a new one per call.
    ``causes``: what may keep the peers from answering, for a call that is not a collective (the message
    says so in place of a collective's causes)."""
    watches = owner.__dict__.setdefault("_watches", {})
    watch = watches.get(collective)
    if watch is None:
        watch = watches[collective] = watching(owner, collective, causes)
    return watch


def watch_calls_of(function) -> None:
    """Time every call of ``function`` by the frame it runs in: a fast path around one blocking MPI call, whose
    locals hold ``owner`` (what :class:`watching` takes) and ``name`` (the collective).

    Nothing is set per call: every look, the thread finds the threads whose innermost Python frame is such
    a call (``sys._current_frames``) and keeps those frames; a frame seen for longer than the owner's
    timeout is one call stuck that long (a frame kept alive is never reused, so a new call is a new frame).
    A time stamp costs such a path ~35 ns of its ~150 over MPI's own call (measured; docs/failures.md).
    """
    _fast_paths.add(function.__code__)
    start()


class _Plain:
    """A plain mpi4py communicator as a :class:`watching` owner: no private channel to hold a roll call on,
    so a passed deadline names the ranks the MPI library knows to be dead, if it knows any."""

    __slots__ = ("comm",)

    def __init__(self, comm):
        self.comm = comm

    def context(self):
        return None


def bounded(comm: MPI.Comm, collective: str) -> watching:
    """``with bounded(comm, "what"):`` around mpi4py's own blocking collective on a plain communicator
    (the checks before and between epochs): past ``MPICOLL_TIMEOUT`` the job ends, naming ``collective``."""
    start()
    return watching(_Plain(comm), collective)


def start() -> None:
    """Start the thread if it is not running (before the first :func:`watching`)."""
    global _thread
    if _thread is not None:
        return
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="mpicoll-watchdog", daemon=True)
            _thread.start()


def guard_job(comm: MPI.Intracomm = MPI.COMM_WORLD) -> None:
    """Listen, from now on, for other ranks' :func:`job_failed` notes (collective over ``comm``: every
    rank calls it once, at the start of the job)."""
    global _guard
    if _guard is None and comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        _guard = comm.Dup()
        failure.tell_others_with(_tell_the_others)       # a rank that ends the job says why to the others
    start()


def job_failed(error: BaseException) -> None:
    """This rank stops on ``error`` that its peers cannot know of: print its traceback, tell every other
    rank why (each prints it), and end the job (``MPI_Abort``).  Does not return."""
    traceback.print_exception(error, file=sys.stderr)
    _end_for(error)


def _end_for(error: BaseException) -> None:
    """The end of :func:`job_failed`, once ``error``'s traceback is out: the one line, the others told, the job
    ended.  One thread ends the job; another that comes here meanwhile waits for the end."""
    with _ending:
        reason = _one_line(error)
        rank = MPI.COMM_WORLD.Get_rank()
        failure.end_job(f"{reason} (an uncaught error on rank {rank}; its traceback is above)", FAILED_EXIT_CODE,
                        settle=_SETTLE_S, note=f"failed: {reason}")


def _tell_the_others(note: str, lost) -> bool:
    """Send ``note`` on the guard channel to every other rank but the world ranks ``lost`` and those the MPI
    library knows dead (a send to a dead rank on another node crashes MPICH's UCX transport: failure.failed_ranks),
    and wait for the sends, at most :data:`_SETTLE_S`; each rank's thread prints it (:func:`_hear_failures`).
    Answers whether there was anyone to tell."""
    guard = _guard
    if guard is None:
        return False
    lost = MPI.Group.Translate_ranks(MPI.COMM_WORLD.Get_group(), sorted(lost), guard.Get_group()) if lost else []
    spared = {guard.Get_rank(), *lost, *failure.failed_ranks(guard)}
    data = np.frombuffer(note.encode()[:_NOTE_BYTES], np.uint8)
    sent = [guard.Isend([data, MPI.BYTE], peer, Tag.JOB_FAILED) for peer in range(guard.Get_size()) if peer not in spared]
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline and not MPI.Request.Testall(sent):
        time.sleep(0.01)
    return bool(sent)


def end_job_on_uncaught_errors() -> None:
    """From now on, an exception that ends this process's main thread ends the whole job (as
    :func:`job_failed` does) instead of leaving the process in ``MPI_Finalize`` while its peers wait for it
    until their timeout.  What ``python -m mpi4py`` does, for programs that use mpicoll's communicators (a
    :class:`~mpicoll.channel.context.Context` installs it); Ctrl-C keeps Python's own handling.

    The hook prints the traceback through the hook it replaced and returns; the job ends just after, at the
    process's exit (before MPI finalizes) or, where exit is held up (a thread that is not a daemon, stuck),
    from the watchdog :data:`_SETTLE_S` later.  So a hook that wraps this one sees the traceback it printed:
    torch's ``init_process_group`` wraps the hook it finds in one that points ``sys.stderr`` at a buffer while
    calling it, then writes the buffer out, each line prefixed with the rank; a hook that ended the job
    inside it ended it with the buffer unwritten (no traceback on any rank)."""
    global _hook_installed
    if _hook_installed or MPI.COMM_WORLD.Get_size() == 1:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(kind, error, trace):
        global _uncaught
        if issubclass(kind, (KeyboardInterrupt, SystemExit)) or not MPI.Is_initialized() or MPI.Is_finalized():
            return previous(kind, error, trace)
        try:
            previous(kind, error, trace)
        finally:
            _uncaught = (error.with_traceback(trace), time.monotonic())
            atexit.register(_end_for, _uncaught[0])     # the last exit hook registered: it runs first
            start()

    sys.excepthook = hook


_hook_installed = False
_uncaught: tuple[BaseException, float] | None = None    # the main thread's uncaught error, and when it was printed
_ending = threading.Lock()      # held by the thread that ends the job for an uncaught error


def _one_line(error: BaseException) -> str:
    """``Type: message (at file:line)``, the message's lines joined."""
    text = " ".join("".join(traceback.format_exception_only(type(error), error)).split())
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


def _watch() -> None:
    beating = failure.fault_tolerant()
    in_fast_calls: dict = {}     # frame of a fast path's call, or (caller, number) -> (first seen, owner, collective)
    answered_at = 0.0
    while True:
        time.sleep(_LOOK_EVERY)
        try:
            with _calls_lock:
                if _finalizing or MPI.Is_finalized():     # (a program may finalize MPI itself, then go on)
                    return
                if beating:
                    # Open MPI's heartbeat detector beats only while the process calls MPI: a rank computing for
                    # longer than its timeout without a call would be taken for dead (measured: a 15 s computation,
                    # declared dead by its peers).  A probe drives MPI's progress, and with it the beats.
                    MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                if _guard is not None:
                    _hear_failures()
                if _uncaught is not None and time.monotonic() - _uncaught[1] > _SETTLE_S:
                    _end_for(_uncaught[0])       # the process's exit, which would have ended the job, is held up
                now = time.monotonic()
                if now - answered_at >= _ANSWER_EVERY:
                    answered_at = now
                    with _watches_lock:
                        answerers = list(_roll_call_answerers)
                    for context in answerers:
                        _answer_roll_calls(context)
                with _watches_lock:
                    watches = list(_watches)
                for watch in watches:
                    started = watch.started
                    if not started:
                        continue
                    context = watch.owner.context()
                    limit = _deadline(context)
                    if limit and watch.started == started and (now - started > limit or _roll_call_heard(context)):
                        _expired(watch.owner, context, watch.collective, min(limit, now - started), watch.causes)
                if _fast_paths or _numbered:
                    in_fast_calls = _fast_calls_seen(in_fast_calls, now)
        except Exception as error:  # noqa: BLE001 - the watchdog must outlive anything it sees
            print(f"mpicoll: rank {MPI.COMM_WORLD.Get_rank()}: watchdog: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)


def _stop_before_mpi_finalizes() -> None:
    global _finalizing
    with _calls_lock:
        _finalizing = True


atexit.register(_stop_before_mpi_finalizes)    # mpi4py's own exit hook, which finalizes MPI, runs after it


def _deadline(context) -> float:
    """Seconds a call in flight may take: its context's timeout, else MPICOLL_TIMEOUT's.  A malformed setting
    is the calling thread's to report (it raises there, once, naming the setting): here it is the default's,
    where reading it every look would print the same error ten times a second."""
    if context is not None:
        return context.timeout
    try:
        return config.timeout()
    except ValueError:
        return config.DEFAULT_TIMEOUT


def _fast_calls_seen(before: dict, now: float) -> dict:
    """The fast paths' calls in flight now (frames of :func:`watch_calls_of`'s functions, numbers of
    :func:`watch_numbered_calls_of`'s callers), each with when it was first seen (from ``before``) and its owner
    and collective; one in flight past its owner's timeout ends the job."""
    seen = {}
    for frame in sys._current_frames().values() if _fast_paths else ():
        if frame.f_code in _fast_paths:
            entry = before.get(frame)
            if entry is None:
                names = frame.f_locals
                entry = (now, names["owner"], names["name"])
            seen[frame] = entry
    with _watches_lock:
        numbered = list(_numbered)
    for caller in numbered:
        number = caller.in_flight
        if number:
            seen[caller, number] = before.get((caller, number)) or (now, caller.owner, caller.collective)
    for first, owner, collective in seen.values():
        context = owner.context()
        limit = _deadline(context)
        if limit and (now - first > limit or _roll_call_heard(context)):
            _expired(owner, context, collective, min(limit, now - first))
    return seen


def _roll_call_heard(context) -> bool:
    """Whether another survivor holds a roll call on the channel of a call stuck here in MPI's own wait: it gave
    up on that call, and this rank answers now rather than at its own deadline, by which time the other may have
    stopped listening and named this live rank lost (as :meth:`Context._poll`'s waits join it)."""
    return context is not None and _on_the_channel(context.roll_call_heard, False)


def _answer_roll_calls(context) -> None:
    _on_the_channel(context.answer_roll_calls)


def _on_the_channel(look, default=None):
    """``look()``, a look from this thread at a context's channel; ``default`` where MPI allows no calls from two
    threads, or where the channel was revoked for a death (that is MPI's to report, in the call itself)."""
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return default
    try:
        return look()
    except MPI.Exception:
        return default


def _hear_failures() -> None:
    status = MPI.Status()
    try:
        if not _guard.Iprobe(MPI.ANY_SOURCE, Tag.JOB_FAILED, status):
            return
    except MPI.Exception as error:      # under ULFM, a rank died: that is no note; listen to the living
        if not failure.is_process_failure(error):
            raise
        _guard.Ack_failed()
        return
    data = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    _guard.Recv([data, MPI.BYTE], status.Get_source(), Tag.JOB_FAILED)
    note = data.tobytes().decode(errors="replace")      # "failed: <error>" or "ends the job: <why>"
    sys.stdout.flush()
    print(f"mpicoll: rank {MPI.COMM_WORLD.Get_rank()} stops: rank {status.Get_source()} {note}", file=sys.stderr,
          flush=True)
    time.sleep(5 * _SETTLE_S)        # the telling rank ends the job meanwhile; if it cannot, this one does
    MPI.COMM_WORLD.Abort(FAILED_EXIT_CODE if note.startswith("failed:") else failure.EXIT_CODE)


def _expired(owner, context, collective: str, limit: float, causes: str | None = None) -> None:
    """A blocking MPI call outlived its deadline (``limit``, or less where another rank's roll call came first):
    name the missing ranks and end the job."""
    cut_short = context is not None and limit < context.timeout
    limit = limit if not cut_short else round(limit, 1)
    rank = MPI.COMM_WORLD.Get_rank()
    reason = None
    if context is not None and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        try:
            # MPI's dead are named without a roll call, which a channel revoked for them fails (met: the failure
            # was printed at every look and the job never ended: a one-sided unlock toward a rank cut off)
            missing, sure = context.missing(context.others(), trust_mpi=True)
            caller = _on_the_channel(context.roll_caller) if cut_short else None
            if caller is not None and context.names[caller] in missing:
                # the rank whose roll call cut this wait short gave up first and is ending the job (so it did not
                # answer this one's): it is no missing peer, and where it is the only one, this rank was late
                missing = [peer for peer in missing if peer != context.names[caller]]
            if caller is not None and not missing:
                reason = (f"{collective} (MPI's own): rank {context.names[caller]} gave up waiting on this "
                          f"communicator past its timeout and ends the job; rank {context.names[context.rank]} "
                          "came late to its call (computing, or in other calls): raise MPICOLL_TIMEOUT if a rank "
                          "is just slow")
            else:
                reason = str(context.broken_by(CollectiveTimeout(
                    f"{collective} (MPI's own)", context.names[context.rank], missing, limit, some_of=not sure,
                    also_silent=context.silent_seen, alive_outside=context.outside_seen, causes=causes,
                    cut_short=cut_short)))
        except Exception:  # noqa: BLE001 - naming the missing must never keep the job from ending
            pass
    if reason is None:
        comm = getattr(owner, "comm", None)
        dead = failure.failed_ranks(comm) if comm is not None and MPI.Query_thread() == MPI.THREAD_MULTIPLE else []
        who = (f"rank(s) {', '.join(map(str, dead))}, which the MPI library reports dead" if dead else
               "a peer that never took part (dead, hung, or stopped on an error of its own: see its output)")
        reason = (f"{collective}: rank {rank} waited {limit:g} s in MPI's own blocking call for {who}; "
                  "raise MPICOLL_TIMEOUT if a peer is just slow")
    failure.end_job(f"{reason} (MPI's blocking call cannot be interrupted: the job ends)", settle=_SETTLE_S * 2)
