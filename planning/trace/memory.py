"""Peak memory of a step by category, from the storages alive at each moment: torch's memory trackers
(torch.distributed._tools) cannot serve the run's step, hence this small one.

Why not MemTracker / FSDPMemTracker: MemTracker refuses a module called twice in a step ("MemTracker does not support
memory tracking for multiple iterative calls"), which every microbatch loop and pipeline schedule does, and it
costs O(ops x modules) (the spike: 247 s for a 70B rank); FSDPMemTracker serves FSDP layouts only. The same tracker
must also run on real tensors, to check the trace against real processes category by category.

How: every storage an op creates is registered with the phase it was born in (backward or the optimizer step:
temporaries; otherwise activations; a collective's tensors: communication), and its bytes leave the total when
Python frees it (a weak reference). Storages resized in place (FSDP2 gathers a block's parameters into storages it
resizes, which no op sees) are followed through UntypedStorage.resize_. At snapshots the live storages are
classified by what holds them now (at the next op or hook: never while torch frees a tensor): the parts' parameters
(the rank's shards, and FSDP's gathered copies while they are registered), their gradients, the optimizer's state;
a storage keeps the last class it was found in (a gradient freed by zero_grad was a gradient). Snapshots are taken
at each new peak of the total (just before the next free, when the peak's storages are all still alive), likewise at
each new peak of a category as last classified, at the end of each forward of a part, and around the optimizer step.
`category_peaks` is each category's largest snapshot.
"""
from __future__ import annotations

import weakref

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _is_collective(func) -> bool:
    from planning.trace.collectives import kind_of

    return kind_of(func) is not None


class MemoryByCategory(TorchDispatchMode):
    """Enter around the step (inside the fake mode, if any); then `peak_bytes`, `at_peak` (the categories of the
    peak, summing to it) and `category_peaks` (each category's own largest value)."""

    def __init__(self, modules: list[torch.nn.Module], optimizers: list = ()):
        super().__init__()
        self.modules, self.optimizers = modules, list(optimizers)
        self.live: dict[int, list] = {}       # id(storage) -> [bytes, category, weak reference]
        self.total = self.peak_bytes = 0
        self.at_peak = dict.fromkeys(CATEGORIES, 0)
        self.category_peaks = dict.fromkeys(CATEGORIES, 0)
        self.sums = dict.fromkeys(CATEGORIES, 0)  # live bytes by the category each storage was last given
        self._pending = False                 # a new peak (of the total or of a category) not yet classified
        self._held = None                     # (the live storages at a peak: id -> [bytes, category], the total's?)
        self._in_optimizer = False

    # -- what allocations become ------------------------------------------------------------------------------
    def _born(self) -> str:
        if self._in_optimizer or torch._C._current_graph_task_id() != -1:  # in the optimizer step or in backward
            return "temporaries"
        return "activations"

    def _register(self, storage, category: str) -> None:
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = [0, category, weakref.ref(storage, lambda _, k=key: self._freed(k))]
        self._grew(key, storage.nbytes())

    def _grew(self, key: int, nbytes: int) -> None:
        entry = self.live[key]
        entry[0] += nbytes
        self.total += nbytes
        self.sums[entry[1]] += nbytes
        if self.total > self.peak_bytes:
            self.peak_bytes, self._pending = self.total, True
        elif self.sums[entry[1]] > self.category_peaks[entry[1]]:
            self._pending = True

    def _shrink(self, key: int, nbytes: int) -> None:
        if self._pending:  # the peak's storages are all alive until this first free after it: kept, to be
            # classified at the next op or hook (not here: this may run while torch frees a tensor, when reading
            # other tensors' storages crashed the process, a segmentation fault after FSDP's post_backward)
            self._held = ({k: [e[0], e[1]] for k, e in self.live.items()}, self.total == self.peak_bytes)
            self._pending = False
        self.total -= nbytes
        self.live[key][0] -= nbytes
        self.sums[self.live[key][1]] -= nbytes

    def _freed(self, key: int) -> None:
        if key in self.live:
            self._shrink(key, self.live[key][0])
            del self.live[key]

    def _resize(self, storage, size: int) -> None:
        key = id(storage)
        if key not in self.live:
            self._register(storage, self._born())
            return
        delta = size - self.live[key][0]
        if delta < 0:
            self._shrink(key, -delta)
        else:
            self._grew(key, delta)

    # -- classification ---------------------------------------------------------------------------------------
    def _holders(self) -> dict[int, tuple]:
        """id(storage) -> (category, storage) of what the parts and the optimizers hold now."""
        held = {}

        def hold(t, category):
            st = _local(t).untyped_storage()
            held[id(st)] = (category, st)

        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        hold(v, "optimizer")
        for m in self.modules:
            for p in m.parameters():
                hold(p, "parameters")
                if p.grad is not None:
                    hold(p.grad, "gradients")
        return held

    def _classify(self) -> None:
        for key, (category, storage) in self._holders().items():
            if key in self.live:
                self.live[key][1] = category
            elif storage.nbytes():  # held but made before the tracker (the parameters) or outside any op it saw
                self._register(storage, category)

    def _account(self, entries, peak: bool) -> dict:
        sums = dict.fromkeys(CATEGORIES, 0)
        for nbytes, category, *_ in entries:
            sums[category] += nbytes
        for c in CATEGORIES:
            self.category_peaks[c] = max(self.category_peaks[c], sums[c])
        if peak:
            self.at_peak = dict(sums)
        return sums

    def snapshot(self, peak: bool = False) -> None:
        self._classify()
        if self._held is not None:  # a peak kept at a free: its storages as classified now (the freed: as they were)
            held, was_peak = self._held
            self._held = None
            self._account([[n, self.live[k][1] if k in self.live else c] for k, (n, c) in held.items()], was_peak)
        self.sums = self._account(self.live.values(), peak or (self._pending and self.total == self.peak_bytes))
        self._pending = False

    # -- the mode ---------------------------------------------------------------------------------------------
    def __enter__(self):
        self._fake_on_entry = active_fake_mode()
        self._resize_saved = torch.UntypedStorage.resize_
        tracker, original = self, self._resize_saved

        def resize_(storage, size):
            original(storage, size)
            tracker._resize(storage, size)
        torch.UntypedStorage.resize_ = resize_
        self._hooks = []
        for opt in self.optimizers:
            self._hooks += [opt.register_step_pre_hook(lambda *a: self._optimizer(True)),
                            opt.register_step_post_hook(lambda *a: self._optimizer(False))]
        for m in self.modules:
            self._hooks.append(m.register_forward_hook(lambda *a: self.snapshot()))
        self.snapshot()
        self.peak_bytes, self._pending, self.at_peak = self.total, False, dict(self.category_peaks)
        self.start_bytes = self.total  # what the rank held before the step (its parameters)
        return super().__enter__()

    def _optimizer(self, entering: bool) -> None:
        self.snapshot()
        self._in_optimizer = entering

    def __exit__(self, *args):
        self.snapshot()
        torch.UntypedStorage.resize_ = self._resize_saved
        for h in self._hooks:
            h.remove()
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # see the local tensors' ops DTensor turns it into
        if self._pending or self._held is not None:
            self.snapshot()
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            out = args[0]  # its fake implementation returns a new tensor; the real one returns its input (MemTracker)
        else:
            out = func(*args, **kwargs)
        if active_fake_mode() is not self._fake_on_entry:
            return out  # DTensor's sharding propagation, on global shapes in a fake mode of its own
        collective = _is_collective(func)
        for t in tree_leaves((args, kwargs, out) if collective else out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                storage = t.untyped_storage()
                self._register(storage, "communication" if collective else self._born())
                if collective and id(storage) in self.live and self.live[id(storage)][1] != "parameters":
                    self.live[id(storage)][1] = "communication"
        return out

    def result(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "start_bytes": self.start_bytes, "by_category": dict(self.at_peak),
                "category_peaks": dict(self.category_peaks)}
