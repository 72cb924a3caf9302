"""Low-communication training: replicas that train apart and meet rarely (local SGD, DiLoCo, streaming DiLoCo).

:class:`DiLoCo` is the outer loop over a replica's host arrays (:mod:`.outer`); local SGD is its plain case
(:func:`local_sgd`: outer lr 1, no momentum, the replicas averaged).  :mod:`.optimizers` has the numpy SGD
and AdamW, in torch's formulas, that ``mpicoll train`` steps with inside and DiLoCo steps with outside.
``mpicoll.torch.DiLoCo`` wraps a torch model and optimizer around the same loop; ``mpicoll train --method
localsgd|diloco`` trains with it (docs/low-communication.md).
"""

from __future__ import annotations

from .optimizers import SGD, AdamW
from .outer import DiLoCo, fragments_of

__all__ = ["DiLoCo", "local_sgd", "SGD", "AdamW", "fragments_of"]


def local_sgd(params: list, *, sync_every: int, **options) -> DiLoCo:
    """Local SGD: every ``sync_every`` inner steps the replicas' weights are replaced by their average (DiLoCo
    with an outer SGD of lr 1 and no momentum: anchor - mean(anchor - replica) = mean(replica))."""
    return DiLoCo(params, sync_every=sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False, **options)
