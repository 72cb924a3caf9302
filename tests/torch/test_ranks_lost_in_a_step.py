"""A rank that dies inside a ``mpicoll.torch.DistributedOptimizer`` step, under MPI's fault tolerance (ULFM): the
survivors' ``step()`` raises RanksLost naming it, ``optimizer.shrink()`` goes on with them, and after a few more
steps their models are identical.  A job of 4 ranks of the Open MPI environment (skipped where it is missing); the
victim kills itself in backward, while the other ranks' buckets are on their way."""

from __future__ import annotations

import json
import subprocess

from tests.support.jobs import ROOT, fault_tolerant

STEP_AND_DIE = """
import json, os, signal
import torch
from mpi4py import MPI
import mpicoll
import mpicoll.torch as mt
me = MPI.COMM_WORLD.Get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).double()
optimizer = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                    comm=mpicoll.Communicator(MPI.COMM_WORLD), bucket_bytes=1024)
step, lost = 0, []
def die_in_backward(grad):
    if me == 2 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)       # after the last layer's bucket started on the others
    return grad
model[0].weight.register_hook(die_in_backward)
while step < 6:
    x = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + me))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    try:
        optimizer.step()
        step += 1
    except mpicoll.RanksLost as error:
        lost.append(error.lost)
        optimizer.shrink()
        for p in model.parameters():               # from the survivors' rank 0: all continue from one model
            optimizer.comm.Bcast(p.detach().numpy(), root=0)
sums = optimizer.comm.allgather(float(sum(p.detach().sum() for p in model.parameters())))
print(json.dumps({"rank": me, "lost": lost, "size": optimizer.comm.Get_size(), "identical": len(set(sums)) == 1}))
"""


def test_a_death_inside_a_step_is_ranks_lost_and_the_survivors_go_on(tmp_path):
    start, env = fault_tolerant(4)
    (tmp_path / "job.py").write_text(STEP_AND_DIE)
    job = subprocess.run([*start, str(tmp_path / "job.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, start_new_session=True)
    said = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert job.returncode == 0 and sorted(s["rank"] for s in said) == [0, 1, 3], job.stdout + job.stderr[-3000:]
    assert all(s["lost"] == [[2]] and s["size"] == 3 and s["identical"] for s in said), said
