"""DiLoCo and local SGD around a torch model and its optimizer (:class:`mpicoll.diloco.DiLoCo`'s outer loop).

    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    with mt.DiLoCo(model, inner, sync_every=100, outer_lr=0.7, outer_momentum=0.9) as diloco:
        for x, y in data:                      # this rank's shard
            inner.zero_grad()
            loss_fn(model(x), y).backward()
            inner.step()                       # every 100th step the replicas meet (DiLoCo's outer step)
    # here every replica holds the same weights

The training loop is the single-process one: the inner optimizer's steps are counted by a hook on it
(``register_step_post_hook``), as torchft's DiLoCo wraps a loop.  Every rank must start from the same weights
(``mt.broadcast_parameters(model.state_dict())``).  The replicas meet over ``comm`` (an MPI or mpicoll
communicator, default COMM_WORLD) through mpicoll's allreduce, or over a torch.distributed ``group`` (any
backend: gloo, the "mpicoll" backend) through ``dist.all_reduce``.  Parameters only are averaged (buffers,
such as batch norm's running statistics, stay each replica's, as in torchft).  The model's parameters must
be CPU tensors: the outer loop keeps its anchor and momentum in host memory beside them.
"""

from __future__ import annotations

import numpy as np
import torch

from ..diloco import DiLoCo as Outer

__all__ = ["DiLoCo", "local_sgd"]


class DiLoCo:
    """``model``'s replica on this rank, meeting the others every ``sync_every`` steps of ``inner_optimizer``:
    their average pseudo-gradient through an outer SGD with ``outer_lr``, ``outer_momentum`` (Nesterov unless
    ``nesterov=False``); ``fragments``, ``overlap``, ``mix`` streaming, ``compression`` "fp16"/"bf16"/"int8" or a
    :class:`mpicoll.Compression` (over ``comm`` only), as :class:`mpicoll.diloco.DiLoCo` says."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1,
                 overlap: int = 0, mix: float = 0.0, compression=None, comm=None, group=None,
                 algorithm: str = "auto"):
        parameters = [p for p in model.parameters()]
        if not parameters:
            raise ValueError("DiLoCo: the model has no parameters")
        away = sorted({str(p.device) for p in parameters if p.device.type != "cpu"})
        if away:
            raise ValueError(f"DiLoCo keeps its anchor in host memory beside the weights: the model's parameters "
                             f"must be CPU tensors (found {', '.join(away)})")
        arrays = [p.detach().numpy() for p in parameters]        # the parameters' own memory
        if group is not None or (comm is None and torch.distributed.is_initialized()):
            if comm is not None:
                raise ValueError("DiLoCo: comm= or group=, not both")
            if compression is not None:
                raise ValueError("DiLoCo: compression= goes through mpicoll's allreduce: pass comm= (an MPI "
                                 "communicator), not a torch.distributed group")
            transport = dict(start_sum=lambda buffer: torch.distributed.all_reduce(
                torch.from_numpy(buffer), group=group, async_op=True),
                replicas=torch.distributed.get_world_size(group))
        else:
            transport = dict(comm=comm, algorithm=algorithm)
        self.model, self.inner_optimizer = model, inner_optimizer
        self.outer = Outer(arrays, sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                           nesterov=nesterov, fragments=fragments, overlap=overlap, mix=mix,
                           compression=compression, **transport)
        self._hook = inner_optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self.outer.step())

    def __repr__(self) -> str:
        return f"mpicoll.torch.{self.outer!r}"

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.finish()
        else:
            self._hook.remove()

    def finish(self) -> None:
        """After the last step (``with`` does it): the meetings in flight applied, a last meeting of every
        fragment that stepped since its own, so every replica holds the same weights; the hook removed."""
        self._hook.remove()
        with torch.no_grad():
            self.outer.finish()

    @property
    def meetings(self) -> int:
        return self.outer.meetings

    def state_dict(self) -> dict:
        """The outer loop's state (with the inner optimizer's own ``state_dict`` and the model's, what resumes a
        run to the bit): numpy arrays sharing nothing with the live state (``torch.save`` takes them; the
        compression's residuals may be bfloat16, which torch tensors cannot view)."""
        return {k: np.array(v) for k, v in self.outer.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict({k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in state.items()})


def local_sgd(model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
              **options) -> DiLoCo:
    """Local SGD: every ``sync_every`` steps the replicas' weights become their average (DiLoCo with an outer
    SGD of lr 1 and no momentum)."""
    return DiLoCo(model, inner_optimizer, sync_every=sync_every, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                  **options)
