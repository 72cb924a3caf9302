"""torchrun over the "mpicoll" backend: where the MPI cannot join torchrun's workers into one MPI world (plain
torchrun's singletons; Open MPI; MPICH's separate jobs unless ``MPICOLL_JOIN_JOBS=1``), one line says how to
launch instead; joined (``torchrun --nproc-per-node N --no-python mpiexec -n 1 python script.py`` with
``MPICOLL_JOIN_JOBS=1``), they train as gloo does.  That last test runs only when asked
(``MPICOLL_TEST_JOIN=1``): MPICH 5.0.2's connect/accept crashed in some runs here (docs/torch.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
from tests.support.jobs import OPENMPI_VENV, ROOT, mpiexec, script_env  # noqa: E402

# DDP training, a collective on the world and one on a group of two; rank 0 prints what it ended with.
_TRAIN = """
import sys, torch, torch.distributed as dist
import mpicoll.torch
dist.init_process_group(sys.argv[1])
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1 + rank)
for step in range(5):
    x = torch.randn(8, 6, dtype=torch.float64, generator=data)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), x[:, :3]).backward()
    optimizer.step()
ranks = torch.tensor([float(rank)])
dist.all_reduce(ranks)
pair = dist.new_group([0, size - 1])
ones = torch.ones(1)
if rank in (0, size - 1):
    dist.all_reduce(ones, group=pair)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
if rank == 0:
    print("result", size, ranks.item(), ones.item(), weights.tolist())
del ddp
dist.destroy_process_group()
"""


def _torchrun(tmp_path, ranks: int, *worker: str, backend: str = "mpicoll", python=sys.executable,
              env=None) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    command = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *worker,
               str(script), backend]
    return subprocess.run(command, cwd=tmp_path, env=env or script_env(MPICOLL_TIMEOUT="30"),
                          capture_output=True, text=True, timeout=240)


def _result(run: subprocess.CompletedProcess) -> str:
    lines = [line for line in run.stdout.splitlines() if line.startswith("result")]
    assert run.returncode == 0 and len(lines) == 1, run.stdout[-2000:] + run.stderr[-4000:]
    return lines[0]


@pytest.mark.skipif(os.environ.get("MPICOLL_TEST_JOIN") != "1", reason="joining MPI jobs is opt-in: MPICH 5.0.2's "
                    "MPI_Comm_accept crashed in some runs here (docs/torch.md); MPICOLL_TEST_JOIN=1 runs it")
def test_torchruns_workers_each_an_mpi_job_are_joined_and_train_as_over_gloo(tmp_path):
    joined = _result(_torchrun(tmp_path, 3, "--no-python", mpiexec(), "-n", "1", sys.executable,
                               env=script_env(MPICOLL_TIMEOUT="30", MPICOLL_JOIN_JOBS="1")))
    over_gloo = _result(_torchrun(tmp_path, 3, backend="gloo"))
    # (3 ranks' gradients may be summed in another order than gloo's: equal to float64 rounding)
    assert joined.startswith("result 3 3.0 2.0 "), joined
    mine, gloos = (json.loads(line.split(" ", 4)[4]) for line in (joined, over_gloo))
    assert len(mine) == len(gloos) and max(abs(a - b) for a, b in zip(mine, gloos)) < 1e-12, (joined, over_gloo)


def test_separate_mpich_jobs_are_joined_only_when_asked(tmp_path):
    run = _torchrun(tmp_path, 2, "--no-python", mpiexec(), "-n", "1", sys.executable)
    assert run.returncode != 0
    assert "launch with one MPI launcher instead: `mpiexec -n N python script.py`" in run.stderr and \
        "or set MPICOLL_JOIN_JOBS=1 to join the jobs" in run.stderr, run.stderr[-3000:]


def test_plain_torchruns_singletons_are_refused_saying_how_to_launch(tmp_path):
    run = _torchrun(tmp_path, 2)
    assert run.returncode != 0
    assert "MPICH cannot connect such processes (pmodels/mpich#7805)" in run.stderr and \
        "`torchrun --nproc-per-node N --no-python mpiexec -n 1 python script.py`, with MPICOLL_JOIN_JOBS=1" in \
        run.stderr, run.stderr[-3000:]


def test_under_open_mpi_separate_jobs_are_refused_saying_how_to_launch(tmp_path):
    if not (OPENMPI_VENV / "bin" / "mpiexec").exists():
        pytest.skip(f"no Open MPI environment at {OPENMPI_VENV} (scripts/run-tests makes it)")
    env = script_env(PATH=f"{OPENMPI_VENV / 'bin'}:{script_env()['PATH']}", OMPI_ALLOW_RUN_AS_ROOT="1",
                     OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=str(ROOT))
    run = _torchrun(tmp_path, 2, "--no-python", str(OPENMPI_VENV / "bin" / "mpiexec"), "-n", "1",
                    str(OPENMPI_VENV / "bin" / "python"), python=OPENMPI_VENV / "bin" / "python", env=env)
    assert run.returncode != 0
    assert "Open MPI joins separate jobs only through a shared PMIx server" in run.stderr, run.stderr[-3000:]
