"""Every parameter-server rule's variants, and running one parameter-server job's roles."""

from __future__ import annotations

import numpy as np

from .mpi import RANK

__all__ = ["RULE_CASES", "RULE_IDS", "run_roles", "sgd_on_my_rows"]

# Every parameter-server rule, with each of its variants (tests/ps/test_rules.py checks none is missing).
RULE_CASES = [("sync", dict(lr=0.1)), ("softsync", dict(lr=0.1, k=0.5)), ("async", dict(lr=0.05, staleness="tau")),
              ("async", dict(lr=0.1, staleness="workers")), ("dcasgd", dict(lr=0.05, lam=0.04)),
              ("dcasgd", dict(lr=0.05, lam=0.04, adaptive=True)), ("downpour", dict(lr=0.3)),
              ("ringmaster", dict(lr=0.05)), ("ringmaster", dict(lr=0.05, R=1)), ("rescaled", dict(lr=0.05))]
RULE_IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in RULE_CASES]


def run_roles(server, work=None, **serve_options):
    """One parameter-server job, every rank its role: the server ranks ``serve(**serve_options)``, each worker
    runs ``work(client)`` (nothing when None) and closes its client; then every rank gathers the final
    weights and the server is closed.  Returns (final weights, what ``serve`` returned on a server rank or
    ``work`` on a worker)."""
    if server.is_server:
        outcome = server.serve(**serve_options)
    else:
        outcome = None if work is None else work(server.client)
        server.client.close()
    final = server.gather_weights()
    server.close()
    return final, outcome


def sgd_on_my_rows(server, X, y, steps: int, seed, batch: int = 24):
    """A worker's ``work``: least-squares SGD on its rows of (X, y) (worker i takes rows i, i + n, ...),
    ``steps`` exchanges of a gradient of ``batch`` rows drawn from ``seed`` and its rank."""
    def work(client):
        me, count = server.layout.workers.index(RANK), len(server.layout.workers)
        rows, targets = X[me::count], y[me::count]
        rng = np.random.default_rng([seed, RANK])
        w = client.pull().copy()
        for _ in range(steps):
            pick = rng.integers(0, len(targets), batch)
            w = client.exchange(rows[pick].T @ (rows[pick] @ w - targets[pick]) / batch).copy()
    return work
