"""The project's own sbatch scripts, submitted to a real Slurm that these tests bring up on this machine.

One node, the machine's cores, Debian's ``slurm-wlm`` and ``munge`` (``scripts/run-tests`` installs them where it
may): a munge daemon and ``slurmctld``/``slurmd`` with a minimal ``slurm.conf`` written into a temporary folder,
on ports of their own, stopped afterwards.  The scripts are submitted exactly as the README says, the shape from
sbatch's options; each test checks that the job ran as one job on the number of ranks Slurm gave it (the failure
these tests exist for: ``srun`` without a PMI that reaches the MPI starts N separate one-rank runs, and the job
"completes").  Skipped, saying why, where the daemons are not installed or this is not root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.jobs import ROOT, free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
pytestmark = [
    pytest.mark.skipif(os.environ.get("MPICOLL_TEST_SLURM", "x") == "", reason="MPICOLL_TEST_SLURM is empty"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a test Slurm runs its daemons as root"),
    pytest.mark.skipif(any(shutil.which(d) is None for d in DAEMONS),
                       reason="Slurm is not installed (apt-get install slurm-wlm munge; scripts/run-tests does "
                              "it where it may)"),
]

CONF = """\
ClusterName=mpicoll-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldPort={port}
SlurmdPort={port1}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
NodeName={host} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node Slurm: the environment that points its commands at it (SLURM_CONF)."""
    where = tmp_path_factory.mktemp("slurm")
    (where / "state").mkdir()
    (where / "spool").mkdir()
    host = socket.gethostname().split(".")[0]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    port = free_port()
    (where / "slurm.conf").write_text(CONF.format(host=host, dir=where, port=port, port1=port + 1,
                                                  cpus=os.cpu_count(), memory=memory))
    (where / "munge.key").write_bytes(os.urandom(1024))
    (where / "munge.key").chmod(0o600)
    env = {**os.environ, "SLURM_CONF": str(where / "slurm.conf")}
    started = []

    def start(*command):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            pytest.skip(f"{command[0]} did not start: {(result.stderr or result.stdout).strip()[-300:]}")
        started.append(command[0])

    try:
        start("munged", "--force", f"--socket={where}/munge.sock", f"--key-file={where}/munge.key",
              f"--log-file={where}/munged.log", f"--pid-file={where}/munged.pid", f"--seed-file={where}/munged.seed")
        start("slurmctld")
        start("slurmd")
        deadline = time.monotonic() + 60        # (beside the other single-process tests: 2 cores busy)
        while (state := subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                       text=True).stdout.strip()) != "idle":
            if time.monotonic() > deadline:
                pytest.skip(f"the test Slurm's node did not come up (state {state!r}); see {where}/slurmd.log")
            time.sleep(0.5)
        yield env
    finally:
        for daemon in ("slurmd", "slurmctld", "munged"):
            pid = where / f"{daemon}.pid"
            if daemon in started and pid.exists():
                subprocess.run(["kill", pid.read_text().strip()], capture_output=True)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


def submit(slurm: dict, tmp_path: Path, script: str, *options: str, **settings: str) -> tuple[str, str, str]:
    """``sbatch`` of ``scripts/SCRIPT`` from the checkout with the test's venv, waited for: (state, exit code,
    log).  Polled every 0.2 s (``sbatch --wait`` looks every 10 s: 8 s lost per job, measured)."""
    env = {**slurm, "MPICOLL_VENV": sys.prefix, **settings}
    log = tmp_path / "job.log"
    result = subprocess.run(["sbatch", "--parsable", f"--output={log}", *options, f"scripts/{script}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    job = result.stdout.strip().split(";")[0]
    deadline, state, code = time.monotonic() + 300, None, None
    while job and time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
        state, code = re.search(r"JobState=(\w+)", shown), re.search(r"ExitCode=(\S+)", shown)
        if state and state.group(1) in ENDED:
            break
        time.sleep(0.2)
    state = state.group(1) if state else f"unknown ({result.stderr.strip()})"
    text = log.read_text() if log.exists() else f"(no {log.name})\n"
    if state != "COMPLETED":
        text += daemons_on(slurm, job)
    return state, code.group(1) if code else "?", text


def daemons_on(slurm: dict, job: str) -> str:
    """What the test Slurm's daemons logged about JOB: the reason a job failed before its script printed."""
    where = Path(slurm["SLURM_CONF"]).parent
    about = re.compile(rf"JobId={job}\b|job {job}\b|StepId={job}\.|\[{job}\.")
    said = [f"{name}: {line}" for name in ("slurmctld.log", "slurmd.log") if (where / name).exists()
            for line in (where / name).read_text(errors="replace").splitlines() if about.search(line)]
    return "\n".join(["--- the daemons on job " + job, *said[-40:]])


@pytest.mark.parametrize("tasks", [1, 2])
def test_train_sbatch_trains_one_job_on_the_tasks_slurm_gave(slurm, tmp_path, tasks):
    output = tmp_path / "train.jsonl"
    state, code, log = submit(slurm, tmp_path, "train.sbatch", f"--ntasks-per-node={tasks}",
                              MPICOLL_TRAIN_ARGS="--epochs 2", MPICOLL_OUTPUT=str(output))
    assert (state, code) == ("COMPLETED", "0:0"), log
    rank_word = "rank" if tasks == 1 else "ranks"
    assert log.count("test accuracy") == 1 and f"on {tasks} {rank_word}" in log, log
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert {record.get("ranks") for record in records if "ranks" in record} == {tasks}, records[:2]


def test_a_launch_without_pmi_fails_in_one_line_per_task_naming_the_fix(slurm, tmp_path):
    """Slurm's own default (MpiDefault=none) starts each task as an MPI singleton: refused, never COMPLETED."""
    state, code, log = submit(slurm, tmp_path, "train.sbatch", "--ntasks-per-node=2", MPICOLL_SRUN_ARGS="",
                              MPICOLL_TRAIN_ARGS="--epochs 2", MPICOLL_OUTPUT=str(tmp_path / "x.jsonl"))
    assert state == "FAILED" and code == "2:0", log
    refusals = [line for line in log.splitlines() if line.startswith("mpicoll train:")]
    assert len(refusals) == 2 and all("srun --mpi=pmi2" in line and "world of 1" in line for line in refusals), log
    assert "accuracy" not in log and not (tmp_path / "x.jsonl").exists()


def test_train_sbatch_under_mpiexec_in_the_allocation(slurm, tmp_path):
    output = tmp_path / "train.jsonl"
    state, code, log = submit(slurm, tmp_path, "train.sbatch", "--ntasks-per-node=2", MPICOLL_LAUNCHER="mpiexec",
                              MPICOLL_TRAIN_ARGS="--method ps-async --epochs 2", MPICOLL_OUTPUT=str(output))
    assert (state, code) == ("COMPLETED", "0:0"), log
    assert log.count("test accuracy") == 1 and "on 2 ranks" in log, log


def test_compare_sbatch_runs_every_method_on_the_jobs_tasks(slurm, tmp_path):
    report = tmp_path / "report"
    state, code, log = submit(slurm, tmp_path, "compare.sbatch", "--ntasks-per-node=2",
                              MPICOLL_COMPARE_ARGS="--methods allreduce-ring,ps-async --data digits --model softmax "
                                                   "--epochs 2",
                              MPICOLL_OUTPUT=str(report))
    assert (state, code) == ("COMPLETED", "0:0"), log
    assert re.findall(r"^(\S+): test accuracy .* on 2 ranks", log, re.M) == ["allreduce-ring", "ps-async"], log
    assert (report / "report.md").exists() and "ps-async" in (report / "report.md").read_text()


def test_bench_sbatch_times_on_the_jobs_tasks(slurm, tmp_path):
    prefix = tmp_path / "bench"
    state, code, log = submit(slurm, tmp_path, "bench.sbatch", "--ntasks-per-node=2",
                              MPICOLL_BENCH_ARGS="--sizes 8,64K --iters 3 --min-iters 3 --algorithms ring",
                              MPICOLL_OUTPUT=str(prefix))
    assert (state, code) == ("COMPLETED", "0:0"), log
    assert "allreduce, 2 ranks" in log, log
    records = json.loads(Path(f"{prefix}.json").read_text())
    assert records and {record["ranks"] for record in records} == {2}, records[:2]
