"""``mpicoll bench-torch --training``: training steps of one model, averaged by DDP on gloo and by mpicoll.

Every contender trains its own copy of one MLP (same initial weights, same
synthetic batches) for the same steps:

``compute``             no averaging at all: the bound the others are held to
``ddp-gloo``            torch's DistributedDataParallel, its own gloo allreduce
``ddp-mpicoll``         DDP with ``mpicoll.torch.allreduce_hook`` for its buckets
``ddp-backend``         DDP over the "mpicoll" backend (``process_group``), no hook: no gloo
``fsdp2-gloo``          FSDP2 (``fully_shard`` per layer and on the whole) on a mesh of gloo's group
``fsdp2-backend``       FSDP2 on a mesh of the "mpicoll" backend's group
``mpicoll``             ``DistributedOptimizer``: buckets start during backward
``mpicoll-one-bucket``  ``DistributedOptimizer`` with one bucket: starts at the end of backward (no overlap)

Rounds of ``--steps`` steps per contender run interleaved in rotating order;
each contender's median step time (slowest rank) is reported, with its speed
against ``ddp-gloo`` and its scaling efficiency (compute-only time over its
time).  After training, every contender's weights are checked against
``mpicoll``'s: the same steps on the same data must give the same model up
to float32 rounding.  (FSDP2's contenders are left out where torch has no
``fully_shard``.)
"""

from __future__ import annotations


import numpy as np
from mpi4py import MPI

from ..base import timeline
from .common import format_bytes, interleaved_times, write_records

__all__ = ["run", "CONTENDERS"]

CONTENDERS = ["compute", "ddp-gloo", "ddp-mpicoll", "ddp-backend", "fsdp2-gloo", "fsdp2-backend", "mpicoll",
              "mpicoll-one-bucket"]


def run(args, torch, mt, dist, group) -> int:
    """``group``: a torch process group of every rank over the "mpicoll" backend (``ddp-backend``'s and
    ``fsdp2-backend``'s; the default group is gloo's)."""
    fsdp = _fsdp2(torch)
    contenders = [name for name in CONTENDERS if fsdp or not name.startswith("fsdp2")]
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    hidden = [int(width) for width in args.hidden.split(",") if width]
    inputs, classes = 784, 10

    def model():
        torch.manual_seed(0)
        widths = [inputs, *hidden]
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], classes))

    generator = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, inputs, generator=generator),
                torch.randint(0, classes, (args.batch,), generator=generator)) for _ in range(4)]
    trainers = {}
    for name in contenders:
        net = model()
        if name.startswith("fsdp2"):
            fully_shard, mesh_of = fsdp
            mesh = mesh_of(group if name == "fsdp2-backend" else dist.group.WORLD, "cpu")
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        if name.startswith("ddp"):
            net = torch.nn.parallel.DistributedDataParallel(net, process_group=group if name == "ddp-backend" else None)
            if name == "ddp-mpicoll":
                net.register_comm_hook(None, mt.allreduce_hook)
        elif name.startswith("mpicoll"):
            bucket_bytes = (1 << 40) if "one" in name else args.bucket_bytes
            optimizer = mt.DistributedOptimizer(optimizer, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
        trainers[name] = (net, optimizer)
    parameters = sum(p.numel() for p in model().parameters())
    taken = dict.fromkeys(contenders, 0)         # each contender's steps: all see the same batches

    def steps(name):
        net, optimizer = trainers[name]
        for _ in range(args.steps):
            X, y = batches[taken[name] % len(batches)]
            taken[name] += 1
            optimizer.zero_grad()
            with timeline.span("forward", name):
                loss = torch.nn.functional.cross_entropy(net(X), y)
            with timeline.span("backward", name):
                loss.backward()
            with timeline.span("step", name):
                optimizer.step()

    if rank == 0:
        print(f"# mpicoll bench-torch --training: {size} ranks, MLP {inputs}-{'-'.join(map(str, hidden))}-{classes} "
              f"({parameters / 1e6:.2f} M parameters, {format_bytes(parameters * 4)} of float32 gradients), batch "
              f"{args.batch} per rank, {torch.get_num_threads()} torch thread(s) per rank; torch {torch.__version__}")
    for name in contenders:                        # warm: buckets built, workers and kernels set up
        steps(name)
    rounds = interleaved_times(comm, [lambda name=name: steps(name) for name in contenders], args.iters)
    step_s = dict(zip(contenders, np.median(rounds, axis=1) / args.steps))
    reference = _flat(trainers["mpicoll"][0], torch)
    drift = {name: float(np.abs(_flat(trainers[name][0], torch) - reference).max())
             for name in contenders if name != "compute"}
    worst = comm.allreduce(max(drift.values()), op=MPI.MAX)
    if rank == 0:
        print(f"{'contender':>20} {'ms/step':>9} {'x ddp-gloo':>11} {'efficiency':>11}")
        for name in contenders:
            print(f"{name:>20} {step_s[name] * 1e3:>9.1f} {step_s['ddp-gloo'] / step_s[name]:>11.2f} "
                  f"{step_s['compute'] / step_s[name]:>10.0%}")
        print(f"# largest weight difference from mpicoll's after the same steps: {worst:.1e}")
        if args.output:
            write_records(args.output, [{"ranks": size, "parameters": parameters, "batch": args.batch,
                                         "hidden": hidden, **{f"{k}_s": v for k, v in step_s.items()},
                                         "weight_difference": worst}])
    if worst > 1e-3:
        raise SystemExit(f"mpicoll bench-torch: the contenders' models differ by {worst:.1e} after the same steps")
    return 0


def _fsdp2(torch):
    """(torch's ``fully_shard``, ``DeviceMesh.from_group``), or None where this torch has no FSDP2."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    return fully_shard, DeviceMesh.from_group


def _flat(net, torch) -> np.ndarray:
    """The model's parameters as one vector (an FSDP2 model's gathered whole: collective, every rank calls it)."""
    module = getattr(net, "module", net)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in whole]).numpy()
