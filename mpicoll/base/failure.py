"""What a process does when its job cannot go on: end the whole job, saying why, instead of hanging.

After a peer is lost, MPI offers no way to finish cleanly: ``MPI_Finalize``
waits for every rank, the lost one included, so survivors that merely return
hang at exit.  :func:`end_job` prints the reason once and calls ``MPI_Abort``,
which ends every rank of the job (under fault tolerance the ranks take turns: see :func:`end_job`).  A communicator that breaks (a
:class:`mpicoll.CollectiveTimeout` or a lost peer) arranges for this to
happen at exit (``MPICOLL_END_BROKEN_JOBS=0`` turns that off, e.g. for test
harnesses that let ranks fail on purpose), so a program that catches the error
and returns still ends; one that can do better calls :func:`end_job` itself.

Under MPI's fault-tolerance extension (ULFM: Open MPI started with
``--with-ft ulfm``) a job can do better than end: a call that meets a dead
peer fails with ``MPI_ERR_PROC_FAILED`` (:func:`is_process_failure`), and
:func:`revoke_and_shrink` stops every survivor's wait on the communicator and
agrees with them on a communicator of the survivors.  Where MPI has no fault
tolerance (MPICH: its ULFM calls are stand-ins) it answers None, and the job
ends as above.

A process that dies on another node is a hazard of its own: once MPICH's UCX
transport has seen the connection to it close, a send to that rank crashes the
sender (a segmentation fault inside ``MPI_Isend``).  :func:`failed_ranks` asks
the MPI library which ranks it knows to be gone (``MPIX_Comm_get_failed``, in
MPICH and Open MPI), so that no one sends to them.

A cut link looks, from each side, like the other side's death: were both sides
to shrink and go on, two halves of one job would train apart and write one log
and one checkpoint.  :func:`check_quorum` lets only one side go on.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import signal
import socket
import sys
import threading
import time

from mpi4py import MPI

from . import config, timeline
from .errors import MpicollError

__all__ = ["end_job", "hold_if_ending", "on_ending", "end_at_exit", "tell_others_with", "failed_ranks", "fault_tolerant", "is_process_failure", "acknowledge",
           "meet_survivors", "revoke", "is_revoked", "revoke_and_shrink", "job_ranks", "has_quorum", "check_quorum",
           "outlived_a_death", "end_after_losing"]

EXIT_CODE = 70          # EX_SOFTWARE: what mpiexec returns for a job ended this way
_SETTLE_S = 2.0
_FORWARD_S = 0.3
_ABORT_TURN_S = 0.5     # under fault tolerance, between one rank's MPI_Abort and the next rank's (end_job)
_ABORT_TURNS = 8        # at most this many turns: later ranks abort together at the last
_TOLD_S = 1.0           # after telling the other ranks why (end_job): time for them to print it
ending = threading.Event()      # set once end_job has begun: the job is ending (hold_if_ending)
_on_ending: list = []           # hooks end_job calls as it begins (on_ending)
_reasons: list[str] = []
_lost: set[int] = set()  # the world ranks that end_at_exit's reasons name as lost: no last word goes to them
_tell_others = None     # tell(note, lost): what mpicoll.channel.watchdog.guard_job sets (tell_others_with)


def end_job(reason: str, code: int = EXIT_CODE, settle: float = 0.0, note: str | None = None) -> None:
    """Print ``reason`` (naming this rank) and end every rank of the job with ``MPI_Abort``, ``settle``
    seconds later (time for other ranks to print their own reasons).

    Where the job is guarded (:func:`mpicoll.guard_job`), every other rank is first told why, and prints it
    (``note``, default "ends the job: <reason>"): a rank still computing, or whose own wait began seconds
    later, would otherwise be ended before it could say what was lost.  Not told: the ranks MPI knows dead
    and those :func:`end_at_exit` was told are lost (dropped workers); a rank merely silent (hung, cut off,
    or computing still) is told, for it may be alive.

    Under fault tolerance the ranks abort one at a time, the lowest living rank first and each next one
    :data:`_ABORT_TURN_S` later: Open MPI's launcher started with ``--with-ft ulfm`` hangs, with every rank
    gone, in about 1 of 4 jobs whose ranks call ``MPI_Abort`` at the same moment (and returned 0 in some;
    measured here with 4 ranks, docs/elastic.md; MPICH and Open MPI without it never did).  The first
    abort ends the others during their wait; a rank hung before it came here leaves the next its turn.  The
    last living rank (every other one known dead) leaves with ``code`` instead: its ``MPI_Abort`` ended the
    job with status 0."""
    ending.set()                    # a call of this process that returns now does not return to the program
    for hook in _on_ending:
        hook()
    sys.stdout.flush()
    print(f"mpicoll: rank {MPI.COMM_WORLD.Get_rank()} ends the job: {reason}", file=sys.stderr, flush=True)
    timeline.write_own()            # MPI_Abort skips the exit hooks that would write the whole trace
    try:
        told = _tell_others is not None and _tell_others(note or f"ends the job: {reason}", _lost)
    except Exception:  # noqa: BLE001 - the job ends whatever telling the others met (a dead peer, a broken channel)
        told = False
    # The launcher tears its output forwarding down as it ends the job: give the line time to get through
    # (once in a CI run of tests/train/test_faults.py, a job ended by MPI_Abort had printed nothing on stderr).
    time.sleep(max(settle, _TOLD_S if told else _FORWARD_S))
    if fault_tolerant():
        if _last_living():
            os._exit(code)          # MPI_Abort of the last living rank ends Open MPI's ULFM job with status 0
        time.sleep(_abort_turn() * _ABORT_TURN_S)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)                  # not reached where MPI_Abort ends the process, as it should


def on_ending(hook) -> None:
    """Call ``hook()`` when :func:`end_job` begins (the compiled fast path's switch to :func:`hold_if_ending`)."""
    _on_ending.append(hook)


def hold_if_ending() -> None:
    """Where this process is ending its job (:func:`end_job`, in another thread: the watchdog's, on a call stuck
    past its deadline), never return: a call that completes meanwhile (its late peer came) would otherwise hand
    its result to a program that was told the job ends, and the program went on to its next calls."""
    while ending.is_set():
        time.sleep(1.0)             # (until end_job's MPI_Abort, or its os._exit, ends the process)


def _last_living() -> bool:
    """Whether MPI knows every other rank of the job dead: nothing is left to abort, and Open MPI's launcher
    started with ``--with-ft ulfm`` reports a job ended so as a success (exit status 0 for ``MPI_Abort(70)``,
    measured at 2 ranks, one SIGKILLed; the process's own exit status is passed on)."""
    world = MPI.COMM_WORLD
    return len(failed_ranks(world)) == world.Get_size() - 1


def _abort_turn() -> int:
    """This rank's place among the ranks of the job not known dead (at most :data:`_ABORT_TURNS`)."""
    world, dead = MPI.COMM_WORLD, set(failed_ranks(MPI.COMM_WORLD))
    return min(sum(1 for rank in range(world.Get_rank()) if rank not in dead), _ABORT_TURNS)


def tell_others_with(tell) -> None:
    """From now on :func:`end_job` first calls ``tell(note, lost)``, which sends ``note`` to every other rank
    of the job but the world ranks ``lost`` and answers whether it sent any (the watchdog's guard channel:
    :mod:`mpicoll.channel.watchdog`, a layer above this one)."""
    global _tell_others
    _tell_others = tell


def end_at_exit(reason: str, lost=()) -> None:
    """End the job when this process exits, unless turned off by ``MPICOLL_END_BROKEN_JOBS=0``; ``lost``: the
    world ranks the reason names as lost (:func:`end_job` tells them nothing)."""
    try:
        wanted = config.end_broken_jobs()
    except ValueError as error:         # on the way out of another error: say so, never replace that error
        print(f"mpicoll: {error}; ending the job as with 1", file=sys.stderr, flush=True)
        wanted = True
    if not wanted:
        return
    if not _reasons:
        atexit.register(_at_exit)          # after mpi4py's own hook: runs before MPI_Finalize
    _reasons.append(reason)
    _lost.update(lost)


def _at_exit() -> None:
    if _reasons and MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(_SETTLE_S)          # the other survivors time out about now: let them report first
        end_job(_reasons[0])


def failed_ranks(comm: MPI.Comm) -> list[int]:
    """The ranks of ``comm`` that the MPI library knows to have died, in order.

    Known only where the launcher reports dead processes (MPICH's Hydra under
    ``-disable-auto-cleanup``, Open MPI's with ULFM); empty where the library
    has no ``MPIX_Comm_get_failed`` or cannot answer.  A hung or cut-off rank is
    not dead: only a roll call finds those.
    """
    get_failed = _get_failed()
    if get_failed is None or comm == MPI.COMM_NULL:
        return []
    handle_type = get_failed.argtypes[1]._type_
    group_handle = handle_type()
    try:
        if get_failed(comm.handle, ctypes.byref(group_handle)) != MPI.SUCCESS:
            return []
    except (ctypes.ArgumentError, OSError):
        return []
    failed = MPI.Group.fromhandle(group_handle.value or 0)
    try:
        if failed == MPI.GROUP_NULL or failed.Get_size() == 0:
            return []
        group = comm.Get_group()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group)
        group.Free()
        return sorted(rank for rank in ranks if rank != MPI.UNDEFINED)
    finally:
        if failed != MPI.GROUP_NULL and failed != MPI.GROUP_EMPTY:
            failed.Free()


@functools.cache
def _get_failed():
    """``MPIX_Comm_get_failed`` from the MPI library this process loaded, typed for its handles; None if
    the library lacks it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi." in line or "/libmpi_" in line}
    except OSError:                     # not Linux: look the symbol up among the loaded libraries
        paths = {None}
    # Handles are ints in MPICH and its derivatives, pointers in Open MPI.
    handle_type = ctypes.c_uint if MPI._sizeof(MPI.Comm) == ctypes.sizeof(ctypes.c_uint) else ctypes.c_void_p
    for path in sorted(paths, key=str):
        try:
            function = ctypes.CDLL(path).MPIX_Comm_get_failed
        except (OSError, AttributeError):
            continue
        function.argtypes = [handle_type, ctypes.POINTER(handle_type)]
        function.restype = ctypes.c_int
        return function
    return None


# The error classes of a call that met a dead peer, or a communicator revoked because of one (ULFM).  Where the
# MPI library has none, mpi4py's stand-ins are ERR_UNKNOWN, which says nothing of the kind.
_PROCESS_FAILURES = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                               "ERR_REVOKED") if hasattr(MPI, name)) - {MPI.ERR_UNKNOWN}


def fault_tolerant() -> bool:
    """Whether this job was started with MPI's fault tolerance on: Open MPI's ``mpiexec --with-ft ulfm``
    says so to its processes in ``OMPI_MCA_mpi_ft_enable``.  (Parts of MPI that are not made to outlive a
    death, such as Open MPI's shared-memory windows, are then avoided.)"""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on", "enabled")


def is_process_failure(error: BaseException) -> bool:
    """Whether ``error`` is MPI saying a peer died (or that a survivor revoked the communicator for it)."""
    return isinstance(error, MPI.Exception) and error.Get_error_class() in _PROCESS_FAILURES


def acknowledge(comm: MPI.Comm) -> list[int]:
    """ULFM: acknowledge the deaths MPI has reported on ``comm`` and return every rank of it known dead.

    For a caller that goes on with the living without shrinking (a parameter server drops a dead worker):
    once acknowledged, receives from any source work again, and only requests that involve the dead fail.
    Where MPI has no fault tolerance there is nothing to acknowledge; the dead are still those
    :func:`failed_ranks` knows.
    """
    try:
        comm.Ack_failed()
    except (NotImplementedError, AttributeError, MPI.Exception):
        pass
    return failed_ranks(comm)


def meet_survivors(comm: MPI.Comm, saw_a_loss: bool = False) -> bool:
    """ULFM: wait until every living rank of ``comm`` has come here too (an agreement among the survivors);
    returns whether any of them ``saw_a_loss``.

    Collective over the survivors.  A process that outlived a death leaves without ``MPI_Finalize``
    (:func:`outlived_a_death`), and a message it sent that was not yet taken in is lost with it: a rank still
    receiving would see its sender die.  Meeting here first means every survivor has taken in what it was
    waiting for; and a survivor that never heard of the death learns of it here.  Where MPI has no fault
    tolerance nothing is waited for, and only this rank's ``saw_a_loss`` is known.
    """
    acknowledge(comm)
    try:
        return not comm.Agree(int(not saw_a_loss))
    except (NotImplementedError, AttributeError):
        return saw_a_loss
    except MPI.Exception as error:          # a death not yet acknowledged here: the agreement still completed
        if not is_process_failure(error):
            raise
        return True


def revoke(comm: MPI.Comm) -> bool:
    """ULFM: revoke ``comm``, so that every survivor's pending and later calls on it fail at once instead of
    waiting for the dead.  True once it is revoked (by this call, or by a survivor before); False where MPI has
    no fault tolerance (its revoke is missing, or refuses: MPICH's stand-ins raise NotImplementedError)."""
    try:
        comm.Revoke()
    except (NotImplementedError, AttributeError):
        return False
    except MPI.Exception as error:
        return is_process_failure(error)         # revoked already is fine; "no fault tolerance" is not
    return True


def is_revoked(comm: MPI.Comm) -> bool:
    """ULFM: whether a survivor has revoked ``comm`` (a local flag, about 0.1 us to read); False where MPI has no
    fault tolerance.  For waits that make no call on ``comm`` (data landing in a window), which MPI cannot fail."""
    try:
        return bool(comm.Is_revoked())
    except (NotImplementedError, AttributeError, MPI.Exception):
        return False


def revoke_and_shrink(comm: MPI.Intracomm, also=()) -> tuple[MPI.Intracomm, list[int]] | None:
    """ULFM: revoke ``comm`` and the communicators in ``also`` (every survivor's pending and later calls on them
    fail at once instead of waiting for the dead), then shrink ``comm`` with the other survivors: (the
    survivors' communicator, the ranks of ``comm`` that are gone), the same on every survivor.

    Collective over the survivors of ``comm``: each must come here (a revoked communicator sends every one of
    them to this path on its next call).  None where MPI has no fault tolerance (its revoke is missing, or
    refuses: MPICH's stand-ins raise NotImplementedError), and then nothing was revoked.
    """
    if not revoke(comm):
        return None
    for other in also:
        try:
            if other != MPI.COMM_NULL:
                other.Revoke()
        except MPI.Exception:
            pass
    survivors = MPI.Intracomm(comm.Shrink())
    mine, theirs = comm.Get_group(), survivors.Get_group()
    try:
        kept = MPI.Group.Translate_ranks(theirs, list(range(theirs.Get_size())), mine)
    finally:
        mine.Free()
        theirs.Free()
    return survivors, sorted(set(range(comm.Get_size())) - set(kept))


def job_ranks(comm: MPI.Comm) -> list[int]:
    """The ranks in the job (``MPI.COMM_WORLD``) of ``comm``'s members, in ``comm``'s rank order; local (after a
    shrink, who survived: the same on every survivor)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


# (host, pid, start time) of every rank of the job, by its rank: gathered by note_processes while all live
_processes: list[tuple[str, int, str]] | None = None


def _started(pid: int) -> str:
    """When process ``pid`` started (Linux: /proc/PID/stat's field 22, in clock ticks since boot; "" where there
    is no /proc): told apart from a later process given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


def note_processes(comm: MPI.Comm) -> None:
    """Gather every rank's host, pid and start time (collective over the job's ranks, while all live), for
    :func:`end_lost_processes`."""
    global _processes
    _processes = comm.allgather((socket.gethostname(), os.getpid(), _started(os.getpid())))


def end_lost_processes(lost: list[int], survivors: list[int]) -> list[int]:
    """SIGKILL the processes of ranks MPI declared ``lost`` that still run on this host, and return their ranks.

    A rank stopped (SIGSTOP) or hung outside MPI is taken for dead by the failure detector, and the survivors
    finish without it, but the launcher waits for every process it started: ``mpiexec`` never returned (and,
    resumed, the rank printed Open MPI's abort with its C backtrace).  The first survivor on the lost rank's
    host ends it (the process it gathered, not a later one given the same pid).  A lost rank on a host with no
    survivor is out of reach: the launcher there still waits for it."""
    me = MPI.COMM_WORLD.Get_rank()
    if _processes is None:
        return []
    host = _processes[me][0]
    if me != min(rank for rank in survivors if _processes[rank][0] == host):
        return []
    ended = []
    for rank in lost:
        where, pid, started = _processes[rank]
        if where != host or not started or _started(pid) != started:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        ended.append(rank)
    return ended


def has_quorum(survivors: list[int], members: list[int]) -> bool:
    """Whether ``survivors`` may go on without the rest of ``members`` (ranks of the job): more than half of
    them, or exactly half with the first.  (A crash of half the ranks, the first's half among them, stops a
    job too: it cannot be told from a cut.)"""
    return 2 * len(survivors) > len(members) or (2 * len(survivors) == len(members) and members[0] in survivors)


def check_quorum(survivors: list[int], members: list[int]) -> None:
    """Raise :class:`~mpicoll.MpicollError`, saying this side of a possible cut stops, unless ``survivors`` (after
    a shrink: :func:`job_ranks`) have the quorum among ``members`` (before it); call it before any call on the
    survivors' communicator, so that a side that stops builds nothing there."""
    if not has_quorum(survivors, members):
        lost = sorted(set(members) - set(survivors))
        raise MpicollError(f"cut off from the rest of the job: {len(survivors)} of its {len(members)} ranks "
                           f"({', '.join(map(str, survivors))}) hear each other and not rank(s) "
                           f"{', '.join(map(str, lost))}, which may be alive on the other side of a cut link and go "
                           "on there; this side stops, so that two halves never train apart")


# After a death, Open MPI 5.0's MPI_Finalize may wait forever for the dead in its closing fence (open-mpi/ompi#11404;
# measured here with mpi4py alone, no mpicoll: 2-3 of 10 runs of 4 ranks that lost one and shrank).  A process that
# outlived a death ends at exit without it, with the status it was exiting with: sys.exit is wrapped (at import,
# before any caller can have looked it up) to remember that status, which Python's exit hooks are not told.
_outlived = False
_exit_status = 0
_exit_with = sys.exit


def _remembering_exit(status=None):
    global _exit_status
    _exit_status = status if isinstance(status, int) else 0 if status is None else 1
    _exit_with(status)


sys.exit = _remembering_exit


def outlived_a_death() -> None:
    """This process survived a death under ULFM: at exit, end it without ``MPI_Finalize`` (see above), with the
    status given to ``sys.exit`` (0 if none; ``raise SystemExit(n)`` is not seen), after Python's other exit
    hooks and with its output flushed."""
    global _outlived
    _outlived = True


def end_after_losing(reason: str, lost=()) -> None:
    """A process that finished its part of a job that lost ranks: under ULFM, leave at exit without
    ``MPI_Finalize`` (:func:`outlived_a_death`) with its own status; without fault tolerance ``MPI_Finalize``
    would wait for the dead forever, so end the whole job at exit, saying ``reason`` (:func:`end_at_exit`, told
    the world ranks ``lost``)."""
    if fault_tolerant():
        outlived_a_death()
    else:
        end_at_exit(reason, lost)


def _leave_without_finalize() -> None:
    if _outlived and MPI.Is_initialized() and not MPI.Is_finalized():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        time.sleep(_FORWARD_S)          # the launcher forwards the last lines before it sees the process end
        os._exit(_exit_status)


atexit.register(_leave_without_finalize)       # at import, so it runs after the exit hooks registered later
