"""Run mpi4py's own collective tests with every communicator replaced by an ``mpicoll.Communicator``.

One rank of ``scripts/conformance`` (which downloads the tests and launches
this under ``mpiexec -n N``).  For each algorithm of the registry, in turn:
``MPI.COMM_WORLD`` and ``MPI.COMM_SELF`` become ``mpicoll.Communicator``s
with that algorithm (so do the ``Dup()``s the tests make of them), mpi4py's
test modules are imported afresh (their test classes read the communicators
when they are defined), and ``test_cco_buf``, ``test_msgzero`` and
``test_op.TestOp.testCreate`` run under unittest.  Each test has a watchdog:
past ``--timeout`` seconds it prints which rank is stuck in which test, with
every thread's traceback, and aborts the job.

The tests are mpi4py's authors' code, read from the download, never copied
here.  As mpi4py's own runner does by default, the CuPy and Numba array
backends of its ``arrayimpl`` are left out unless a GPU is present.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import sys
import threading
import time
import traceback
import unittest
from xml.sax.saxutils import quoteattr

from mpi4py import MPI

MODULES = ("test_cco_buf", "test_msgzero", "test_op")
ONLY = {"test_op": ["TestOp.testCreate"]}      # of test_op, the case that reduces over a communicator
WORLD, SELF = MPI.COMM_WORLD, MPI.COMM_SELF
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


class _Watched(unittest.TextTestResult):
    """A result that aborts the whole job when one test runs past the limit."""

    limit = 120.0

    def startTest(self, test):
        def stuck():
            sys.stderr.write(f"\n[rank {RANK}] stuck in {test.id()} for {self.limit:g} s; tracebacks follow, "
                             "then the job is aborted\n")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            time.sleep(0.5)
            WORLD.Abort(70)

        self._timer = threading.Timer(self.limit, stuck)
        self._timer.daemon = True
        self._timer.start()
        super().startTest(test)

    def stopTest(self, test):
        self._timer.cancel()
        super().stopTest(test)


def _suite(modules) -> unittest.TestSuite:
    """mpi4py's test modules, imported afresh so their classes see the patched communicators."""
    loader, suite = unittest.TestLoader(), unittest.TestSuite()
    for entry in modules:                   # "module", or "module.TestCase" for one class of it
        name, _, case = entry.partition(".")
        sys.modules.pop(name, None)
        module = importlib.import_module(name)
        if case or name in ONLY:
            suite.addTests(loader.loadTestsFromNames([case] if case else ONLY[name], module))
        else:
            suite.addTests(loader.loadTestsFromModule(module))
    return suite


def _count_calls(algorithm) -> dict:
    """Count the calls that reach ``algorithm``'s own code (proof that mpicoll ran, not mpi4py)."""
    counts = {"calls": 0}
    for method in ("allreduce", "reduce_scatter_block", "allgather", "bcast"):
        original = getattr(algorithm, method)

        def counted(*args, _original=original, **kwargs):
            counts["calls"] += 1
            return _original(*args, **kwargs)
        setattr(algorithm, method, counted)
    return counts


def run(name: str, verbosity: int, modules=MODULES) -> dict:
    import mpicoll
    import mpicoll.collectives.algorithms as registry
    counts = {"calls": 0}
    for algorithm in registry.REGISTRY.values():
        algorithm.__dict__.clear()                       # forget the previous round's counters
    if name != "auto":
        counts = _count_calls(registry.get(name))
    else:
        counters = [_count_calls(a) for a in registry.REGISTRY.values()]
    MPI.COMM_WORLD = mpicoll.Communicator(WORLD, algorithm=name)
    MPI.COMM_SELF = mpicoll.Communicator(SELF, algorithm=name)
    try:
        stream = sys.stderr if verbosity and RANK == 0 else open("/dev/null", "w")
        runner = unittest.TextTestRunner(stream=stream, verbosity=verbosity, resultclass=_Watched)
        result = runner.run(_suite(modules))
    finally:
        for comm in (MPI.COMM_WORLD, MPI.COMM_SELF):
            comm.close()
        MPI.COMM_WORLD, MPI.COMM_SELF = WORLD, SELF
    if name == "auto":
        counts = {"calls": sum(c["calls"] for c in counters)}
    failures = [(test.id(), text) for test, text in result.failures + result.errors]
    return {"tests": result.testsRun, "failures": len(result.failures), "errors": len(result.errors),
            "skipped": len(result.skipped), "calls": counts["calls"], "failed": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="the test/ folder of mpi4py's source distribution")
    parser.add_argument("--algorithms", help="comma-separated (default: every registered one, and auto)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test before aborting (120)")
    parser.add_argument("--junitxml", help="write the totals as a JUnit XML report (rank 0)")
    parser.add_argument("--modules", default=",".join(MODULES),
                        help="mpi4py's test modules to run (default: the collective ones); e.g. test_ulfm, MPI's "
                             "fault-tolerance calls through mpicoll's communicators, under mpiexec --with-ft ulfm")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args()
    sys.path.insert(0, args.tests)
    import mpicoll.collectives.algorithms
    from mpicoll import arrays
    if not arrays.gpu_count()[0]:
        sys.modules["cupy"] = sys.modules["numba"] = None     # as mpi4py's runner without --cupy/--numba
    _Watched.limit = args.timeout
    names = args.algorithms.split(",") if args.algorithms else mpicoll.collectives.algorithms.names()
    rows, status = [], 0
    for name in names:
        outcome = run(name, args.verbose, args.modules.split(","))
        everyone = WORLD.gather(outcome)
        if RANK == 0:
            failed = sorted({f"{test} (rank {rank})" for rank, o in enumerate(everyone) for test, _ in o["failed"]})
            calls = sum(o["calls"] for o in everyone)
            bad = sum(o["failures"] + o["errors"] for o in everyone)
            print(f"conformance {SIZE} rank(s) {name:>18}: {outcome['tests']} tests, {bad} failed on some rank, "
                  f"{outcome['skipped']} skipped; {calls} calls ran mpicoll's algorithms")
            for rank, o in enumerate(everyone):
                for test, text in o["failed"]:
                    print(f"--- rank {rank}: {test}\n{text}")
            collectives = {m.partition(".")[0] for m in args.modules.split(",")} & set(MODULES)   # must reach mpicoll
            if outcome["tests"] == 0 or (calls == 0 and name != "mpi" and collectives) or bad:
                status = 1
            rows.append((name, outcome, failed, calls))
        if WORLD.bcast(status):
            status = 1
    if RANK == 0 and args.junitxml:
        _write_junit(args.junitxml, rows)
    return status


def _write_junit(path: str, rows) -> None:
    """One test case per (algorithm, mpi4py test) failure, one passing case per algorithm otherwise."""
    tests = sum(o["tests"] for _, o, _, _ in rows)
    failures = sum(len(f) for _, _, f, _ in rows)
    skipped = sum(o["skipped"] for _, o, _, _ in rows)
    cases = []
    for name, outcome, failed, calls in rows:
        for test in failed:
            cases.append(f'<testcase classname="conformance.{name}" name={quoteattr(test)}>'
                         f'<failure message="failed"/></testcase>')
    with open(path, "w") as out:
        out.write(f'<?xml version="1.0"?><testsuites><testsuite name="mpi4py conformance ({SIZE} ranks)" '
                  f'tests="{tests}" failures="{failures}" errors="0" skipped="{skipped}">{"".join(cases)}'
                  f"</testsuite></testsuites>\n")


if __name__ == "__main__":
    from mpicoll.base import failure
    try:
        code = main()
    except Exception:  # noqa: BLE001 - said, and the status kept, whatever became of the other ranks
        traceback.print_exc()
        code = 1
    if failure.fault_tolerant() and failure.failed_ranks(MPI.COMM_WORLD):
        # a rank died (Open MPI 5.0.11 crashes one now and then in mpi4py's test_ulfm, as it does under mpi4py
        # alone): MPI_Finalize would wait for it forever (a survivor sat there 4 minutes and on); leave without it
        failure.outlived_a_death()
    sys.exit(code)
