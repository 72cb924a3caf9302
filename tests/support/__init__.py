"""What the tests share, so that no test module imports another or ``conftest``.

- :mod:`.mpi`: the world this run was launched with, ``everywhere`` (fail on every rank at once), a seed
  shared by all ranks, the node checks;
- :mod:`.gpus`: device libraries or a skip, and host memory seen only through DLPack or the CUDA array
  interface;
- :mod:`.jobs`: launching real jobs as a user would (``mpiexec`` subprocesses), and what they leave behind;
- :mod:`.collectives`: random data suited to an op, tolerances, and the cases a collective test judges;
- :mod:`.problems`: toy problems and the single-process references the methods are compared with;
- :mod:`.parameter_servers`: every rule's variants, and running a parameter server's roles.
"""
