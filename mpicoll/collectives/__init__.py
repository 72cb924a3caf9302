"""The collectives: ops and reductions, buffers, the nonblocking runner, the drop-in
communicator, the array API, and the algorithms."""
