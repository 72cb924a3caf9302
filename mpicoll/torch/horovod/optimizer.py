"""Horovod's ``DistributedOptimizer``: each gradient allreduced under its parameter's name as backward makes it.

A hook on every parameter that requires a gradient starts the allreduce of
that gradient (named after the parameter, so ranks that produce gradients in
another order still match them) once it has accumulated
``backward_passes_per_step`` times; ``step()`` first waits for all of them
(``synchronize``).  With ``groups`` the gradients of a group go together as one
grouped allreduce.  This follows Horovod's behaviour, warnings and errors
included; mpicoll's own :class:`mpicoll.torch.DistributedOptimizer` fuses
gradients into buckets instead and is faster where every rank computes the
same gradients in the same order.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from ...base.errors import Unsupported
from ..collectives import compressible
from .basics import global_process_set, size
from .compression import Compression, is_mpicolls
from .functions import broadcast_object
from .ops import (Adasum, Average, Sum, allreduce_async_, compressed_allreduce_async_, grouped_allreduce_async_,
                  sparse_allreduce_async, synchronize)

__all__ = ["DistributedOptimizer"]


class _Averaging:
    """The methods a distributed optimizer adds to its torch optimizer's class (see the module docstring)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)
        # mpicoll's compressions (not Horovod's casts) run inside the op, on the values: see _compressible
        self._compression, self._reducer = (Compression.none, compression) if is_mpicolls(compression) else \
            (compression, None)
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)
                                for j, p in enumerate(group["params"])]
        if any(not isinstance(item, tuple) for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters().")
        names = [name for name, _ in named_parameters]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                             + ", ".join(duplicates))
        unnamed = {id(p) for group in self.param_groups for p in group["params"]} - \
            {id(p) for _, p in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             "Python object ids: " + ", ".join(map(str, sorted(unnamed))))
        self._parameter_names = {p: name for name, p in sorted(named_parameters, key=lambda item: item[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        self.sparse_as_dense, self.process_set = sparse_as_dense, process_set
        self._handles: dict = {}             # parameter (or group tuple) -> (handle or None, compression context)
        self._requires_update: set = set()
        self._synchronized, self._should_synchronize = False, True
        self._groups, self._group_of, self._group_counts = groups, {}, {}
        if process_set.included() and size() > 1:
            self._register_hooks()

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized, self._should_synchronize = False, True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super(self.__class__, self).load_state_dict(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def _register_hooks(self) -> None:
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is not None:
            # every rank groups the parameters in rank 0's order of names
            order = broadcast_object([self._parameter_names.get(p) for p in trainable], root_rank=self.process_set.ranks[0],
                                     process_set=self.process_set)
            trainable = sorted(trainable, key=lambda p: order.index(self._parameter_names.get(p)))
            for group in self._split_groups(trainable):
                for p in group:
                    self._group_of[p] = group
                self._group_counts[group] = 0
        for p in trainable:
            self._requires_update.add(p)
            p.register_post_accumulate_grad_hook(self._hook)

    def _split_groups(self, trainable: list) -> list[tuple]:
        if isinstance(self._groups, list):
            ids = {id(p) for p in trainable}
            groups = [tuple(p for p in group if id(p) in ids) for group in self._groups]
            grouped = {id(p) for group in groups for p in group}
            groups += [(p,) for p in trainable if id(p) not in grouped]
            return [group for group in groups if group]
        count = self._groups
        per, extra = divmod(len(trainable), count)
        bounds = [0]
        for i in range(count):
            bounds.append(bounds[-1] + per + (1 if i < extra else 0))
        return [tuple(trainable[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]

    def _start(self, p):
        """Start the allreduce of ``p``'s gradient: (handle, compression context)."""
        if p.grad is None:
            p.grad = p.data.new(p.size()).zero_()
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=self._parameter_names.get(p), op=self.op,
                                              process_set=self.process_set), None
            tensor = tensor.to_dense()
            p.grad = tensor
        prescale, postscale = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) \
            if self.op == Average else (1.0, 1.0)
        if self._compressible([tensor]):
            return compressed_allreduce_async_([tensor], self._parameter_names.get(p), self.op, prescale, postscale,
                                               self.process_set, self._reducer, finish=lambda done: done[0]), None
        compressed, context = self._compression.compress(tensor)
        return allreduce_async_(compressed, name=self._parameter_names.get(p), op=self.op, prescale_factor=prescale,
                                postscale_factor=postscale, process_set=self.process_set), context

    def _compressible(self, tensors: list) -> bool:
        """Whether mpicoll's compression moves all these gradients (:func:`mpicoll.torch.collectives.compressible`,
        the rule :class:`mpicoll.torch.DistributedOptimizer` follows); others travel as they are."""
        return all(compressible(t, self._reducer) for t in tensors)

    def _start_group(self, group: tuple):
        grads = [p.grad for p in group]
        if self._compressible(grads):
            return compressed_allreduce_async_(grads, self._parameter_names.get(group[0]), self.op, 1.0, 1.0,
                                               self.process_set, self._reducer), [None] * len(grads)
        compressed, contexts = zip(*[self._compression.compress(p.grad) for p in group])
        return grouped_allreduce_async_(list(compressed), name=self._parameter_names.get(group[0]), op=self.op,
                                        process_set=self.process_set), contexts

    def _hook(self, p) -> None:
        if p in self._handles and self._handles[p][0] is not None and self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        started = (None, None)
        if self._delay[p] == 0:
            if self._groups is not None:
                group = self._group_of[p]
                self._group_counts[group] += 1
                if self._group_counts[group] == len(group):
                    self._handles[group] = self._start_group(group)
                    for member in group:
                        self._handles.pop(member, None)
                    self._group_counts[group] = 0
                    return
            else:
                started = self._start(p)
        self._handles[p] = started

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting those no hook started: parameters this rank did not
        use), and put the results in the gradients."""
        if not self.process_set.included():
            self._synchronized = True
            return
        started = set()
        for key in self._handles:
            started.update(key if isinstance(key, tuple) else (key,))
        for p in self._requires_update - started:
            self._handles[p] = self._start(p)
        for p, (handle, context) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._start(p)
        for key, (handle, context) in self._handles.items():
            if isinstance(key, tuple):
                for p, output, each in zip(key, synchronize(handle), context):
                    self._delay[p] = self.backward_passes_per_step
                    p.grad.set_(self._compression.decompress(output, each))
                self._group_counts[key] = 0
                continue
            output = synchronize(handle)
            self._delay[key] = self.backward_passes_per_step
            if self._groups is not None:
                self._group_counts[self._group_of[key]] = 0
            if key.grad.is_sparse:
                reduced = self._compression.decompress(output, context)
                key.grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
            else:
                key.grad.set_(self._compression.decompress(output, context))
        self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this does not synchronize (after an explicit ``synchronize()``, to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set):
    """Horovod's ``DistributedOptimizer``: an optimizer of ``optimizer``'s class over its parameter groups whose
    gradients are averaged (``op``) over the ranks of ``process_set`` before each step.

    ``compression``: Horovod's (``hvd.Compression.fp16``, ``.bf16``: the gradient is cast, reduced as 16-bit
    floats and cast back), or mpicoll's: a :class:`mpicoll.Compression` (16-bit words summed by their owners in
    full precision, with error feedback if asked: each parameter's residual kept under its name) or a
    :class:`mpicoll.PowerSGD` (each weight matrix as low-rank factors, its state kept under its name; host
    gradients); float32 and float64 gradients compress, others travel as they are (docs/compression.md)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum:
        raise Unsupported("DistributedOptimizer: Adasum is not supported by mpicoll's Horovod API")
    if is_mpicolls(compression) and op not in (Average, Sum):
        raise ValueError("DistributedOptimizer: mpicoll's compressions move sums and averages: op must be "
                         "hvd.Average or hvd.Sum")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    methods = {k: v for k, v in vars(_Averaging).items() if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)
