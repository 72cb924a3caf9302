"""mpicoll.collectives.reduction: each op on each type as MPI defines it, in MPI's operand order."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import ReductionError
from mpicoll.compute import copy_around_caches, streaming_reducer
from mpicoll.collectives.reduction import Reduction, op_name


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


class TestStreaming:
    """Results written around the caches (mpicoll.compute.streaming): the same bits as numpy's."""

    LOOPS = [(op, code) for op in ("sum", "prod") for code in "f d i l".split()]

    @pytest.fixture(autouse=True)
    def _numba(self):
        pytest.importorskip("numba", reason="the numba extra is not installed")

    @staticmethod
    def operands(code, count, rng):
        dtype = np.dtype(code)
        draw = (lambda: rng.integers(-1000, 1000, count)) if dtype.kind == "i" else (lambda: rng.standard_normal(count))
        return draw().astype(dtype), draw().astype(dtype)

    @pytest.mark.parametrize("op, code", LOOPS)
    @pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 1000, 4099])
    def test_each_loop_matches_numpy_at_every_alignment(self, op, code, count):
        loop, numpy_op = streaming_reducer(op, code), {"sum": np.add, "prod": np.multiply}[op]
        rng = np.random.default_rng()
        for shift in (0, 1, 3, 7):                  # the vector stores start after a scalar head
            a, b = self.operands(code, count + shift, rng)
            out = np.full_like(a, 7)
            loop(out[shift:], a[shift:], b[shift:])
            assert np.array_equal(out[shift:], numpy_op(a[shift:], b[shift:]))
            assert np.all(out[:shift] == 7)         # nothing before the output is touched

    @pytest.mark.parametrize("op, code", LOOPS)
    def test_in_place_on_either_operand(self, op, code):
        loop, numpy_op = streaming_reducer(op, code), {"sum": np.add, "prod": np.multiply}[op]
        a, b = self.operands(code, 1001, np.random.default_rng())
        expected = numpy_op(a, b)
        left, right = a.copy(), b.copy()
        loop(left, left, right)
        loop(right, a, right)
        assert np.array_equal(left, expected) and np.array_equal(right, expected)

    @pytest.mark.parametrize("op, code", [("min", "f"), ("max", "d"), ("sum", "e"), ("sum", "F"), ("sum", ">f4")])
    def test_what_has_no_loop_says_so(self, op, code):
        assert streaming_reducer(op, code) is None

    def test_numpy_kernels_chosen_by_hand_turn_it_off(self, monkeypatch):
        monkeypatch.setenv("MPICOLL_KERNELS", "numpy")
        assert streaming_reducer("sum", "f") is None

    @pytest.mark.parametrize("op, code", [("SUM", "f"), ("PROD", "l"), ("MAX", "d"), ("SUM", "F")])
    def test_a_streaming_combine_gives_the_plain_ones_bits(self, op, code):
        reduction = Reduction(getattr(MPI, op), MPI.Datatype.fromcode(code), np.dtype(code))
        left, right = (np.random.default_rng().standard_normal(3001) * 10).astype(code), \
            (np.random.default_rng().standard_normal(3001) * 10).astype(code)
        for view in (slice(None), slice(1, None), slice(None, None, 2)):   # strided: the plain path
            plain, streamed = np.empty_like(left[view]), np.zeros_like(left[view])
            reduction.combine(left[view], right[view], plain)
            reduction.combine(left[view], right[view], streamed, streaming=True)
            assert np.array_equal(plain, streamed)

    @pytest.mark.parametrize("op, code", LOOPS)
    @pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 1000, 4099])
    def test_each_loop_into_two_arrays_matches_numpy_at_every_alignment(self, op, code, count):
        loop, numpy_op = streaming_reducer(op, code, into_two=True), {"sum": np.add, "prod": np.multiply}[op]
        rng = np.random.default_rng()
        width = 16 // np.dtype(code).itemsize          # elements per 16 bytes: both outputs shift alike
        for shift, apart in ((0, 0), (1, width), (3, 2 * width), (width - 1, 5 * width)):
            a, b = self.operands(code, count + shift, rng)
            out, out2 = np.full_like(a, 7), np.full(count + shift + apart, 7, a.dtype)
            loop(out[shift:], out2[shift + apart:], a[shift:], b[shift:])
            expected = numpy_op(a[shift:], b[shift:])
            assert np.array_equal(out[shift:], expected) and np.array_equal(out2[shift + apart:], expected)
            assert np.all(out[:shift] == 7) and np.all(out2[:shift + apart] == 7)   # nothing else is touched

    @pytest.mark.parametrize("op, code", [("SUM", "f"), ("PROD", "l"), ("MAX", "d"), ("SUM", "e")])
    @pytest.mark.parametrize("streaming", [False, True])
    def test_a_combine_into_a_second_array_gives_both_the_plain_ones_bits(self, op, code, streaming):
        """In one pass where the loop exists and the two outputs are 16-byte aligned alike; else a copy."""
        reduction = Reduction(getattr(MPI, op), MPI.Datatype.fromcode(code), np.dtype(code))
        rng = np.random.default_rng()
        left, right = ((rng.standard_normal(3001) * 10).astype(code) for _ in range(2))
        plain = np.empty_like(left)
        reduction.combine(left, right, plain)
        for offset in (0, 1, 16 // left.itemsize):            # aligned unlike out, and alike
            out, spare = np.zeros_like(left), np.zeros(left.size + offset, left.dtype)
            reduction.combine(left, right, out, streaming=streaming, also=spare[offset:])
            assert np.array_equal(out, plain) and np.array_equal(spare[offset:], plain)
            assert np.all(spare[:offset] == 0)

    @pytest.mark.parametrize("code", ["f", "d", "B", "e", "?", "D"])
    @pytest.mark.parametrize("count", [0, 1, 15, 63, 64, 65, 4099])
    def test_a_copy_around_the_caches_copies_every_byte_at_every_alignment(self, code, count):
        rng = np.random.default_rng()
        for shift in (0, 1, 3, 17):            # the vector stores start after a scalar head, of bytes
            source = rng.integers(0, 256, (count + shift) * np.dtype(code).itemsize, np.uint8).view(code)
            out = np.full(source.nbytes, 7, np.uint8).view(code)
            copy_around_caches(out[shift:], source[shift:])
            assert out[shift:].tobytes() == source[shift:].tobytes()
            assert set(out[:shift].tobytes()) <= {7}     # nothing before the output is touched

    def test_a_copy_of_what_has_no_loop_is_a_plain_copy(self, monkeypatch):
        source = np.arange(24.0).reshape(4, 6)
        for out, part in ((np.zeros((4, 2)), source[:, ::3]), (np.zeros((4, 6), ">f8"), source)):  # strided, other type
            copy_around_caches(out, part)
            assert np.array_equal(out, part)
        monkeypatch.setenv("MPICOLL_KERNELS", "numpy")
        out = np.zeros_like(source)
        copy_around_caches(out, source)
        assert np.array_equal(out, source)


def test_one_op_table_names_every_op_everywhere():
    """mpicoll.base.ops is the one place ops are spelled: every entry resolves by each of its names to MPI's op and
    back; the kernel layer, its numpy reference and mpicoll.torch take exactly the table's kernel ops."""
    from mpicoll.base import ops
    from mpicoll.collectives.reduction import resolve_op
    from mpicoll.compute import REDUCE_OPS, numpy_kernels
    for entry in ops.OPS:
        for name in (entry.name, entry.mpi, entry.name.upper(), *entry.spellings):
            assert resolve_op(name) == getattr(MPI, entry.mpi) and ops.find(name) is entry, name
        assert op_name(getattr(MPI, entry.mpi)) == entry.mpi and ops.of_mpi(getattr(MPI, entry.mpi)) is entry
    assert REDUCE_OPS == ("sum", "prod", "min", "max") == tuple(numpy_kernels._REDUCE)
    torch = pytest.importorskip("torch")
    import mpicoll.torch as mt
    assert set(mt.OPS.values()) == {*REDUCE_OPS, "average"} and mt.OPS["product"] == "prod"
    assert all(getattr(torch.distributed.ReduceOp, entry.torch) for entry in ops.OPS if entry.torch)


def test_op_names_of_ops_that_are_no_reduction_and_of_user_ops():
    user = MPI.Op.Create(lambda a, b, datatype: None, commute=True)
    try:
        assert (op_name(MPI.REPLACE), op_name(MPI.NO_OP), op_name(user)) == ("REPLACE", "NO_OP", "user op")
    finally:
        user.Free()
