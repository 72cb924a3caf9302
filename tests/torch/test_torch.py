"""mpicoll.torch: tensors through mpicoll's collectives, against numpy on the same data, at 1 to 4 ranks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

import mpicoll  # noqa: E402
import mpicoll.torch as mt  # noqa: E402
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed  # noqa: E402
from tests.support.parameter_servers import run_roles  # noqa: E402

pytestmark = pytest.mark.mpi

REFERENCE = {"average": lambda a: a.sum(axis=0) / P, "sum": lambda a: a.sum(axis=0), "min": lambda a: a.min(axis=0),
             "max": lambda a: a.max(axis=0), "product": lambda a: a.prod(axis=0)}


def everyone(seed: int, shape, dtype) -> np.ndarray:
    """Every rank's data, the same on all ranks (each rank uses its own row)."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((P, *shape)) + 1.5
    return data.astype(dtype) if np.dtype(dtype).kind == "f" else rng.integers(-3, 4, (P, *shape)).astype(dtype)


@pytest.mark.parametrize("op", list(mt.OPS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (P - 1,), (1000, 3), (70001,)])
@pytest.mark.parametrize("where", ["new", "out", "in place"])
def test_allreduce_matches_numpy(op, dtype, shape, where):
    if op == "average" and np.dtype(dtype).kind != "f":
        pytest.skip("averaging integers is refused (tested below)")
    seed = shared_seed()
    data = everyone(seed, shape, dtype)
    tensor = torch.from_numpy(np.array(data[RANK]))
    out = torch.empty_like(tensor) if where == "out" else tensor if where == "in place" else None
    result = mt.allreduce(tensor, op, out=out)
    expected = REFERENCE[op](data.astype(np.float64)).astype(dtype)
    assert isinstance(result, torch.Tensor) and result.dtype == tensor.dtype and tuple(result.shape) == shape
    if out is not None:
        assert result is out
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    everywhere(np.allclose(result.numpy(), expected, **tolerance), f"seed {seed}: {op} {dtype} {shape} {where}")
    same = WORLD.allgather(result.numpy().tobytes())
    everywhere(all(s == same[0] for s in same), "ranks got different bits")


def test_allreduce_takes_parameters_and_non_contiguous_tensors():
    weight = torch.nn.Parameter(torch.full((4, 6), float(RANK + 1), dtype=torch.float64))
    everywhere(torch.equal(mt.allreduce(weight, "sum"), torch.full((4, 6), float(P * (P + 1) / 2), dtype=torch.float64)))
    columns = torch.arange(24, dtype=torch.float32).reshape(4, 6).t() * (RANK + 1)     # a transposed view
    summed = mt.allreduce(columns, "sum")
    everywhere(torch.equal(summed, torch.arange(24, dtype=torch.float32).reshape(4, 6).t() * (P * (P + 1) / 2)))
    mt.allreduce(columns, "average", out=columns)                # in place into a non-contiguous tensor
    everywhere(torch.allclose(columns, torch.arange(24, dtype=torch.float32).reshape(4, 6).t() * ((P + 1) / 2)))


@pytest.mark.parametrize("op", ["sum", "average"])
def test_bfloat16_in_place_gives_the_general_paths_bits_and_follows_a_tensor_whose_memory_changes(op):
    """In place, a CPU tensor's allreduce takes a straight line over a view remembered per tensor
    (``mpicoll.torch.collectives.host_view``); bfloat16 sums go there too: the same bits as a new tensor's (the
    general path), every rank, also after the tensor's memory, shape or type were replaced."""
    seed = shared_seed()
    for n in (1, P - 1 or 1, 17, 70001):
        data = torch.from_numpy(everyone(seed + n, (n,), np.float32)).to(torch.bfloat16)
        tensor = data[RANK].clone()
        expected = mt.allreduce(tensor, op)                     # a new tensor: the general path
        for _ in range(2):                                      # the second call: the remembered view
            tensor.copy_(data[RANK])
            everywhere(mt.allreduce(tensor, op, out=tensor) is tensor and torch.equal(tensor, expected),
                       f"{op} n={n}: {tensor[:3]} != {expected[:3]}")
    tensor = torch.full((5,), float(RANK + 1))
    mt.allreduce(tensor, "sum", out=tensor)
    tensor.data = torch.full((7,), float(RANK + 2), dtype=torch.float64)    # other memory, shape and type
    mt.allreduce(tensor, "sum", out=tensor)
    tensor.set_(torch.full((3,), float(RANK), dtype=torch.float64))
    mt.allreduce(tensor, "sum", out=tensor)
    everywhere(tensor.dtype == torch.float64 and torch.equal(tensor, torch.full((3,), P * (P - 1) / 2,
                                                                                   dtype=torch.float64)), f"{tensor}")


def test_allgather_and_broadcast_match_numpy():
    seed = shared_seed()
    data = everyone(seed, (3, 5), np.float32)
    gathered = mt.allgather(torch.from_numpy(np.array(data[RANK])))
    everywhere(np.array_equal(gathered.numpy(), data.reshape(P * 3, 5)), f"seed {seed}: allgather")
    scalars = mt.allgather(torch.tensor(float(RANK)))
    everywhere(torch.equal(scalars, torch.arange(P, dtype=torch.float32)), f"{scalars}")
    root = P - 1
    mine = torch.from_numpy(np.array(data[RANK]))
    copy = mt.broadcast(mine, root)
    everywhere(np.array_equal(copy.numpy(), data[root]) and np.array_equal(mine.numpy(), data[RANK]), "broadcast")
    mt.broadcast(mine, root, out=mine)
    everywhere(np.array_equal(mine.numpy(), data[root]), "broadcast in place")


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def test_broadcast_parameters_makes_every_replica_the_roots():
    net = model(seed=100 + RANK)                    # each rank starts different
    net.register_buffer("steps", torch.tensor([RANK], dtype=torch.int64))       # buffers travel too
    root = P // 2
    mt.broadcast_parameters(net.state_dict(), root=root)
    flat = torch.cat([t.reshape(-1).double() for t in net.state_dict().values()]).numpy()
    everyone_flat = WORLD.allgather(flat)
    everywhere(all(np.array_equal(f, everyone_flat[root]) for f in everyone_flat), "replicas differ")
    everywhere(int(net.steps[0]) == root, f"the buffer holds {int(net.steps[0])}")
    reference = model(seed=100 + root)
    everywhere(torch.equal(net[0].weight, reference[0].weight), "not the root's initial weights")
    other = model(seed=7)
    mt.broadcast_parameters(other.named_parameters())          # named_parameters() works too
    everywhere(torch.equal(other[2].bias, model(seed=7)[2].bias), "named_parameters")


def test_bad_input_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="Unrecognized op: 'mean'"):
        mt.allreduce(torch.ones(3), "mean")
    with pytest.raises(TypeError, match="averaging needs a floating-point tensor"):
        mt.allreduce(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mt.allreduce(np.ones(3), "sum")
    wider = torch.nn.Linear(4, 2 + (RANK == P - 1 and P > 1))       # the last rank built another model
    if P > 1:
        with pytest.raises(mpicoll.SetupError, match=f"rank {P - 1}: the parameters differ from rank 0's"):
            mt.broadcast_parameters(wider.state_dict())


def batches(seed: int, rank: int, steps: int, rows: int = 8):
    rng = np.random.default_rng([seed, rank])
    return [(torch.from_numpy(rng.standard_normal((rows, 7))), torch.from_numpy(rng.integers(0, 3, rows)))
            for _ in range(steps)]


def gradient_of(net, X, y) -> None:
    torch.nn.functional.cross_entropy(net(X), y).backward()


def averaged_reference(seed: int, steps: int, lr: float = 0.05) -> torch.nn.Module:
    """One process: SGD+momentum on the ranks' averaged gradients, from rank 0's initial weights (as broadcast),
    float64."""
    single = model(seed=100).double()
    optimizer = torch.optim.SGD(single.parameters(), lr=lr, momentum=0.9)
    everyone = [batches(seed, rank, steps) for rank in range(P)]
    for step in range(steps):
        total = [torch.zeros_like(p) for p in single.parameters()]
        for rank in range(P):
            single.zero_grad()
            gradient_of(single, *everyone[rank][step])
            total = [t + p.grad for t, p in zip(total, single.parameters())]
        for p, t in zip(single.parameters(), total):
            p.grad = t / P
        optimizer.step()
    return single


@pytest.mark.parametrize("bucket_bytes", [25 << 20, 100])       # one bucket, or one per tensor or so
def test_distributed_optimizer_is_sgd_with_momentum_on_the_averaged_gradient(bucket_bytes):
    """Each rank trains on its own batches; a single process applying the ranks' averaged gradient
    with the same SGD+momentum must end at the same weights (float64, 1e-9), every replica alike."""
    seed, steps = shared_seed(), 4
    net = model(seed=100 + RANK).double()
    mt.broadcast_parameters(net.state_dict(), root=0)
    optimizer = mt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                        named_parameters=net.named_parameters(), bucket_bytes=bucket_bytes)
    mine = batches(seed, RANK, steps)
    for X, y in mine:
        optimizer.zero_grad()
        gradient_of(net, X, y)
        optimizer.step()

    single = averaged_reference(seed, steps)
    worst = max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(), single.parameters()))
    everywhere(worst < 1e-9, f"seed {seed}: {worst:.2e} from single-process SGD on the averaged gradient")
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy().tobytes()
    everywhere(len(set(WORLD.allgather(flat))) == 1, "replicas are not bitwise identical")


@pytest.mark.parametrize("bucket_bytes", [25 << 20, 100])
def test_distributed_optimizer_follows_parameters_unfrozen_and_frozen_during_training(bucket_bytes):
    """Gradual unfreezing: the first layer frozen when the optimizer is built and unfrozen after step 2, the
    last layer frozen after step 4.  Every replica must match a single process applying the ranks' averaged
    gradients under the same schedule (float64, 1e-9), bit for bit alike: before, the unfrozen layer was
    never averaged and the replicas drifted apart."""
    seed, steps = shared_seed(), 6
    net = model(seed=100 + RANK).double()
    mt.broadcast_parameters(net.state_dict(), root=0)
    single = model(seed=100).double()

    def schedule(module, step):
        for p in module[0].parameters():
            p.requires_grad_(step >= 2)
        for p in module[2].parameters():
            p.requires_grad_(step < 4)

    schedule(net, 0)
    optimizer = mt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                        bucket_bytes=bucket_bytes)
    mine = batches(seed, RANK, steps)
    for step, (X, y) in enumerate(mine):
        schedule(net, step)
        optimizer.zero_grad()
        gradient_of(net, X, y)
        optimizer.step()

    reference = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    everyone = [batches(seed, rank, steps) for rank in range(P)]
    for step in range(steps):
        schedule(single, step)
        total = None
        for rank in range(P):
            single.zero_grad()
            gradient_of(single, *everyone[rank][step])
            grads = [None if p.grad is None else p.grad.clone() for p in single.parameters()]
            total = grads if total is None else [None if t is None else t + g for t, g in zip(total, grads)]
        for p, t in zip(single.parameters(), total):
            p.grad = None if t is None else t / P
        reference.step()
    worst = max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(), single.parameters()))
    everywhere(worst < 1e-9, f"seed {seed}: {worst:.2e} from single-process SGD under the same schedule")
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy().tobytes()
    everywhere(len(set(WORLD.allgather(flat))) == 1, "replicas are not bitwise identical")


def test_distributed_optimizer_handles_unused_parameters_mixed_dtypes_and_fp16():
    torch.manual_seed(3)
    a = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
    unused = torch.nn.Parameter(torch.ones(2, dtype=torch.float32))
    optimizer = mt.DistributedOptimizer(torch.optim.SGD([a, b, unused], lr=1.0))
    (a * (RANK + 1)).sum().backward()
    if RANK == 0:                                      # b has a gradient on rank 0 only
        (b * 2).sum().backward()
    optimizer.step()
    everywhere(torch.allclose(a, torch.ones(5, dtype=torch.float64) - (P + 1) / 2), f"a: {a}")
    everywhere(torch.allclose(b, torch.ones(3) - 2 / P), f"b: {b}")
    everywhere(unused.grad is None and torch.equal(unused, torch.ones(2)), "a parameter no rank used was touched")
    half = mt.DistributedOptimizer(torch.optim.SGD([b], lr=0.0), compression="fp16")
    b.grad = torch.full((3,), 1 / 3 + RANK, dtype=torch.float32)
    half.synchronize()
    exact = 1 / 3 + (P - 1) / 2
    everywhere(abs(float(b.grad[0]) - exact) < 2e-3 * max(1.0, exact), f"fp16: {float(b.grad[0])} vs {exact}")
    with pytest.raises(ValueError, match="compression must be one of fp16, bf16"):
        mt.DistributedOptimizer(torch.optim.SGD([a], lr=1.0), compression="int8")
    with pytest.raises(ValueError, match="a closure would recompute"):
        optimizer.step(lambda: 0.0)
    with pytest.raises(ValueError, match="named_parameters lacks 1"):
        mt.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), named_parameters=[("a", a)])


def deep_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def averaged_sgd(seed: int, steps: int, passes: int, lr: float = 0.05):
    """Single-process SGD with momentum on the ranks' gradients, summed over ``passes`` batches per rank
    per step and averaged over the ranks: what DistributedOptimizer must reproduce."""
    single = deep_model(seed=100)
    reference = torch.optim.SGD(single.parameters(), lr=lr, momentum=0.9)
    everyone = [batches(seed, rank, steps * passes) for rank in range(P)]
    for step in range(steps):
        total = [torch.zeros_like(p) for p in single.parameters()]
        for rank in range(P):
            single.zero_grad()
            for k in range(passes):
                gradient_of(single, *everyone[rank][step * passes + k])
            total = [t + p.grad for t, p in zip(total, single.parameters())]
        for p, t in zip(single.parameters(), total):
            p.grad = t / P
        reference.step()
    return single


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_buckets_start_during_backward_and_accumulated_passes_are_averaged(passes):
    seed, steps = shared_seed(), 3
    net = deep_model(seed=100 + RANK)
    mt.broadcast_parameters(net.state_dict())
    optimizer = mt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                        bucket_bytes=300, backward_passes_per_step=passes)
    everywhere(len(optimizer._buckets) > 2, f"{len(optimizer._buckets)} buckets: the test wants several")
    mine = batches(seed, RANK, steps * passes)
    started_in_backward = []
    for step in range(steps):
        optimizer.zero_grad()
        for k in range(passes):
            gradient_of(net, *mine[step * passes + k])
        started_in_backward.append(optimizer._next)
        optimizer.step()
    everywhere(started_in_backward == [len(optimizer._buckets)] * steps,
               f"buckets started before step(): {started_in_backward} of {len(optimizer._buckets)}")
    single = averaged_sgd(seed, steps, passes)
    worst = max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(), single.parameters()))
    everywhere(worst < 1e-9, f"seed {seed}: {worst:.2e} from single-process SGD on the averaged gradient")
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy().tobytes()
    everywhere(len(set(WORLD.allgather(flat))) == 1, "replicas are not bitwise identical")
    for _ in range(passes):
        gradient_of(net, *mine[0])
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        gradient_of(net, *mine[0])                    # one pass more than the optimizer was told
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after backward"):
        optimizer.zero_grad()
    optimizer.synchronize()
    optimizer.zero_grad()


def test_synchronize_then_clip_then_step_and_schedulers_see_an_optimizer():
    net = deep_model(seed=5)
    plain = torch.optim.SGD(net.parameters(), lr=0.5)
    optimizer = mt.DistributedOptimizer(plain)
    everywhere(isinstance(optimizer, torch.optim.SGD) and isinstance(optimizer, mt.DistributedOptimizer))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    X, y = batches(shared_seed(), RANK, 1)[0]
    optimizer.zero_grad()
    gradient_of(net, X, y)
    optimizer.synchronize()
    averaged = [p.grad.clone() for p in net.parameters()]
    torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=1e-3)
    clipped = [p.grad.clone() for p in net.parameters()]
    before = [p.detach().clone() for p in net.parameters()]
    with optimizer.skip_synchronize():
        optimizer.step()
    scheduler.step()
    moved = all(torch.allclose(b - 0.5 * g, p) for b, g, p in zip(before, clipped, net.parameters()))
    everywhere(moved and not all(torch.equal(a, c) for a, c in zip(averaged, clipped)), "clipped step")
    everywhere(plain.param_groups[0]["lr"] == 0.25, f"lr after StepLR: {plain.param_groups[0]['lr']}")


def test_broadcast_optimizer_state_gives_every_rank_the_roots():
    net = deep_model(seed=9)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3 * (RANK + 1))
    root = P - 1
    if RANK == root:              # only the root has state (as if it alone loaded a checkpoint)
        for X, y in batches(shared_seed(), RANK, 2):
            optimizer.zero_grad()
            gradient_of(net, X, y)
            optimizer.step()
    else:
        shared_seed()
    mt.broadcast_optimizer_state(optimizer, root=root)
    state = optimizer.state_dict()
    leaves = [state["param_groups"][0]["lr"]] + [
        (key, value.double().reshape(-1).numpy().tobytes() if torch.is_tensor(value) else value)
        for index in sorted(state["state"]) for key, value in sorted(state["state"][index].items())]
    everyone = WORLD.allgather(leaves)
    everywhere(all(leaf == everyone[root] for leaf in everyone) and len(leaves) > 1,
               "optimizer states differ after the broadcast")
    everywhere(leaves[0] == pytest.approx(1e-3 * P), f"lr {leaves[0]}")
    if P > 1:
        other = torch.optim.SGD(deep_model(seed=9)[:1 + 2 * (RANK == 0)].parameters(), lr=0.1)
        with pytest.raises(mpicoll.SetupError, match="parameter groups differ"):
            mt.broadcast_optimizer_state(other, root=root)


def test_allreduce_async_and_the_ddp_hook():
    seed = shared_seed()
    data = everyone(seed, (1000,), np.float32)
    tensor = torch.from_numpy(np.array(data[RANK]))
    request = mt.allreduce_async(tensor, out=tensor)
    result = request.wait()
    everywhere(result is tensor and np.allclose(tensor.numpy(), data.mean(axis=0), atol=1e-5), f"seed {seed}")
    mt.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        net = deep_model(seed=11)
        reference = deep_model(seed=11)
        ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
        ddp.register_comm_hook(None, mt.allreduce_hook)
        X, y = batches(seed, RANK, 1)[0]
        gradient_of(ddp, X, y)
        for rank in range(P):
            gradient_of(reference, *batches(seed, rank, 1)[0])
        worst = max(float((p.grad - r.grad / P).abs().max()) for p, r in zip(net.parameters(), reference.parameters()))
        everywhere(worst < 1e-9, f"seed {seed}: DDP with mpicoll's hook is {worst:.2e} from the averaged gradient")
    finally:
        torch.distributed.destroy_process_group()


def test_flat_parameters_are_the_modules_memory():
    net = model(seed=5).double()
    copy = model(seed=5).double()
    flat = mt.FlatParameters(net)
    assert isinstance(flat.weights, np.ndarray) and flat.weights.size == sum(p.numel() for p in net.parameters())
    assert np.array_equal(flat.weights, torch.nn.utils.parameters_to_vector(copy.parameters()).detach().numpy())
    X, y = batches(7, RANK, 1)[0]
    for _ in range(2):                               # the second pass starts from an optimizer's zero_grad
        flat.zero_grad()
        gradient_of(net, X, y)
        copy.zero_grad()
        gradient_of(copy, X, y)
        expected = torch.cat([p.grad.reshape(-1) for p in copy.parameters()]).numpy()
        assert np.allclose(flat.grad, expected, rtol=1e-12, atol=1e-14), "backward did not write into flat.grad"
        torch.optim.SGD(net.parameters(), lr=0.1).zero_grad()       # sets .grad to None: flat.zero_grad mends it
    flat.weights[:] = np.random.default_rng(1).standard_normal(flat.weights.size)   # written as a server would
    torch.nn.utils.vector_to_parameters(torch.from_numpy(flat.weights.copy()), copy.parameters())
    with torch.no_grad():
        assert torch.equal(net(X), copy(X)), "the module does not compute with flat.weights"
    with pytest.raises(TypeError, match="several dtypes"):
        mt.FlatParameters(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double()))


def test_a_parameter_server_trains_a_torch_module_through_flat_parameters():
    """ps.Sync over a live module: each round must be w -= lr * (mean of the workers' autograd gradients)."""
    if P < 2:
        pytest.skip("a parameter server needs a server and a worker")
    from mpicoll import ps
    seed, steps, lr = shared_seed(), 3, 0.2
    net = model(seed=8).double()
    flat = mt.FlatParameters(net)
    start = flat.weights.copy()
    server = ps.ParameterServer(WORLD, flat.weights, ps.Sync(lr=lr))

    def work(client):
        client.pull(out=flat.weights)
        for X, y in batches(seed, RANK, steps):
            flat.zero_grad()
            gradient_of(net, X, y)
            client.exchange(flat.grad, out=flat.weights)

    final, _ = run_roles(server, work)

    single = model(seed=8).double()
    everyone = {rank: batches(seed, rank, steps) for rank in range(1, P)}
    for step in range(steps):
        total = [torch.zeros_like(p) for p in single.parameters()]
        for rank in everyone:
            single.zero_grad()
            gradient_of(single, *everyone[rank][step])
            total = [t + p.grad for t, p in zip(total, single.parameters())]
        with torch.no_grad():
            for p, t in zip(single.parameters(), total):
                p -= lr * t / (P - 1)
    expected = torch.nn.utils.parameters_to_vector(single.parameters()).detach().numpy()
    worst = float(np.abs(final - expected).max())
    everywhere(worst < 1e-9 and not np.allclose(final, start), f"seed {seed}: {worst:.2e} from synchronous SGD")
    everywhere(server.is_server or np.array_equal(flat.weights, final), "the worker's module lacks the last update")


def test_sgp_trains_a_torch_module_through_flat_parameters():
    """SGP stepping a live module's flat vectors must equal SGP on plain arrays with autograd's gradients."""
    from mpicoll.gossip import SGP, PushSum
    seed, steps, lr = shared_seed(), 3, 0.1
    net = model(seed=20 + RANK).double()
    flat = mt.FlatParameters(net)
    reference = model(seed=20 + RANK).double()
    plain = torch.nn.utils.parameters_to_vector(reference.parameters()).detach().numpy().copy()
    live = SGP(PushSum(WORLD, flat.weights), lr)
    check = SGP(PushSum(WORLD, plain), lr)
    for X, y in batches(seed, RANK, steps):
        flat.zero_grad()
        gradient_of(net, X, y)
        live.step(flat.grad, out=flat.weights)
        torch.nn.utils.vector_to_parameters(torch.from_numpy(plain.copy()), reference.parameters())
        reference.zero_grad()
        gradient_of(reference, X, y)
        plain = check.step(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).numpy())
    worst = float(np.abs(flat.weights - plain).max())
    everywhere(worst < 1e-12, f"seed {seed}: the live module's SGP is {worst:.2e} from SGP on plain arrays")
    live.gossip.close()
    check.gossip.close()
