"""mpicoll.collectives.buffers: every mpi4py buffer specification read as mpi4py reads it, or refused as it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.collectives.buffers import is_in_place, read_message


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

    @pytest.mark.parametrize("spec, error, words", [
        (np.ones(3, ">f4"), BufferError, "format string '>f' with non-native byte order"),
        (np.ones((2, 3), ">f8")[:, ::2], BufferError, "not contiguous"),
        (memoryview(np.ones(3, ">i2")), BufferError, "format string '>h' with non-native byte order"),
        ([np.ones(3, np.float32), ">f"], KeyError, "cannot map '>f'"),
        ([np.ones(3, np.float32), "<f"], KeyError, "cannot map '<f'"),
        ([np.ones(3, np.float32), "=f"], KeyError, "cannot map '=f'"),
    ])
    def test_byte_orders_mpi4py_refuses_are_refused(self, spec, error, words):
        """A buffer in the other byte order (this machine is little-endian) without a datatype was read as
        native elements: a silent wrong sum.  Each is refused with mpi4py's own error class (checked against
        mpi4py itself), the message saying how to convert."""
        with pytest.raises(error):
            MPI.COMM_SELF.Bcast(spec)
        with pytest.raises(error, match=words):
            read_message(spec)

    def test_a_datatype_given_for_a_buffer_in_the_other_byte_order_reads_its_bytes_as_that_datatype(self):
        data = np.arange(3, dtype=">f4")
        message = read_message([data, MPI.FLOAT])        # mpi4py's rule too: the datatype says what the bytes are
        assert message.datatype == MPI.FLOAT and message.array.tobytes() == data.tobytes()

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
