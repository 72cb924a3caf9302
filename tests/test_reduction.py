"""mpicoll.reduction: each op on each type as MPI defines it, in MPI's operand order."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll import ReductionError
from mpicoll.reduction import Reduction, op_name


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
