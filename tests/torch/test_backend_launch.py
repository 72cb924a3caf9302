"""Starting the "mpicoll" backend as users do: under mpiexec with nothing set, as one process without a launcher,
and refused, before any work, when torch's world is not MPI's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from mpicoll.base.config import cores
from tests.support.jobs import ROOT, command, free_port, launch

pytest.importorskip("torch", reason="the torch extra is not installed")
from mpicoll.torch.backend import ShortWay  # noqa: E402

SCRIPT = """
import torch, torch.distributed as dist, mpicoll.torch
dist.init_process_group("mpicoll")
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
threads = torch.get_num_threads()
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.tolist()} on {threads} threads", flush=True)
dist.destroy_process_group()
"""

# torch's threads after importing Horovod's API (mpicoll.torch with it), and after the program's own choice
THREADS = """
import sys, torch, mpicoll.torch.horovod as hvd
print(f"threads {torch.get_num_threads()}", flush=True)
torch.set_num_threads(1)
hvd.init()
print(f"then {torch.get_num_threads()}", flush=True)
"""


def clean_environment(**extra) -> dict:
    """This environment without torch's rendezvous variables (a launcher's are kept)."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(ROOT), **extra}


def test_under_mpiexec_with_nothing_set():
    """And each of the 3 ranks on this node runs torch on its share of the cores (mpicoll.torch.threads)."""
    result = launch(3, "-c", SCRIPT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # (the launcher may glue two ranks' lines together)
    reports = sorted(re.findall(r"rank (\d) of (\d): (\[[^]]*\]) on (\d+) threads", result.stdout))
    threads = str(max(1, cores() // 3))
    assert reports == [(str(r), "3", "[6.0, 6.0, 6.0]", threads) for r in range(3)], result.stdout


# A program that ends right after its last call, without destroy_process_group (most do): the last call's future
# is still being completed on mpicoll's worker thread, inside torch's C++ code, as the interpreter finalizes
ENDS_AFTER_A_CALL = """
import torch, torch.distributed as dist, mpicoll.torch
dist.init_process_group("mpicoll")
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, t.tolist())
print(f"rank {dist.get_rank()}: {everyone[-1]}", flush=True)
"""


def test_a_program_that_ends_without_destroying_its_group_exits_cleanly():
    """Before the workers were stopped at exit, 4 of 5 such runs aborted on some rank ("terminate called without
    an active exception": Python ended the worker thread inside torch's Future.set_result), mpiexec status 6."""
    for attempt in range(3):
        result = launch(3, "-c", ENDS_AFTER_A_CALL, timeout=120)
        assert result.returncode == 0 and "terminate" not in result.stderr, \
            f"run {attempt + 1}: status {result.returncode}\n{result.stderr[-2000:]}"
        assert result.stdout.count("[6.0, 6.0, 6.0]") == 3, result.stdout


@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ,
                    reason="the user chose torch's threads here")
def test_one_rank_on_a_node_computes_on_all_its_cores():
    """Under a launcher torch alone would take one thread (mpicoll.torch.threads); the program's own
    torch.set_num_threads wins."""
    result = launch(1, "-c", THREADS, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.findall(r"(threads|then) (\d+)", result.stdout) == [("threads", str(cores())), ("then", "1")], \
        result.stdout


def test_torch_threads_the_user_chose_are_kept():
    result = launch(2, "-c", THREADS, env={"OMP_NUM_THREADS": "2"}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.findall(r"threads (\d+)", result.stdout) == ["2", "2"], result.stdout


def test_one_process_without_a_launcher():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                            env=clean_environment(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("rank 0 of 1: [1.0, 1.0, 1.0] on "), result.stdout


def test_a_torch_world_that_is_not_mpis_is_refused_before_any_work():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                            env=clean_environment(RANK="0", WORLD_SIZE="2"), cwd=ROOT)
    assert result.returncode != 0 and "rank 0 of" not in result.stdout
    assert "LaunchMismatch: torch.distributed was given world size 2, but MPI's is 1" in result.stderr, result.stderr


# Rank 1 raises once the group is up; the others are in their next call.  torch's init_process_group has wrapped
# sys.excepthook in its own (which points sys.stderr at a buffer while the hook it found prints).  With a
# thread that is not a daemon and never ends, the process's exit (where the job would end) is held up.
RAISES_ON_RANK_1 = """
import sys, threading, torch, torch.distributed as dist, mpicoll.torch
dist.init_process_group("mpicoll")
assert sys.excepthook.__name__ == "_distributed_excepthook", sys.excepthook     # torch's, around mpicoll's
t = torch.ones(4)
dist.all_reduce(t)
if dist.get_rank() == 1:
    if sys.argv[1] == "stuck":
        threading.Thread(target=threading.Event().wait).start()
    raise ValueError("the loss is not a number on rank 1")
dist.all_reduce(t)
"""


@pytest.mark.parametrize("ranks, exit", [(2, "clean"), (4, "clean"), (2, "stuck")])
def test_an_uncaught_error_on_one_rank_is_printed_and_ends_the_job(ranks, exit):
    """Its traceback (with torch's rank prefix), 'rank 1 ends the job' and, on every other rank, 'rank 1 failed',
    then the job's end with status 1, in seconds.  (mpicoll's hook used to end the job inside torch's, before torch
    wrote the traceback out: the job ended with nothing but MPI_Abort's line.)"""
    start = time.perf_counter()
    result = launch(ranks, "-c", RAISES_ON_RANK_1, exit, env={"MPICOLL_TIMEOUT": "60"}, timeout=120)
    seconds = time.perf_counter() - start
    assert result.returncode == 1 and seconds < 20, (result.returncode, seconds, result.stderr[-3000:])
    assert "[rank1]: Traceback (most recent call last)" in result.stderr, result.stderr[-3000:]
    assert "[rank1]: ValueError: the loss is not a number on rank 1" in result.stderr, result.stderr[-3000:]
    assert "mpicoll: rank 1 ends the job: ValueError: the loss is not a number on rank 1" in result.stderr
    for other in set(range(ranks)) - {1}:
        assert f"mpicoll: rank {other} stops: rank 1 failed: ValueError" in result.stderr, result.stderr[-3000:]


# torch's tutorial ("Writing Distributed Applications") starts its MPI recipe so; accelerate's MPI launch exports
# MASTER_ADDR and MASTER_PORT, and RANK only later, inside Accelerator()
TUTORIAL = """
import sys, torch, torch.distributed as dist, mpicoll.torch
if sys.argv[1] == "tutorial":
    dist.init_process_group("mpicoll", rank=0, world_size=0)
else:
    dist.init_process_group("mpicoll")
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.tolist()}", flush=True)
"""


@pytest.mark.parametrize("how", ["tutorial", "master only"])
def test_rank_and_size_come_from_mpi_where_the_launcher_gave_only_the_master(how):
    """MASTER_ADDR and MASTER_PORT set, no RANK: rank and size are MPI's (they were handed to torch's env://,
    which wanted RANK; and world_size=0 gave "TCPStore world size cannot be 0")."""
    env = clean_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([*command(3), sys.executable, "-c", TUTORIAL, how], capture_output=True, text=True,
                            timeout=120, env=env, cwd=ROOT, start_new_session=True)
    assert result.returncode == 0, result.stderr[-2000:]
    reports = sorted(re.findall(r"rank (\d) of (\d): (\[[^]]*\])", result.stdout))
    assert reports == [(str(r), "3", "[6.0, 6.0, 6.0]") for r in range(3)], result.stdout


# A small blocking all_reduce of a group with a timeout, once the group's first calls have set it on the short
# way (the backend's Worker.reduce_now), that rank 1 joins only after rank 0 gave up on it
LATE_SMALL_CALL = """
import sys, time, datetime, torch, torch.distributed as dist, mpicoll, mpicoll.torch
dist.init_process_group("mpicoll")
group = dist.new_group(timeout=datetime.timedelta(seconds=2))
t = torch.ones(5)
for _ in range(3):
    dist.all_reduce(t, group=group)
dist.broadcast(t, 0, group=group)               # (the group's last call before: not what the error names)
short = 0 < t.nbytes < group._straight_below and (group._compiled is not None) == (sys.argv[1] == "c")
if dist.get_rank() == 0:
    start = time.monotonic()
    try:
        dist.all_reduce(t, group=group)
        said = "no error"
    except mpicoll.CollectiveTimeout as error:
        said = str(error)
    waited = time.monotonic() - start
    try:
        dist.all_reduce(t, group=group)
        then = "ran"
    except mpicoll.MpicollError as error:
        then = str(error)
    print(f"rank 0: short {short}, waited {waited:.1f} s: {said} || then: {then}", flush=True)
dist.barrier()
if dist.get_rank() != 0:
    dist.all_reduce(t, group=group)             # (what rank 0's abandoned call waits for: MPI finalizes cleanly)
w = torch.ones(1)
dist.all_reduce(w)
print(f"rank {dist.get_rank()}: world {w.item()}", flush=True)
"""


@pytest.mark.parametrize("way", ["c", "python"])
def test_a_small_call_past_the_groups_timeout_raises_on_the_waiting_rank_and_the_job_goes_on(way):
    """Rank 0's all_reduce of 20 bytes, on the short way of small blocking calls, raises a CollectiveTimeout in
    torch's words within the group's 2 s (and the roll call after it), naming the call (not the broadcast before
    it) and rank 1; the group refuses its later calls, the job's default group goes on.  On the compiled short
    way and on its Python twin (MPICOLL_FAST_PATH)."""
    if way == "c" and ShortWay is None:
        pytest.skip("the compiled short way was not built here (no C compiler at install)")
    result = launch(2, "-c", LATE_SMALL_CALL, way, timeout=120,
                    env={"MPICOLL_TIMEOUT": "60", "MPICOLL_END_BROKEN_JOBS": "0", "MPICOLL_FAST_PATH": way})
    assert result.returncode == 0, result.stderr[-3000:]
    report = re.search(r"rank 0: short (\w+), waited ([\d.]+) s: (.*) \|\| then: (.*)", result.stdout)
    assert report, result.stdout[-2000:] + result.stderr[-2000:]
    short, waited, said, then = report.groups()
    assert short == "True" and 2 <= float(waited) < 15, report.group(0)
    assert said.startswith("Allreduce: Timed out after 2 s (the group's timeout).") and "rank(s) 1" in said, said
    assert "not run, because an earlier" in then, then
    assert sorted(re.findall(r"rank (\d): world 2.0", result.stdout)) == ["0", "1"], result.stdout[-2000:]
