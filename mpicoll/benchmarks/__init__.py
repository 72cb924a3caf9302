"""The benchmarks behind the ``mpicoll bench*`` commands, each side by side with its peer in one run.

==========================  ===================================  ==============================================
module                      command                              measures
==========================  ===================================  ==============================================
``collectives``             ``mpicoll bench`` (under mpiexec)    every algorithm against MPI's own collective
``kernels``                 ``mpicoll bench-kernels``            every kernel and backend against a copy
``parameter_servers``       ``mpicoll bench-ps`` (mpiexec)       updates/s and GB/s by rule, size, straggler
``gossip``                  ``mpicoll bench-gossip`` (mpiexec)   push-sum averaging and SGP against allreduce
``common``                                                       option parsing, timing, JSON records
==========================  ===================================  ==============================================
"""
