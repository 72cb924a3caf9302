"""mpicoll.torch.horovod: Horovod's torch API against numpy and single-process references, at 1 to 4 ranks.

(Horovod's own test suite, run unchanged against it, is in docs/torch.md: "Coming from Horovod".)
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
import mpicoll.torch.horovod as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402
from tests.support.mpi import P, RANK, WORLD, everywhere, shared_seed  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.shutdown()


def everyones(seed: int, shape, dtype=torch.float64) -> torch.Tensor:
    """Every rank's tensor stacked (row q is rank q's): small integers, exact in every dtype."""
    return torch.tensor(np.random.default_rng(seed).integers(-9, 10, (P, *shape))).to(dtype)


def test_who_is_where_is_mpis():
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    expected = (RANK, P, local.Get_rank(), local.Get_size())
    local.Free()
    got = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    everywhere(got == expected and hvd.is_initialized() and hvd.cross_size() * hvd.local_size() >= P,
               f"{got}, expected {expected}")


def test_allreduce_every_op_and_form_against_numpy():
    seed, failures = shared_seed(), []
    for dtype in (torch.float64, torch.float32, torch.int32, torch.int64):
        data = everyones(seed, (5, 3), dtype)
        wide = data.double()
        references = {hvd.Sum: wide.sum(0), hvd.Min: wide.min(0).values, hvd.Max: wide.max(0).values,
                      hvd.Product: wide.prod(0),
                      hvd.Average: wide.sum(0) / P if dtype.is_floating_point else
                      torch.div(data.sum(0), P, rounding_mode="trunc").double()}
        for op, want in references.items():
            mine = data[RANK].clone()
            got = hvd.allreduce(mine, op=op)
            in_place = data[RANK].clone()
            hvd.allreduce_(in_place, op=op)
            started = hvd.synchronize(hvd.allreduce_async(data[RANK].clone(), op=op))
            exact = dtype != torch.float32             # float32: the average rounds (x/3)
            if not all((torch.equal(t.double(), want) if exact else torch.allclose(t.double(), want, rtol=1e-6))
                       for t in (got, in_place, started)) or not torch.equal(mine, data[RANK]):
                failures.append(f"{dtype} op {op}")
    scaled = hvd.allreduce(everyones(seed, (4,))[RANK], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    if not torch.allclose(scaled, everyones(seed, (4,)).sum(0) * 1.5, rtol=1e-12):
        failures.append("prescale/postscale")
    everywhere(not failures, f"seed {seed}: {failures}")


def test_ops_are_matched_by_name_in_any_order():
    """Odd ranks start the two ops in the opposite order: the names, not the order, pair them."""
    a, b = torch.full((3,), float(RANK)), torch.full((5,), float(2 * RANK))
    order = [("a", a), ("b", b)] if RANK % 2 == 0 else [("b", b), ("a", a)]
    handles = {name: hvd.allreduce_async(t, name=name, op=hvd.Sum) for name, t in order}
    total = sum(range(P))
    results = {name: hvd.synchronize(handle) for name, handle in handles.items()}
    everywhere(torch.equal(results["a"], torch.full((3,), float(total))) and
               torch.equal(results["b"], torch.full((5,), float(2 * total))), str(results))


def test_an_op_pending_through_a_barrier_completes_and_its_name_in_flight_is_refused():
    """Rank 0 starts 'late' and leaves it pending through a barrier the others reach first; a second 'late'
    meanwhile is a ValueError; the others then start it and it completes everywhere."""
    refused, handle = True, None
    if RANK == 0:
        handle = hvd.allreduce_async(torch.ones(4), name="late", op=hvd.Sum)
        try:
            hvd.allreduce_async(torch.ones(4), name="late")
            refused = P == 1      # alone, the first may be done already and its name free (refusal: 2+ ranks)
        except ValueError:
            pass
    hvd.barrier()
    if RANK > 0:
        handle = hvd.allreduce_async(torch.ones(4), name="late", op=hvd.Sum)
    result = hvd.synchronize(handle)
    everywhere(refused, "a second op named 'late' while 'late' was in flight was not refused")
    everywhere(torch.equal(result, torch.full((4,), float(P))), str(result))


def test_ranks_that_disagree_get_an_error_on_every_rank_and_nothing_moves():
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    problems = []
    for call, words in [(lambda: hvd.allreduce(torch.ones(3 + RANK)), "shape"),
                        (lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if RANK else torch.float32)), "dtype"),
                        (lambda: hvd.broadcast(torch.ones(2), root_rank=RANK), "root")]:
        try:
            call()
            problems.append(f"no error for mismatched {words}")
        except hvd.HorovodInternalError as error:
            if words not in str(error) or "rank(s) 0" not in str(error):
                problems.append(str(error))
    everywhere(not problems, str(problems))


def test_allgather_alltoall_reducescatter_and_broadcast_against_numpy():
    seed, failures = shared_seed(), []
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 4, P)                                 # first dimensions differ between ranks
    pieces = [torch.full((int(rows[q]), 2), float(q)) for q in range(P)]
    if not torch.equal(hvd.allgather(pieces[RANK]), torch.cat(pieces)):
        failures.append("allgather of unequal first dimensions")
    splits = rng.integers(0, 3, (P, P))                          # splits[q, r]: rows rank q sends rank r
    mine = torch.arange(int(splits[RANK].sum()), dtype=torch.float64) + 100 * RANK
    got, received = hvd.alltoall(mine, splits=torch.tensor(splits[RANK], dtype=torch.int32))
    sent = [torch.split(torch.arange(int(splits[q].sum()), dtype=torch.float64) + 100 * q, splits[q].tolist())
            for q in range(P)]
    if not torch.equal(got, torch.cat([sent[q][RANK] for q in range(P)])) or \
            received.tolist() != splits[:, RANK].tolist():
        failures.append("alltoall with splits")
    n = 2 * P + 1                                                # uneven: the first ranks take one more row
    data = everyones(seed, (n, 2))
    part = hvd.reducescatter(data[RANK], op=hvd.Sum)
    counts = [n // P + (1 if q < n % P else 0) for q in range(P)]
    start = sum(counts[:RANK])
    if not torch.equal(part, data.sum(0)[start: start + counts[RANK]]):
        failures.append("reducescatter of uneven rows")
    for root in range(P):
        if not torch.equal(hvd.broadcast(data[RANK], root), data[root]):
            failures.append(f"broadcast from {root}")
    grouped = hvd.grouped_allreduce([data[RANK], data[RANK][0]], op=hvd.Sum)
    if not (torch.equal(grouped[0], data.sum(0)) and torch.equal(grouped[1], data.sum(0)[0])):
        failures.append("grouped_allreduce")
    everywhere(not failures, f"seed {seed}: {failures}")


def test_collectives_differentiate_as_horovods():
    seed = shared_seed()
    x = everyones(seed, (4,))[RANK].clone().requires_grad_()
    hvd.allreduce(x * 2, op=hvd.Sum).sum().backward()           # backward: an allreduce (Sum) of ones
    ok = torch.equal(x.grad, torch.full((4,), 2.0 * P))
    y = torch.full((RANK + 1, 2), 1.0, requires_grad=True)
    gathered = hvd.allgather(y)
    weights = torch.arange(gathered.shape[0], dtype=torch.float32)[:, None].expand(-1, 2)
    (gathered * weights).sum().backward()                        # backward: averaged, this rank's rows
    start = sum(q + 1 for q in range(RANK))
    ok = ok and torch.equal(y.grad, weights[start: start + RANK + 1])
    everywhere(ok, f"allreduce grad {x.grad}, allgather grad {y.grad}")


def test_join_takes_part_with_zeros_and_returns_the_last_rank():
    if P < 2:
        pytest.skip("needs a rank that joins while others still reduce")
    if RANK == 0:
        last = hvd.join()
        averaged = None
    else:
        averaged = hvd.allreduce(torch.full((3,), 6.0), name="joined")
        last = hvd.join()
    everyone = hvd.allgather_object(last)
    everywhere(averaged is None or torch.equal(averaged, torch.full((3,), 6.0 * (P - 1) / P)), str(averaged))
    everywhere(len(set(everyone)) == 1 and everyone[0] != 0, f"join returned {everyone}")


def test_process_sets_reduce_among_their_members():
    if P < 2:
        pytest.skip("a set of one rank would be the global set again, which Horovod refuses")
    evens = hvd.add_process_set(list(range(0, P, 2)))
    odds = hvd.add_process_set(list(range(1, P, 2)))
    mine = evens if RANK % 2 == 0 else odds
    got = hvd.allreduce(torch.tensor([float(RANK)]), op=hvd.Sum, process_set=mine)
    members = list(range(RANK % 2, P, 2))
    ok = got.item() == sum(members) and mine.rank() == members.index(RANK) and mine.size() == len(members)
    hvd.barrier()
    removed = [hvd.remove_process_set(s) for s in (evens, odds)]
    everywhere(ok and all(removed), f"set {members} summed to {got.item()}")


def test_objects_and_parameters_from_a_root():
    obj = hvd.broadcast_object({"rank": RANK, "list": list(range(RANK))} if RANK == P - 1 else None, root_rank=P - 1)
    gathered = hvd.allgather_object(("rank", RANK))
    torch.manual_seed(RANK)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(0)
    root_model = torch.nn.Linear(3, 2)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), root_model.state_dict().values()))
    everywhere(obj == {"rank": P - 1, "list": list(range(P - 1))} and gathered == [("rank", q) for q in range(P)]
               and same, f"{obj}, {gathered}, parameters equal: {same}")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


@pytest.mark.parametrize("passes, groups", [(1, None), (2, None), (1, 2)])
def test_distributed_optimizer_is_sgd_on_the_averaged_gradient(passes, groups):
    seed, steps, lr = shared_seed() % 1000, 3, 0.1
    rng = np.random.default_rng(seed)
    batches = [[(torch.tensor(rng.standard_normal((3, 4))), torch.tensor(rng.standard_normal((3, 2))))
                for _ in range(passes)] for _ in range(steps * P)]
    net = _model(seed)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr),
                                         named_parameters=net.named_parameters(), backward_passes_per_step=passes,
                                         groups=groups)
    for step in range(steps):
        optimizer.zero_grad()
        for x, y in batches[step * P + RANK]:
            torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    single = _model(seed)
    for step in range(steps):
        grads = []
        for q in range(P):
            single.zero_grad()
            for x, y in batches[step * P + q]:
                torch.nn.functional.mse_loss(single(x), y).backward()
            grads.append([p.grad.clone() for p in single.parameters()])
        with torch.no_grad():
            for i, p in enumerate(single.parameters()):
                p -= lr * sum(g[i] for g in grads) / P
    worst = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), single.parameters()))
    everywhere(worst < 1e-9, f"seed {seed}: {worst:.2e} from SGD on the averaged gradient")


def test_distributed_optimizer_refuses_duplicate_names_and_warns_of_a_second_synchronize():
    net = _model(0)
    problems = []
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 named_parameters=[("same", p) for p in net.parameters()])
        problems.append("no error for duplicate names")
    except ValueError:
        pass
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters())
    net(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    if P > 1 and not any("skip_synchronize" in str(w.message) for w in caught):
        problems.append("no warning for step() after synchronize() without skip_synchronize()")
    everywhere(not problems, str(problems))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_allreduce_and_optimizer_stay_near_the_exact_ones(compression):
    """``compression=hvd.Compression.fp16`` (and mpicoll's bf16): the tensor travels as 16-bit floats, comes
    back in its own dtype within the compressed sum's bound, the same bits on every rank."""
    from mpicoll import Compression
    compressor = getattr(hvd.Compression, compression)
    x = torch.from_numpy(np.random.default_rng([shared_seed(), RANK]).standard_normal(3001) * 100)
    result = hvd.allreduce(x, op=hvd.Sum, compression=compressor)
    wire = x.to(torch.float16 if compression == "fp16" else torch.bfloat16).double().numpy()
    bound = Compression(compression).bound(P, WORLD.allreduce(np.abs(wire)))
    moved = compressor.compress(x)[0].dtype
    everywhere(moved == (torch.float16 if compression == "fp16" else torch.bfloat16) and result.dtype == torch.float64
               and bool(np.all(np.abs(result.numpy() - WORLD.allreduce(wire)) <= bound))
               and len(set(WORLD.allgather(result.numpy().tobytes()))) == 1, f"{compression}")
    torch.manual_seed(4)
    net = torch.nn.Linear(6, 2).double()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters(), compression=compressor)
    X = torch.from_numpy(np.random.default_rng([shared_seed(), RANK, 1]).standard_normal((8, 6)))
    optimizer.zero_grad()
    net(X).pow(2).sum().backward()
    exact = [WORLD.allreduce(p.grad.numpy()) / P for p in net.parameters()]
    optimizer.step()
    applied = [p.grad.numpy() for p in net.parameters()]
    everywhere(all(np.allclose(a, e, rtol=2e-2, atol=2e-2) for a, e in zip(applied, exact)),
               f"{compression}: the optimizer's averaged gradient is off")


@pytest.mark.parametrize("compression", ["fp16+ef", "powersgd"])
def test_the_optimizer_takes_mpicolls_compressions_and_keeps_their_state_per_parameter_name(compression):
    """``compression=mpicoll.Compression(..., error_feedback=True)`` or ``mpicoll.PowerSGD(...)``: the gradients
    are averaged as mpicoll compresses them (rounded, not the exact average), each parameter's state kept
    under its name, and ``hvd.Sum`` sums (the average times the ranks)."""
    from mpicoll import Compression, PowerSGD
    seed, results, states = shared_seed(), {}, {}
    X = torch.from_numpy(np.random.default_rng([seed, RANK]).standard_normal((16, 6)))
    for op in (hvd.Average, hvd.Sum):              # the same model and data, a model and compression each
        made = Compression("fp16", error_feedback=True) if compression == "fp16+ef" else \
            PowerSGD(rank=1, start_step=0, min_compression_rate=0.0)
        torch.manual_seed(5)
        net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        names = [name for name, _ in net.named_parameters()]
        net(X).pow(2).sum().backward()               # this rank's own gradients, before any hook averages them
        mine = [p.grad.numpy().copy() for p in net.parameters()]
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), op=op,
                                             named_parameters=net.named_parameters(), compression=made)
        optimizer.zero_grad()
        net(X).pow(2).sum().backward()               # (the hooks average each gradient as backward makes it)
        optimizer.step()
        results[op], states[op] = [p.grad.numpy().copy() for p in net.parameters()], made.state_dict()
    exact = [WORLD.allreduce(g) / P for g in mine]
    averaged, summed = results[hvd.Average], results[hvd.Sum]
    saved = states[hvd.Average]
    # (PowerSGD at rank 1 approximates; at a rank that covers each matrix it is exact: test_torch_compression)
    bounds = [Compression("fp16").bound(P, WORLD.allreduce(np.abs(g))) / P for g in mine]    # the documented one
    checks = {"near": compression == "powersgd" or all(bool(np.all(np.abs(a - e) <= b))
                                                      for a, e, b in zip(averaged, exact, bounds)),
              "summed": all(np.allclose(s, a * P) for s, a in zip(summed, averaged)),
              "alike": len(set(WORLD.allgather(b"".join(a.tobytes() for a in averaged)))) == 1,
              # rounded or approximated: not the exact float64 average (random data)
              "compressed": P == 1 or any(not np.array_equal(a, e) for a, e in zip(averaged, exact)),
              # a state per parameter (its name the key): a residual each, or Q factors for the two matrices
              "per name": P == 1 or (sum(key.startswith("residual" if compression == "fp16+ef" else "q")
                                         for key in saved) == (len(names) if compression == "fp16+ef" else 2))}
    everywhere(all(checks.values()), f"{compression}: {checks}; state keys {sorted(saved)}")


def test_a_compressed_optimizer_step_takes_a_joined_rank_as_zeros_and_powersgd_refuses_it():
    if P < 2:
        pytest.skip("needs a rank that joins while others still reduce")
    from mpicoll import Compression, PowerSGD
    outcome = []
    for made in (Compression("bf16", error_feedback=True), PowerSGD(rank=1, start_step=0, min_compression_rate=0)):
        weight = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0), compression=made,
                                             named_parameters=[("weight", weight)])
        if RANK == 0:
            hvd.join()
            outcome.append("joined")
            continue
        (weight * 3).sum().backward()
        try:
            optimizer.step()
            outcome.append(weight.grad.numpy().copy())
        except hvd.HorovodInternalError as error:
            outcome.append(str(error))
        hvd.join()
    if RANK == 0:
        everywhere(outcome == ["joined", "joined"], str(outcome))
    else:
        everywhere(np.allclose(outcome[0], 3.0 * (P - 1) / P, rtol=1e-2) and "PowerSGD cannot run" in outcome[1]
                   and "joined" in outcome[1], str(outcome))


def test_mpicolls_compressions_are_refused_where_they_cannot_go_saying_where_they_can():
    from mpicoll import Compression
    with pytest.raises(TypeError, match="pass them to hvd.DistributedOptimizer"):
        hvd.allreduce(torch.ones(3), compression=Compression("fp16"))
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0), op=hvd.Max,
                                 compression=Compression("bf16"))


@pytest.mark.parametrize("differ", ["kind", "powersgd-rank"])
def test_ranks_that_compress_differently_get_an_error_naming_what_each_passed(differ):
    if P < 2:
        pytest.skip("needs ranks that disagree")
    from mpicoll import Compression, PowerSGD
    weight = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.float64))
    made = (Compression("fp16" if RANK == 0 else "bf16") if differ == "kind" else
            PowerSGD(rank=1 if RANK == 0 else 2, start_step=0, min_compression_rate=0.0))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0), compression=made,
                                         named_parameters=[("weight", weight)])
    (weight * 2).sum().backward()
    with pytest.raises(hvd.HorovodInternalError, match="Mismatched allreduce compression for 'weight'"):
        optimizer.step()
