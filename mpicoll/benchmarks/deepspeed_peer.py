"""DeepSpeed's shared-memory allreduce as a peer in ``mpicoll bench-torch``: the fastest CPU allreduce within a
node that is neither MPI's nor gloo's (``deepspeed.comm.inference_all_reduce``: C++ with OpenMP, SUM of fp32,
bf16 and fp16, every rank on one node).

Set up beside the gloo group the benchmark has already made (``deepspeed.init_distributed`` takes it as it
is).  Its kernel needs, before the import, ``DS_ACCELERATOR=cpu`` and ``LOCAL_SIZE`` (the ranks on the node;
without it the kernel crashed), and it names its ``/dev/shm`` segments after ``MASTER_ADDR`` and
``MASTER_PORT``, which it never unlinks: this module gives every run a name of its own (rank 0's pid) and
unlinks this rank's segment when the run ends.  Its reductions run on OpenMP threads of its own runtime (not
torch's: ``torch.set_num_threads`` does not reach them), one per core by default in every rank; this module gives
them this rank's share of the node's cores (``OMP_NUM_THREADS``, unless set), as DeepSpeed's own launcher does
(``deepspeed --bind_cores_to_rank``) and ``torchrun`` sets one, so that no contender's threads outnumber the
cores it was given.  The first call JIT-builds the kernel with the machine's C++ compiler (about 30 s here;
minutes on a fresh machine), then it is cached.
"""

from __future__ import annotations

import importlib.util
import os

from mpi4py import MPI

from .. import compute

__all__ = ["available", "DeepSpeedAllreduce"]


def available() -> bool:
    """Whether deepspeed is installed (``pip install deepspeed``)."""
    return importlib.util.find_spec("deepspeed") is not None


class DeepSpeedAllreduce:
    """``call(tensor)``: DeepSpeed's in-place SUM of a float32 or bfloat16 tensor over ``comm`` (collective to make; every
    rank of ``comm`` on one node), on ``threads`` OpenMP threads a rank.  ``close()`` unlinks this rank's segment."""

    def __init__(self, comm: MPI.Intracomm):
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["LOCAL_SIZE"] = str(comm.Get_size())
        os.environ["MASTER_PORT"] = str(comm.bcast(os.getpid()))    # this run's segment names
        os.environ.setdefault("OMP_NUM_THREADS", str(compute.share_of_cores()))   # read when its runtime loads
        self.threads = int(os.environ["OMP_NUM_THREADS"])
        import deepspeed
        import deepspeed.comm as ds_comm

        deepspeed.init_distributed(dist_backend="gloo")
        self.call = ds_comm.inference_all_reduce
        address = os.environ.get("MASTER_ADDR", "")
        self.segment = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{address}_{os.environ['MASTER_PORT']}"
                        f"_{comm.Get_rank()}")
        self.comm = comm

    def close(self) -> None:
        self.comm.Barrier()          # every rank is done with every other's segment
        try:
            os.unlink(self.segment)
        except FileNotFoundError:
            pass
