"""``mpicoll train --elastic``: a rank killed mid-run (SIGKILL, from outside, once the log shows epoch 2) and the
survivors finish the run, as the log and the summary say; an intact elastic run is the plain run to the bit.

Real jobs of 4 ranks under Open MPI's launcher with fault tolerance (``tests.support.jobs.fault_tolerant``;
skipped where the Open MPI environment is missing).  Steps are slowed (``--delay fixed:MS``) so that the kill
lands inside the run, not after it.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from collections import Counter

import numpy as np
import pytest

from mpicoll.train import METHODS, Options
from mpicoll.train.common import batches
from mpicoll.base.failure import has_quorum
from mpicoll.train.elastic import Loss, Plan, short_timeout_warning
from mpicoll.base import checkpoint
from tests.support.jobs import ROOT, fault_tolerant, kill_rank_when, launch, left_behind

TRAIN = ["-m", "mpicoll", "train", "--epochs", "6", "--batch", "16", "--lr", "0.1", "--quiet"]   # later options win
SLOW = ["--delay", "fixed:8"]       # ms per step: 23 steps an epoch at 4 ranks, about 0.2 s an epoch


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(tmp_path, name: str, *extra: str, kill: int | None = None, after_epoch: int = 2, ranks: int = 4,
          settings: dict | None = None, program: tuple[str, ...] = ("-m", "mpicoll"), kill_with=signal.SIGKILL):
    """Run ``mpicoll train`` with ``extra`` (and environment ``settings``) on ``ranks`` ranks; with ``kill``,
    SIGKILL (``kill_with``) that rank once the log shows ``after_epoch``.  ``program``: what each rank's Python
    runs, given the command line after ``mpicoll``.  (the finished process, the log's records); the process's
    ``killed_at``: when the kill was sent (time.monotonic())."""
    start, env = fault_tolerant(ranks)
    env = {**env, **(settings or {})}
    output = tmp_path / f"{name}.jsonl"
    job = subprocess.Popen([*start, *program, *TRAIN[2:], "--output", str(output), *extra], cwd=ROOT, env=env,
                           text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    if kill is not None:
        kill_rank_when(job, output, kill, f'"epoch": {after_epoch},', kill_with=kill_with)
    job.killed_at = time.monotonic()
    try:
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    job.stdout_text, job.stderr_text = out, err
    left = left_behind(str(output))          # a rank that outlived its job (seen: one waiting in MPI_Finalize)
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert not left, f"ranks left running after the job ended: {left}\n{err[-3000:]}"
    return job, records(output)


def summary_of(logged: list[dict]) -> dict:
    return next(r for r in logged if r.get("summary"))


_intact: dict = {}


def intact(tmp_path_factory, method: str, *extra: str, settings: dict | None = None):
    """The intact elastic run of ``method`` with ``extra`` (slowed like the killed ones), made once per module."""
    if (method, extra) not in _intact:
        job, logged = train(tmp_path_factory.mktemp(method), "intact", "--method", method, "--elastic", *SLOW,
                            *extra, settings=settings)
        assert job.returncode == 0, job.stderr_text[-3000:]
        _intact[method, extra] = logged
    return _intact[method, extra]


_VARIANTS = {
    "plain": ([], None),
    # fp16 with error feedback through owners that round (hierarchical on one node, at every size)
    "compressed": (["--compression", "fp16", "--error-feedback"], {"MPICOLL_AUTO_ALLREDUCE": "hierarchical"}),
    # push-sum through one-sided windows, whose progress thread meets the death too
    "onesided": (["--transport", "onesided"], None),
}


@pytest.mark.parametrize("method, victim, variant", [("allreduce-ring", 2, "plain"), ("sgp", 0, "plain"),
                                                     ("allreduce-auto", 1, "compressed"),   # a worker; the log's writer
                                                     ("sgp", 3, "onesided"), ("diloco", 2, "plain")])
def test_a_killed_rank_is_named_and_the_survivors_finish_as_well_as_an_intact_run(tmp_path, tmp_path_factory,
                                                                                 method, victim, variant):
    extra, settings = _VARIANTS[variant]
    # push-sum over windows sums the same rounds as over messages (an intact run: the same loss to the bit)
    reference = _VARIANTS["plain" if variant == "onesided" else variant]
    logged_intact = intact(tmp_path_factory, method, *reference[0], settings=reference[1])
    saved = ["--checkpoint", str(tmp_path / "ck")] if method in ("sgp", "diloco") else []   # the survivors' files
    killed, logged = train(tmp_path, "killed", "--method", method, "--elastic", *SLOW, *saved, *extra, kill=victim,
                           settings=settings)
    assert killed.returncode == 0, killed.stderr_text[-3000:]
    events = [r for r in logged if r.get("event") == "ranks_lost"]
    assert len(events) == 1 and events[0]["lost"] == [victim] and events[0]["ranks"] == 3, events
    assert events[0]["epoch"] >= 3
    # met when MPI reports the death (or a survivor revokes for it), not when the jobs' MPICOLL_TIMEOUT (20 s) runs
    # out: a survivor whose window waited for a living neighbour gone to shrink waited out the timeout
    killed_at = next(r["time_s"] for r in logged if r.get("epoch") == 2 and not r.get("event"))
    assert events[0]["time_s"] - killed_at < 10, (events, killed_at)
    assert f"lost rank(s) {victim} in epoch" in killed.stderr_text
    assert "Traceback" not in killed.stderr_text, killed.stderr_text[-3000:]      # not even from another thread
    summary, whole = summary_of(logged), summary_of(logged_intact)
    assert summary["ranks"] == 3 and summary["ranks_at_start"] == 4
    if method.startswith("allreduce"):           # SGP's ranks hold parameters of their own; its summary the average
        assert summary["replicas_identical"] is True
    if method == "diloco":                       # the replicas meet every 16 steps: far fewer meetings than steps
        assert 0 < summary["communication"]["meetings"] < summary["samples"] // (16 * 16), summary
    assert [r["epoch"] for r in logged if "epoch" in r and not r.get("event")] == list(range(1, 7))
    # the same sample budget: every epoch still takes the whole training set (the rows of the lost rank too),
    # divided among fewer ranks; an intact epoch takes steps x 4 x 16 >= rows > that - 64 samples
    def per_epoch(logged):
        samples = [0] + [r["samples"] for r in logged if "epoch" in r and not r.get("event")]
        return [b - a for a, b in zip(samples, samples[1:])]
    rows_at_least = per_epoch(logged_intact)[0] - 63
    assert min(per_epoch(logged)) >= rows_at_least, (per_epoch(logged), per_epoch(logged_intact))
    assert abs(summary["final_accuracy"] - whole["final_accuracy"]) <= 0.01, (summary, whole)
    if saved:       # the 3 survivors' files, resumed by a plain run of 3 ranks under MPICH for one more epoch
        assert [checkpoint.stamp(checkpoint.path(tmp_path / "ck", "rank", r), {})["ranks"] for r in range(3)] == \
            [3, 3, 3]
        resumed = launch(3, *TRAIN, "--method", method, "--epochs", "7", "--checkpoint", str(tmp_path / "ck"),
                         "--resume", "--output", str(tmp_path / "resumed.jsonl"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [r["epoch"] for r in records(tmp_path / "resumed.jsonl") if "epoch" in r] == [7]


# mpicoll's command line, with rank DYING killed by a patch of one of mpicoll's steps (a moment too short to hit
# with a kill from outside): the step calls die()
DIE_IN_A_STEP = """
import os, signal, sys, types
from mpicoll.cli import main


def die(*args, **keywords):
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ["OMPI_COMM_WORLD_RANK"] == os.environ["DYING"]:
{patch}
sys.exit(main())
"""
_LAST = {
    # push-sum's drain before the final average (only the end of a run without checkpoints drains)
    "sgp": "    from mpicoll.gossip.pushsum import PushSum; PushSum.drain = die",
    # the checksum of the replicas' final comparison (the module's only use of zlib)
    "allreduce-ring": "    import mpicoll.train.allreduce as run; run.zlib = types.SimpleNamespace(crc32=die)",
}


@pytest.mark.parametrize("method, transport", [("sgp", "p2p"), ("sgp", "onesided"), ("allreduce-ring", "p2p")])
def test_a_rank_killed_as_the_run_ends_is_recovered_from_and_the_survivors_finish_it(tmp_path, tmp_path_factory,
                                                                                   method, transport):
    """Every epoch done, rank 0 (the log's writer) dies in the method's last collective work (SGP's final
    average, the allreduce methods' comparison of the replicas): the survivors recover, do it again among
    themselves, and write the summary.  Two faults were found here: over windows SGP's survivors met the death
    in the average, outside push-sum, and closing push-sum then waited on the dead in a collective free
    (RanksLost out of the recovery, exit 1, 3 of 3 runs); and the rank that took the log over had seen no
    epoch, so the summary said 0 samples.  The log records the loss in epoch 7, one past the run's 6; the
    terminal says the run was ending."""
    script = tmp_path / "die_at_the_end.py"
    script.write_text(DIE_IN_A_STEP.format(patch=_LAST[method]))
    logged_intact = intact(tmp_path_factory, method)
    killed, logged = train(tmp_path, "killed", "--method", method, "--elastic", *SLOW, "--transport", transport,
                           program=(str(script),), settings={"DYING": "0"})
    said = killed.stderr_text
    assert killed.returncode == 0, said[-3000:]
    assert [r["epoch"] for r in logged if "epoch" in r and not r.get("event")] == list(range(1, 7))
    events = [r for r in logged if r.get("event") == "ranks_lost"]
    assert len(events) == 1 and events[0]["lost"] == [0] and events[0]["ranks"] == 3 and events[0]["epoch"] == 7, \
        events
    assert "lost rank(s) 0 after the last epoch, as the run ended; 3 ranks go on" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    summary, whole = summary_of(logged), summary_of(logged_intact)
    assert summary["ranks"] == 3 and summary["ranks_at_start"] == 4
    assert summary["samples"] == whole["samples"], (summary, whole)         # every epoch was whole
    if method == "sgp":         # the average of 3 ranks' parameters, not 4
        assert abs(summary["final_accuracy"] - whole["final_accuracy"]) <= 0.01, (summary, whole)
    else:                       # the replicas, identical, are the intact run's
        assert summary["replicas_identical"] is True and summary["final_loss"] == whole["final_loss"], (summary, whole)


# push-sum over windows: rank DYING dies in its 60th fold (epoch 3), between taking its packets and releasing
# the slot, where the receiver once held its own window exclusively
_IN_A_FOLD = """    import mpicoll.gossip.pushsum as run
    folds = iter(range(60))
    def accumulate(*args):
        next(folds, None) is None and die()
        return real(*args)
    real = run.compute.scaled_accumulate
    run.compute = types.SimpleNamespace(**{**vars(run.compute), "scaled_accumulate": accumulate})"""


def test_a_rank_killed_while_taking_its_packets_locks_no_sender_out(tmp_path):
    """A push-sum rank over windows dies between taking a round's packets and freeing their slot: its senders'
    next accesses to its window must not wait on it.  The receiver held its own window under an exclusive
    lock while it folded the packets in, and a lock left by the dead is never let go: the senders waited out
    the timeout and the job ended (exit 70, "push-sum's one-sided transfer ... waited 20 s for rank(s) 3"; seen
    in CI with a kill from outside, every time with this patch)."""
    script = tmp_path / "die_in_a_fold.py"
    script.write_text(DIE_IN_A_STEP.format(patch=_IN_A_FOLD))
    killed, logged = train(tmp_path, "killed", "--method", "sgp", "--elastic", *SLOW, "--transport", "onesided",
                           program=(str(script),), settings={"DYING": "3"})
    said = killed.stderr_text
    assert killed.returncode == 0, said[-3000:]
    events = [r for r in logged if r.get("event") == "ranks_lost"]
    assert len(events) == 1 and events[0]["lost"] == [3] and events[0]["epoch"] == 3, events
    assert [r["epoch"] for r in logged if "epoch" in r and not r.get("event")] == list(range(1, 7))
    assert "Traceback" not in said, said[-3000:]
    assert summary_of(logged)["ranks"] == 3


def test_a_rank_stopped_for_good_is_ended_once_taken_for_dead_and_the_launcher_returns(tmp_path):
    """Rank 2 is SIGSTOPped once epoch 2 is logged and never resumed: the failure detector takes it for dead
    (about 10 s), the survivors finish, and the launcher returns at once with status 0.  It never returned
    (mpiexec waits for every process it started; the red team's job held its allocation until killed 150 s
    later): now the first survivor on the stopped rank's host ends it, saying so."""
    job, logged = train(tmp_path, "stopped", "--method", "allreduce-ring", "--elastic", *SLOW, kill=2,
                        kill_with=signal.SIGSTOP)
    returned_after = time.monotonic() - job.killed_at
    said = job.stderr_text
    assert job.returncode == 0, said[-3000:]
    assert [r["lost"] for r in logged if r.get("event") == "ranks_lost"] == [[2]]
    assert summary_of(logged)["ranks"] == 3
    assert "rank 2, taken for dead, still ran (stopped or hung outside MPI) on rank 0's host: ended it" in said, \
        said[-3000:]
    # the summary comes a detector's time (10 s) after the stop, the launcher's return within 30 s of it
    assert returned_after < 40, returned_after


def test_a_rank_lost_in_the_checks_before_the_run_is_named_by_every_survivor(tmp_path):
    """Rank 2 dies in the checks every rank makes before training (its options, files, checkpoints): each
    survivor names it in one line and the job ends, nothing trained (was: an uncaught MPI_ERR_PROC_FAILED from
    mpi4py's allgather, its traceback, and no rank named)."""
    script = tmp_path / "die_in_the_checks.py"
    script.write_text(DIE_IN_A_STEP.format(patch="    import mpicoll.train.run as run; run._preflight = die"))
    job, logged = train(tmp_path, "checks", "--method", "allreduce-ring", "--elastic", program=(str(script),),
                        settings={"DYING": "2"})
    said = job.stderr_text
    assert job.returncode != 0 and not [r for r in logged if "epoch" in r], said[-3000:]
    lines = re.findall(r"mpicoll train: rank (\d): the checks before the job starts: rank \d lost rank\(s\) 2: .*"
                       r"start the job again", said)
    assert sorted(lines) == ["0", "1", "3"], said[-3000:]
    assert "Traceback" not in said, said[-3000:]


# A step of 4 ranks in mpicoll.train.elastic.agreed: rank 1's raises an error that is not a loss (what MPI's own
# collectives gave across a cut link: garbage, unpickled into a MemoryError); with argv[2] "dies", rank 3 dies in
# the same step, 0.5 s later (so rank 1's error comes before MPI knows of a death).  Each rank writes its outcome.
ERROR_IN_A_STEP = """
import os, sys, time
from mpi4py import MPI
import mpicoll
from mpicoll.train.elastic import agreed
world = MPI.COMM_WORLD
channel = mpicoll.Communicator(world.Dup())
channel.on_death = "revoke"
try:
    with agreed(channel):
        if world.rank == 1:
            raise MemoryError("as from unpickling garbage")
        if world.rank == 3 and sys.argv[2] == "dies":
            time.sleep(0.5)
            os._exit(1)
    outcome = "whole"
except mpicoll.RanksLost as error:
    outcome = f"RanksLost {error.lost}"
except MemoryError as error:
    outcome = f"MemoryError {error}"
except mpicoll.MpicollError as error:
    outcome = f"MpicollError {error}"
with open(os.path.join(sys.argv[1], f"rank{world.rank}.txt"), "w") as handle:
    handle.write(outcome)
sys.stdout.flush()
os._exit(0)         # the job lost a rank: MPI_Finalize would wait for it
"""


@pytest.mark.parametrize("dies", ["dies", "lives"])
def test_an_error_in_a_step_is_a_loss_only_where_a_rank_died(tmp_path, dies):
    """A rank whose step raised an error that is not a loss joins the step's agreement, which returns once MPI
    has judged every rank: a death meanwhile makes it a loss on every survivor (it was the death's garbage: the
    job ended on a MemoryError across a cut link); without one the error is raised where it happened and the
    others say a rank's step failed (they used to wait in the agreement for ever)."""
    script = tmp_path / "error_in_a_step.py"
    script.write_text(ERROR_IN_A_STEP)
    start, env = fault_tolerant(4)
    job = subprocess.run([*start, str(script), str(tmp_path), dies], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=120)
    outcomes = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in range(4)
                if (tmp_path / f"rank{rank}.txt").exists()}
    if dies == "dies":      # what MPI had named to each (none yet, under load, on one that agreed)
        outcomes = {rank: "RanksLost [3]" if said == "RanksLost []" else said for rank, said in outcomes.items()}
        expected = {rank: "RanksLost [3]" for rank in (0, 1, 2)}
    else:
        expected = {rank: "MpicollError rank {}: another rank's step raised an error that is not a lost rank (its "
                    "own message names it; the agreement's word was 1, not 3); the job ends".format(rank)
                    for rank in (0, 2, 3)}
        expected[1] = "MemoryError as from unpickling garbage"
    assert outcomes == expected, f"{outcomes}\n{job.stderr[-3000:]}"


@pytest.mark.parametrize("ranks, parallel", [(3, []), (4, ["--model-parallel", "2", "--model", "mlp"])])
def test_an_intact_elastic_run_is_the_plain_run(tmp_path, ranks, parallel, method="allreduce-ring"):
    """(The plans' batches are the plain run's, for sgp too: test_an_epochs_plan_is_the_batches_of_a_plain_run;
    this runs both whole, 3 epochs; with --model-parallel 2, two replicas of two stages.)"""
    runs = {}
    for name, extra in (("plain", parallel), ("elastic", ["--elastic", *parallel])):
        job, logged = train(tmp_path, name, "--method", method, "--epochs", "3", *extra, ranks=ranks)
        assert job.returncode == 0, job.stderr_text[-3000:]
        runs[name] = [(r.get("epoch"), r.get("loss", r.get("final_loss")), r.get("samples")) for r in logged]
        # the jobs' MPICOLL_TIMEOUT (20 s) is under 4 detector timeouts: rank 0 says so once, for --elastic only
        assert job.stderr_text.count("warning: MPICOLL_TIMEOUT=20 s is under 4 times") == (name == "elastic"), \
            job.stderr_text[-3000:]
    assert runs["plain"] == runs["elastic"]


def test_below_min_ranks_every_survivor_stops_naming_the_checkpoint(tmp_path):
    job, logged = train(tmp_path, "floor", "--elastic", "--min-ranks", "4", "--checkpoint",
                        str(tmp_path / "ckpt"), *SLOW, kill=3)
    assert job.returncode == 1, job.stderr_text[-3000:]
    said = [line for line in job.stderr_text.splitlines() if "below --min-ranks 4" in line]
    assert len(said) == 3 and all(f"--checkpoint {tmp_path / 'ckpt'} holds" in line for line in said), \
        job.stderr_text[-3000:]
    assert not any(r.get("summary") for r in logged)
    assert (tmp_path / "ckpt.npz").exists()


def test_a_survivor_without_a_quorum_stops_before_it_trains_alone(tmp_path):
    """2 ranks, rank 0 killed: rank 1 is half the job without its first rank, which a cut link shows alike
    (rank 0 may live on the other side), so it stops, saying so, and never writes the log rank 0 wrote."""
    job, logged = train(tmp_path, "half", "--elastic", *SLOW, kill=0, ranks=2)
    said = job.stderr_text
    assert job.returncode != 0, said[-3000:]
    assert "cut off from the rest of the job: 1 of its 2 ranks (1) hear each other and not rank(s) 0" in said \
        and "this side stops" in said, said[-3000:]
    assert not [r for r in logged if r.get("event") or r.get("summary")], logged


def test_a_replica_that_loses_a_stage_stops_and_the_whole_ones_go_on(tmp_path, tmp_path_factory):
    """--model-parallel 2 over 4 ranks: replicas (0, 1) and (2, 3).  Rank 0 killed (a stage, and the log's
    writer): rank 1 stops, replica (2, 3) finishes the epoch budget and writes the log on."""
    parallel = ["--model-parallel", "2", "--model", "mlp"]
    if "mp" not in _intact:
        job, logged = train(tmp_path_factory.mktemp("mp"), "intact", "--elastic", *parallel, *SLOW)
        assert job.returncode == 0, job.stderr_text[-3000:]
        _intact["mp"] = logged
    killed, logged = train(tmp_path, "killed", "--elastic", *parallel, *SLOW, kill=0)
    assert killed.returncode == 0, killed.stderr_text[-3000:]
    events = [r for r in logged if r.get("event") == "ranks_lost"]
    assert len(events) == 1 and events[0]["lost"] == [0] and events[0]["stopped"] == [1] and \
        events[0]["ranks"] == 2, events
    assert "lost rank(s) 0 in epoch" in killed.stderr_text and "rank(s) 1 stop (their replica lost a stage)" in \
        killed.stderr_text, killed.stderr_text[-3000:]
    summary, whole = summary_of(logged), summary_of(_intact["mp"])
    assert summary["ranks"] == 2 and summary["ranks_at_start"] == 4 and summary["replicas_identical"] is True
    assert [r["epoch"] for r in logged if "epoch" in r and not r.get("event")] == list(range(1, 7))
    assert summary["samples"] >= whole["samples"] - 63
    assert abs(summary["final_accuracy"] - whole["final_accuracy"]) <= 0.01, (summary, whole)


def test_a_run_whose_every_replica_lost_a_stage_stops_naming_the_checkpoint(tmp_path):
    job, logged = train(tmp_path, "one", "--elastic", "--model-parallel", "2", "--model", "mlp", "--checkpoint",
                        str(tmp_path / "ck"), *SLOW, kill=1, ranks=2)
    assert job.returncode == 1, job.stderr_text[-3000:]
    assert "mpicoll train: rank 0: every replica lost a stage of its pipeline with rank(s) 1: none can go on; " \
           f"stopped in epoch 3; --checkpoint {tmp_path / 'ck'} holds" in job.stderr_text, job.stderr_text[-3000:]


@pytest.mark.parametrize("method, transport, victim", [("ps-async", "p2p", 2), ("dcasgd", "onesided", 3),
                                                       ("downpour", "p2p", 1)])      # 1: the log's writer
def test_the_parameter_servers_drop_a_killed_worker_and_finish(tmp_path, method, transport, victim):
    """Under fault tolerance a dead worker's failed request is acknowledged, not revoked for: the server drops
    it, as it does without ULFM, and the other workers finish; every survivor leaves cleanly (status 0).  The
    log's writer lost, the next worker writes the summary."""
    job, logged = train(tmp_path, "killed", "--method", method, "--transport", transport, *SLOW, kill=victim)
    assert job.returncode == 0, job.stderr_text[-3000:]
    assert f"[server rank 0] worker rank {victim} died (the MPI library reports its process gone): dropped" in \
        job.stderr_text, job.stderr_text[-3000:]
    summary = summary_of(logged)
    assert summary["workers_lost"] == [victim] and summary["final_accuracy"] > 0.9, summary
    epochs = [r["epoch"] for r in logged if "epoch" in r]
    assert epochs == list(range(1, 7)) if victim != 1 else epochs[:2] == [1, 2] and epochs[-1] == 6, epochs


def test_sandblaster_hands_a_killed_workers_portions_to_the_others_and_ends_as_an_intact_run(tmp_path):
    """L-BFGS on whole batches is deterministic, and the portions of a dead worker are recomputed by the
    others and summed in the same order: the run ends where an intact one does.  Worker 2, killed, wrote the
    log: worker 3 writes the summary."""
    runs = {}
    for name, kill in (("intact", None), ("killed", 2)):
        job, logged = train(tmp_path, name, "--method", "sandblaster-lbfgs", "--delay", "fixed:60", kill=kill)
        assert job.returncode == 0, job.stderr_text[-3000:]
        runs[name] = summary_of(logged)
    assert "[Sandblaster coordinator] worker rank 2 died (the MPI library reports its process gone): lost; its " \
           "portions go to the other 1" in job.stderr_text, job.stderr_text[-3000:]
    assert runs["killed"]["final_loss"] == runs["intact"]["final_loss"], runs
    assert runs["killed"]["workers_lost"] == [2] and runs["killed"]["samples"] == runs["intact"]["samples"], runs


def test_a_killed_server_ends_the_run_on_every_rank_naming_the_last_checkpoint(tmp_path):
    prefix = tmp_path / "ck"
    job, logged = train(tmp_path, "server", "--method", "ps-async", "--servers", "2", "--checkpoint", str(prefix),
                        *SLOW, kill=0)
    assert job.returncode != 0, job.stderr_text[-3000:]
    said = {int(line.split()[3].rstrip(":")): line for line in job.stderr_text.splitlines()
            if line.startswith("mpicoll train: rank ")}
    # the workers hear of it in their exchange, and tell the other server (MPI told it up to 2 s later here)
    assert sorted(said) == [1, 2, 3], job.stderr_text[-3000:]
    # the newest point both servers' files held when the line was written: one they both still hold (the living
    # server stops once told, before a second write could drop it)
    held = set.intersection(*(set(checkpoint.versions(checkpoint.path(prefix, "server", server), {}))
                              for server in (0, 1)))
    named = {rank: re.search(rf"--checkpoint {re.escape(str(prefix))}, holds update (\d+): go on from it", line)
             for rank, line in said.items()}
    assert all(f"rank {rank} lost parameter server rank(s) 0," in said[rank] and found and int(found.group(1)) in held
               for rank, found in named.items()), "\n".join([f"held by both servers' files: {sorted(held)}",
                                                             *said.values()])
    assert not any(r.get("summary") for r in logged)


@pytest.mark.parametrize("dead, living, named", [
    ([90, 180], [90, 180], "holds update 180"), ([90, 180], [180, 270], "holds update 180"),
    ([180, 270], [90, 180], "holds update 180"), ([90], [90, 180], "holds update 90"),
    ([90, 180], [270, 360], "hold no update in common (rank 0: 90, 180; rank 1: 270, 360): the run must start over")])
def test_the_checkpoint_named_after_a_lost_server_is_the_newest_update_every_servers_files_hold(tmp_path, dead, living,
                                                                                               named):
    """What ``--resume`` would take (checks.load_checkpoint_set): not the oldest of the servers' newest files,
    which the one ahead may no longer hold."""
    prefix = tmp_path / "ck"
    for server, points in enumerate([dead, living]):
        for point in points:
            checkpoint.save(checkpoint.path(prefix, "server", server), {}, point, weights=np.full(3, point))
    said = METHODS["ps-async"].last_checkpoint(Options(method="ps-async", servers=2, checkpoint=str(prefix)),
                                               range(2), "update")
    assert named in said and (f"--checkpoint {prefix}" in said), said


def test_a_killed_sandblaster_shard_ends_the_run_on_every_rank_naming_it_and_the_last_checkpoint(tmp_path):
    prefix = tmp_path / "ck"
    job, logged = train(tmp_path, "shard", "--method", "sandblaster-lbfgs", "--delay", "fixed:60", "--checkpoint",
                        str(prefix), kill=1)
    assert job.returncode != 0, job.stderr_text[-3000:]
    said = [line for line in job.stderr_text.splitlines() if line.startswith("mpicoll train: rank ")]
    assert sorted(line.split()[3] for line in said) == ["0:", "2:", "3:"], job.stderr_text[-3000:]
    iteration = checkpoint.stamp(checkpoint.path(prefix), {})["point"]      # the coordinator's: written last
    assert all("lost rank(s) 1: MPI reports the process died" in line and f"the last checkpoint, --checkpoint "
               f"{prefix}, holds iteration {iteration}: go on from it" in line for line in said), said


def test_elastic_without_fault_tolerance_says_what_to_install(tmp_path):
    result = launch(2, "-m", "mpicoll", "train", "--elastic", "--epochs", "1", env={"OMPI_MCA_mpi_ft_enable": ""})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--elastic needs MPI's fault tolerance" in result.stderr and "--with-ft ulfm" in result.stderr
    assert result.stderr.count("--elastic needs") == 1          # said once, by rank 0


@pytest.mark.parametrize("rows, members, batch", [(1437, 4, 16), (10, 3, 4), (5, 4, 32), (2, 2, 1), (97, 1, 8)])
def test_an_epochs_plan_is_the_batches_of_a_plain_run(rows, members, batch):
    plan = Plan.epoch(rows, members, batch, seed=7, epoch=3)
    steps = math.ceil(rows / (members * batch))
    assert plan.steps == steps
    for i in range(members):
        shard = np.arange(rows)[i::members]            # Dataset.shard: every members-th row
        plain = batches(len(shard), batch, steps, [7, i, 3])
        assert all(np.array_equal(mine, shard[theirs]) for mine, theirs in zip(plan.batches[i], plain, strict=True))


@pytest.mark.parametrize("rows, members, batch, done, survivors", [
    (1437, 4, 16, 0, 3), (1437, 4, 16, 7, 3), (1437, 4, 16, 22, 1), (1437, 4, 16, 23, 3),
    (10, 3, 4, 0, 2), (5, 4, 32, 0, 3), (300, 5, 7, 3, 4)])
def test_the_rest_of_an_epoch_is_every_row_not_yet_taken_divided_among_the_survivors(rows, members, batch, done,
                                                                                        survivors):
    plan = Plan.epoch(rows, members, batch, seed=1, epoch=0)
    rest = plan.rest(done, survivors, batch)
    wanted = Counter(int(r) for member in plan.batches for step in member[done:] for r in step)
    taken = Counter(int(r) for member in rest.batches for step in member for r in step)
    assert len(rest.batches) == survivors and not wanted - taken        # every row not yet taken, at least once
    assert sum(taken.values()) - sum(wanted.values()) < survivors * batch   # repeats only to even the steps
    assert all(len(member) == rest.steps and all(len(step) == batch for step in member) for member in rest.batches)


def test_the_learning_rate_schedule_goes_on_from_where_an_epoch_stood_after_a_loss():
    """A whole epoch's progress is the plain run's figure to the bit (schedule.per_step's); the rest of an epoch
    cut at step 7 of 23 starts at 7/23 of it and ends where the epoch ends; a second cut goes on from there."""
    from mpicoll.train import schedule
    plan, epochs = Plan.epoch(1437, 4, 16, seed=1, epoch=2), 6
    plain = schedule.per_step("cosine", 0.1, epochs, plan.steps)
    rate = schedule.parse("cosine", 0.1)
    assert all(rate(plan.progress(2, step, epochs)) == plain(2, step) for step in range(plan.steps))
    rest = plan.rest(7, 3, 16)
    assert math.isclose(rest.progress(2, 0, epochs), (2 + 7 / 23) / epochs)
    assert math.isclose(rest.progress(2, rest.steps, epochs), 3 / epochs)
    again = rest.rest(2, 2, 16)
    assert math.isclose(again.progress(2, 0, epochs), rest.progress(2, 2, epochs))
    assert math.isclose(again.progress(2, again.steps, epochs), 3 / epochs)


@pytest.mark.parametrize("survivors, members, goes_on", [
    ([0, 1, 3], [0, 1, 2, 3], True), ([1, 2, 3], [0, 1, 2, 3], True),     # a death: the rest are the majority
    ([0, 1], [0, 1, 2, 3], True), ([2, 3], [0, 1, 2, 3], False),          # a cut in halves: rank 0's half
    ([3], [0, 1, 2, 3], False), ([1, 3], [1, 3, 4], True), ([4], [1, 3, 4], False), ([0], [0], True)])
def test_only_one_side_of_a_cut_goes_on(survivors, members, goes_on):
    assert has_quorum(survivors, members) is goes_on


def test_a_recovery_that_lost_nobody_is_not_logged_as_a_loss():
    """A step that failed on every rank while the shrink then excluded nobody (seen once in a loaded CI run: a
    "ranks_lost" record with no rank, the terminal saying "lost rank(s)  in epoch ...") is a failed step."""
    nobody, some = Loss([], 3, 4, 4, 0, 1.5), Loss([2, 3], 3, 4, 2, 0, 1.5)
    assert nobody.record()["event"] == "step_failed" and some.record()["event"] == "ranks_lost"
    assert nobody.line(8) == "mpicoll train: a step failed in epoch 3, step 5 and MPI named no rank lost; all 4 " \
                             "ranks take it again"
    assert some.line(8) == "mpicoll train: lost rank(s) 2, 3 in epoch 3, step 5; 2 ranks go on"


@pytest.mark.parametrize("timeout, detector, warns", [
    ("20", None, True), ("39", None, True), ("40", None, False), (None, None, False), ("0", None, False),
    ("20", "2", False), ("20", "6", True), ("20", "five", True)])
def test_a_timeout_the_survivors_of_a_cut_would_not_outlast_is_warned_of(monkeypatch, timeout, detector, warns):
    """MPICOLL_TIMEOUT (default 300 s, 0 forever) against 4 of Open MPI's detector timeouts (default 10 s; a
    setting Open MPI cannot read is its own to name)."""
    for name, value in (("MPICOLL_TIMEOUT", timeout), ("OMPI_MCA_mpi_ft_detector_timeout", detector)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    warning = short_timeout_warning()
    assert (warning is not None) is warns, warning
    if warns:
        assert f"MPICOLL_TIMEOUT={timeout} s" in warning and "OMPI_MCA_mpi_ft_detector_timeout" in warning
