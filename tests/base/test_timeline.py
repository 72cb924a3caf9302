"""MPICOLL_TIMELINE: a Chrome trace with every rank's collectives, nonblocking calls and phases."""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import launch

SCRIPT = """
import sys, time, numpy as np
from mpi4py import MPI
import mpicoll
from mpicoll import timeline
comm = mpicoll.Communicator(MPI.COMM_WORLD, algorithm="ring")
x = np.ones(1 << 18)
with timeline.span("my phase", size=x.nbytes):
    comm.Allreduce(MPI.IN_PLACE, x)
request = comm.Iallreduce(MPI.IN_PLACE, x)
timeline.instant("marker")
time.sleep(0.5)                              # computing meanwhile: the worker's thread runs the call
request.Wait()
mpicoll.allreduce(np.ones(3))                # a small call, auto's (MPI's, or the node's): recorded too
comm.close()
"""


def events_of(path) -> list[dict]:
    with open(path) as handle:
        return json.load(handle)["traceEvents"]


def test_every_rank_collectives_waits_and_phases_land_in_one_trace(tmp_path):
    script, trace = tmp_path / "job.py", tmp_path / "trace.json"
    script.write_text(SCRIPT)
    result = launch(3, str(script), env={"MPICOLL_TIMELINE": str(trace)}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    events = events_of(trace)
    for rank in range(3):
        mine = [e for e in events if e.get("pid") == rank]
        names = {e["name"] for e in mine}
        threads = {e["args"]["name"] for e in mine if e["name"] == "thread_name"}
        assert {"my phase", "Allreduce", "marker", "start Iallreduce"} <= names, (rank, names)
        assert {"MainThread", "mpicoll-nonblocking"} <= threads, threads
        reduces = [e for e in mine if e["name"] == "Allreduce"]
        assert {e["args"]["algorithm"] for e in reduces} in ({"ring", "mpi"}, {"ring", "shm"}), reduces
        assert any(e["args"]["bytes"] == 1 << 21 for e in reduces)
        phase = next(e for e in mine if e["name"] == "my phase")
        inside = [e for e in reduces if phase["ts"] <= e["ts"] and e["ts"] + e["dur"] <= phase["ts"] + phase["dur"]]
        assert phase["args"] == {"size": 1 << 21} and inside, (phase, reduces)
    assert not list(tmp_path.glob("trace.json.*")), "left per-rank or temporary files"


def test_training_writes_its_phases(tmp_path):
    pytest.importorskip("sklearn", reason="mpicoll train's default data (the digits) needs the data extra")
    trace = tmp_path / "train.json"
    result = launch(2, "-m", "mpicoll", "train", "--method", "allreduce-ring", "--epochs", "1", "--quiet",
                    env={"MPICOLL_TIMELINE": str(trace)}, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    names = {(e["pid"], e["name"]) for e in events_of(trace) if e["ph"] == "X"}
    assert {(r, n) for r in (0, 1) for n in ("gradient", "Allreduce", "update")} <= names


def test_off_by_default_and_cheap():
    from mpicoll.base import timeline
    assert not timeline.enabled
    assert timeline.span("anything") is timeline.span("else")        # one shared do-nothing context
