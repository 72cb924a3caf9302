"""Push-sum gossip and Stochastic Gradient Push over MPI.

    from mpicoll.gossip import PushSum, SGP
    gossip = PushSum(MPI.COMM_WORLD, w0, graph="time-varying-exponential", tau=1)
    sgp = SGP(gossip, lr=0.1)
    z = sgp.parameters
    for batch in batches:
        z = sgp.step(gradient(z, batch))

Three pieces, each replaceable: :mod:`~mpicoll.gossip.topology` (who sends to
whom at round k), :mod:`~mpicoll.gossip.mixing` (with which shares, checked
column-stochastic), :mod:`~mpicoll.gossip.pushsum` (the protocol, over the
one-sided or point-to-point :mod:`~mpicoll.gossip.mailbox`).
"""

from .mixing import MatrixMixing, Mixing, UniformMixing, mixing_matrix, rounds_to_average
from .pushsum import MAILBOXES, SGP, PushSum
from .topology import GRAPHS, Complete, Exponential, Graph, MatrixGraph, Ring, TimeVaryingExponential, make

__all__ = ["PushSum", "SGP", "MAILBOXES", "Mixing", "UniformMixing", "MatrixMixing", "mixing_matrix", "rounds_to_average", "Graph",
           "Exponential", "TimeVaryingExponential", "Ring", "Complete", "MatrixGraph", "GRAPHS", "make"]
