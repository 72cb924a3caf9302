"""Single-process tests of the pieces: buffer parsing, reductions, auto rules, settings."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import ReductionError
from mpicoll.algorithms import auto, get, names
from mpicoll.chunks import balanced_bounds, segments
from mpicoll.buffers import is_in_place, read_message
from mpicoll.config import parse_bytes
from mpicoll.reduction import Reduction, op_name


class TestReadMessage:
    def test_views_share_the_callers_memory(self):
        data = np.arange(6.0)
        message = read_message(data, writable=True)
        message.array[0] = 42
        assert data[0] == 42 and message.count == 6 and message.datatype == MPI.DOUBLE

    @pytest.mark.parametrize("spec, count, first", [
        (lambda a: [a, MPI.DOUBLE], 10, 0.0),
        (lambda a: [a, "d"], 10, 0.0),
        (lambda a: (a, 4, MPI.DOUBLE), 4, 0.0),
        (lambda a: [a, (3, 5), MPI.DOUBLE], 3, 5.0),
        (lambda a: [a.view(np.uint8), MPI.DOUBLE], 10, 0.0),
    ])
    def test_specification_forms(self, spec, count, first):
        message = read_message(spec(np.arange(10.0)))
        assert message.count == count and message.array[0] == first and message.array.dtype == np.float64

    def test_untyped_buffers_use_their_format(self):
        assert read_message(bytearray(8)).datatype == MPI.UNSIGNED_CHAR   # mpi4py says MPI.BYTE: no arithmetic
        assert read_message(memoryview(np.zeros(3, np.int32))).count == 3

    def test_mpi_buffer_objects(self):
        memory = MPI.buffer.allocate(16)
        message = read_message([memory, MPI.INT], writable=True)
        message.array[:] = [1, 2, 3, 4]
        assert message.count == 4 and np.frombuffer(memory, np.int32).tolist() == [1, 2, 3, 4]

    def test_fortran_order_is_read_in_memory_order(self):
        data = np.asfortranarray(np.arange(6.0).reshape(2, 3))
        assert list(read_message(data).array) == list(data.ravel(order="F"))

    def test_in_place_markers(self):
        assert is_in_place(MPI.IN_PLACE) and is_in_place(None) and not is_in_place(np.zeros(1))

    @pytest.mark.parametrize("spec, error, words", [
        (np.zeros(8)[::2], BufferError, "not contiguous"),
        ([np.zeros(4), 5, MPI.DOUBLE], ValueError, "need 40 bytes"),
        ([np.zeros(5, np.uint8), MPI.DOUBLE], ValueError, "not a multiple of datatype extent 8"),
        ([np.zeros(4), 2, 3, MPI.DOUBLE, 1], ValueError, "2 to 4 items"),
        ([np.zeros(4), object()], TypeError, "count must be an integer"),
        ([np.zeros(4), "not-a-type"], KeyError, "cannot map 'not-a-type'"),
        ([None, 2, MPI.INT], ValueError, "buffer is None but count is 2"),
        ([None], ValueError, "2 to 4 items"),
        (None, TypeError, "expecting buffer"),
        (object(), TypeError, "expecting buffer"),
        ([np.zeros(4), (-1, 0), MPI.DOUBLE], ValueError, "negative count"),
        ([np.zeros(4), 1, 5, MPI.DOUBLE], ValueError, "out of bounds"),
    ])
    def test_bad_specifications(self, spec, error, words):
        with pytest.raises(error, match=words):
            read_message(spec)

    def test_read_only_receive_buffer(self):
        with pytest.raises(BufferError, match="read-only"):
            read_message(bytes(8), writable=True)

    def test_padded_and_strided_datatypes_are_not_native(self):
        assert not read_message([np.zeros(4), MPI.DOUBLE_INT]).native or MPI.DOUBLE_INT.size == MPI.DOUBLE_INT.extent
        vector = MPI.DOUBLE.Create_vector(2, 1, 2).Commit()
        try:
            assert not read_message([np.zeros(6), 1, vector]).native
        finally:
            vector.Free()


class TestReduction:
    CASES = [(op, dtype) for op, dtypes in {
        "SUM": "f d e F D i l B h g", "PROD": "f d F i", "MIN": "f d i B e", "MAX": "f d i B",
        "LAND": "i B ?", "LOR": "i ?", "LXOR": "l ?", "BAND": "i B", "BOR": "h L", "BXOR": "i B",
    }.items() for dtype in dtypes.split()]

    @pytest.mark.parametrize("op, code", CASES)
    def test_matches_mpis_own_local_reduction(self, op, code):
        rng = np.random.default_rng()
        dtype = np.dtype(code)
        datatype = MPI.Datatype.fromcode(code)
        left, right = (rng.integers(0, 5, 33) if dtype.kind in "iub?" else rng.uniform(0.5, 2, 33)).astype(dtype), \
            (rng.integers(0, 5, 33) if dtype.kind in "iub?" else rng.uniform(0.5, 2, 33)).astype(dtype)
        out = np.empty_like(left)
        Reduction(getattr(MPI, op), datatype, dtype).combine(left, right, out)
        reference = right.copy()
        getattr(MPI, op).Reduce_local([left, datatype], [reference, datatype])
        assert np.array_equal(out, reference)

    @pytest.mark.parametrize("op, code", [("MAX", "D"), ("BAND", "d"), ("SUM", "?"), ("LAND", "f")])
    def test_ops_mpi_does_not_define_are_refused(self, op, code):
        with pytest.raises(ReductionError, match="not defined"):
            Reduction(getattr(MPI, op), MPI.Datatype.fromcode(code), np.dtype(code))

    def test_non_commutative_user_op_keeps_operand_order(self):
        def minus(inbuf, inoutbuf, datatype):   # inout = in - inout
            a, b = np.frombuffer(inbuf), np.frombuffer(inoutbuf)
            b[:] = a - b
        op = MPI.Op.Create(minus, commute=False)
        try:
            reduction = Reduction(op, MPI.DOUBLE, np.dtype("d"))
            left, right = np.array([5.0, 7.0]), np.array([1.0, 2.0])
            for out in (np.empty(2), left, right):
                l, r = left.copy(), right.copy()
                target = l if out is left else r if out is right else out
                reduction.combine(l, r, target)
                assert list(target) == [4.0, 5.0]
            assert not reduction.commutative and op_name(op) == "user op"
        finally:
            op.Free()

    def test_nan_propagates_through_min_and_max(self):
        reduction = Reduction(MPI.MIN, MPI.DOUBLE, np.dtype("d"))
        out = np.empty(2)
        reduction.combine(np.array([np.nan, 1.0]), np.array([0.0, 2.0]), out)
        assert np.isnan(out[0]) and out[1] == 1.0


class TestAuto:
    def test_defaults_pick_mpi_small_and_ring_large(self):
        assert auto.choose("allreduce", 8, 4) == "mpi"
        assert auto.choose("allreduce", 64 << 20, 4) == "ring"
        assert auto.choose("allreduce", 64 << 20, 1) == "mpi"
        assert auto.choose("allreduce", 64 << 20, 4, commutative=False) == "mpi"

    def test_environment_overrides(self, monkeypatch):
        monkeypatch.setenv("MPICOLL_AUTO_ALLREDUCE", "recursive_doubling:4K, parallel:1M, ring")
        assert [auto.choose("allreduce", n, 4) for n in (8, 4096, 1 << 20)] == \
            ["recursive_doubling", "parallel", "ring"]

    @pytest.mark.parametrize("rule, words", [("ring:1M", "no limit"), ("rung", "not an algorithm"), ("mpi:lots,ring", "byte")])
    def test_bad_rules_are_explained(self, monkeypatch, rule, words):
        monkeypatch.setenv("MPICOLL_AUTO_BCAST", rule)
        with pytest.raises(ValueError, match=words):
            auto.choose("bcast", 8, 4)

    def test_registry(self):
        assert set(names()) == {"ring", "parallel", "recursive_doubling", "direct", "mpi", "auto"}
        assert set(names(device=True)) == {"direct", "mpi", "auto"}
        assert get("ring").name == "ring"
        with pytest.raises(ValueError, match="Unrecognized algorithm: 'rung'"):
            get("rung")
        with pytest.raises(TypeError, match="does not serve device .* direct, mpi, auto"):
            get("ring", device=True)

    def test_device_arrays_go_to_algorithms_that_serve_them(self, monkeypatch):
        assert auto.choose("allreduce", 64 << 20, 4, device=True) == "direct"
        assert auto.choose("allreduce", 8, 1, commutative=False, device=True) == "direct"
        monkeypatch.setenv("MPICOLL_AUTO_DEVICE_ALLREDUCE", "ring")
        with pytest.raises(ValueError, match="serves device arrays"):
            auto.choose("allreduce", 8, 4, device=True)


def test_chunks_and_segments_cover_everything_once():
    for count in (0, 1, 3, 10, 1001):
        for parts in (1, 2, 3, 7):
            bounds = balanced_bounds(count, parts)
            sizes = np.diff(bounds)
            assert bounds[0] == 0 and bounds[-1] == count and sizes.max() - sizes.min() <= 1
            pieces = [s for a, b in zip(bounds, bounds[1:]) for s in segments(a, b, 4)]
            assert sum(s.stop - s.start for s in pieces) == count


@pytest.mark.parametrize("text, value", [("4096", 4096), ("256K", 262144), ("16M", 16 << 20), ("1GiB", 1 << 30)])
def test_byte_counts(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("name, options", [("sync", dict(lr=0.1)), ("softsync", dict(lr=0.1, k=0.5)),
                                           ("async", dict(lr=0.05, staleness="tau")),
                                           ("dcasgd", dict(lr=0.05, lam=0.04)),
                                           ("dcasgd", dict(lr=0.05, lam=0.04, adaptive=True)),
                                           ("downpour", dict(lr=0.3))])
def test_parameter_server_rule_state_round_trips_exactly(name, options):
    """Saved mid-run and loaded into a fresh rule, the next updates come out bit for bit the same."""
    from mpicoll import ps
    rng = np.random.default_rng()
    workers = (1, 2, 3)
    original = ps.make(name, **options)
    original.setup(rng.standard_normal(9), workers)
    for step in range(7):
        original.on_gradient(workers[step % 3], original.version, rng.standard_normal(9))
    copy = ps.make(name, **options)
    copy.setup(np.zeros(9), workers)
    copy.load_state({key: np.array(value, copy=True) for key, value in original.state().items()})
    for step in range(7, 12):
        gradient, worker = rng.standard_normal(9), workers[step % 3]
        assert original.on_gradient(worker, original.version, gradient) == copy.on_gradient(worker, copy.version,
                                                                                            gradient)
    assert np.array_equal(original.w, copy.w) and original.version == copy.version


def test_warm_start_needs_an_asynchronous_rule():
    from mpi4py import MPI
    from mpicoll import ps
    from mpicoll.ps.server import serve
    layout = ps.Layout(MPI.COMM_SELF, 4, (0,), (1,))
    with pytest.raises(ValueError, match="warm start"):
        serve(None, layout, ps.Sync(lr=0.1), np.zeros(4), warm_start=5)
