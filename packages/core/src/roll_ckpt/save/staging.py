"""Staging: the one place where a save decides how each tensor is captured.

A save's state dict holds live tensors the training loop will change as soon as ``save``
returns. :func:`stage_state_dict` asks the staging policies (:class:`StagingPolicy`
objects that plugins register through ``roll_ckpt_staging_policies``), in order, which
one claims each tensor (a policy that says, once per save, that it can claim nothing there,
``active(save)`` false, is not asked); the first claim wins and core's
:class:`~roll_ckpt.save.staging.RegularCopy` takes the rest. Each policy then stages its
tensors in one call and is released once the write has finished. Non-tensor values are
copied when mutable (DCP pickles them during the write).

A synchronous save goes through the same policies (``save.is_async`` false): a policy
then only hands the write what it reads (the live tensor, a store's alias, a rebuilt
shard), copying nothing, and nothing is counted in ``SaveStats.policies``.

The walk is one pass over the state dict: each tensor's place in the staged copy is
remembered and filled once its policy has staged it, so a state of thousands of tensors
costs a few microseconds per tensor.

**The regular copy.** Core's regular staging: tensors copied into CPU buffers laid out once and reused.

Every tensor no plugin claims ends here. The buffers are one flat *arena* per dtype, laid
out for the set of tensors staged: a state of thousands of small tensors is copied with
one ``torch.cat`` per dtype into its arena, not one buffer and one copy call each. The
DTensor wrappers around the arena's views (mesh, placements, global shape and stride of
the source) are built once and reused while the layout lasts; a change of names, shapes,
dtypes or source tensors makes a new layout (detected, never assumed).

Between saves the buffers hold no memory (``strategy_config.keep_staging_buffers: false``,
the default): once a save is written their storage is freed, and it is allocated and
touched again off the loop before the next save the manager knows of (``maybe_save`` the
step before a save step, or :meth:`~roll_ckpt.CheckpointManager.prepare_save`), in the
writer thread. The layout and its DTensor wrappers stay: only the memory under them goes.
A save nobody announced allocates the memory in the call (fresh pages: about 5x the copy's
time). ``keep_staging_buffers: true`` keeps the state's size in host memory for the whole job
and allocates nothing at a save.

With ``strategy_config.max_staging_bytes`` the staging buffers never hold more than that
budget: the tensors are staged in *waves* that fit half of it, and the writer writes one
half while the caller fills the other (:class:`WaveGate`); ``save`` returns once the last
wave is staged. A tensor larger than half the budget is written straight from the live
tensor while the caller waits.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from ..contracts import SaveContext, StagingPolicy

__all__ = ['stage_state_dict', 'RegularCopy', 'Arenas', 'WaveGate']


# ---- staging ---------------------------------------------------------------

def stage_state_dict(sd: Mapping[str, Any], save: SaveContext, policies: Sequence[StagingPolicy]) -> dict[str, Any]:
    """What the write of ``sd`` reads: each tensor captured by the first policy claiming it
    (``policies`` in order, a ``RegularCopy`` last). The time it takes counts in the
    caller's blocked time, which the save pipeline measures around the whole call.

    Each policy that staged something is released once the write has finished or failed
    (``save.run_finished_callbacks``)."""
    # a policy that can claim nothing in this save (``active``) is not asked per tensor
    policies = [p for p in policies if not hasattr(p, "active") or p.active(save)]
    # core's regular copy, last, claims every tensor: it takes what the others leave unasked
    asked = policies[:-1] if policies and isinstance(policies[-1], RegularCopy) else policies
    torch = sys.modules.get("torch")  # a process that never imported torch holds no tensors (a driver)
    tensor_type: Any = torch.Tensor if torch is not None else ()
    claimed: list[list[tuple[str, Any]]] = [[] for _ in policies]
    places: list[list[tuple[Any, Any]]] = [[] for _ in policies]

    def visit(value: Any, name: str, container: Any, key: Any) -> Any:
        if type(value) is dict:  # the common container first: isinstance(.., Mapping) is slow
            out: dict[Any, Any] = {}
            for k, v in value.items():
                out[k] = visit(v, f"{name}.{k}" if name else str(k), out, k)
            return out
        if isinstance(value, tensor_type):
            for i, policy in enumerate(asked):
                if policy.claims(name, value, save):
                    break
            else:
                i = len(asked)  # the regular copy's, or, without it, nobody's: the tensor as it is
            if i < len(policies):
                claimed[i].append((name, value))
                places[i].append((container, key))
                return None  # filled below, once the policy has staged it
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                out[k] = visit(v, f"{name}.{k}" if name else str(k), out, k)
            return out
        if isinstance(value, list):
            items: list[Any] = [None] * len(value)
            for i, v in enumerate(value):
                items[i] = visit(v, f"{name}.{i}", items, i)
            return items
        if isinstance(value, (tuple, set, bytearray)):  # a tuple: one value to DCP, pickled whole (its tensors too)
            return _copy_value(value, tensor_type, save.is_async)
        return value  # immutable, or an object DCP pickles as it is (copying it could run its code)

    staged = visit(sd, "", None, None)
    for i, policy in enumerate(policies):
        if not claimed[i]:
            continue
        results = policy.stage(claimed[i], save)
        save.on_finished(functools.partial(policy.release, save))
        for (container, key), result in zip(places[i], results):
            container[key] = result
    claimed.clear()  # visit() refers to itself: its cycle must not keep the tensors alive
    places.clear()
    return staged


def _copy_value(value: Any, tensor_type: Any, clone: bool) -> Any:
    """A value DCP pickles whole (a tuple), its containers rebuilt and, for an asynchronous
    save, its tensors cloned: each then has a storage of its own size, which is what
    ``torch.save`` writes (a view into a larger buffer would drag the whole buffer along).
    Non-tensor leaves are pickled by DCP when written: mutable plain ones (sets, bytearrays)
    are copied now; other objects are kept as they are: copying them could run their code."""
    if isinstance(value, tensor_type):
        return value.detach().clone() if clone else value
    if isinstance(value, Mapping):
        return {k: _copy_value(v, tensor_type, clone) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_copy_value(v, tensor_type, clone) for v in value]
        return out if isinstance(value, list) else tuple(out)
    return copy.deepcopy(value) if isinstance(value, (set, bytearray)) else value


# ---- the regular copy ------------------------------------------------------

_WAIT_S = 5.0
_KEPT_LAYOUTS = 2


class RegularCopy:
    """Core's fallback: copy into CPU buffers laid out once (pinned on GPU machines)."""

    name = "regular"
    description = "copy into CPU staging buffers laid out once, small tensors batched in one arena per dtype, " \
                  "their memory freed between saves (pinned on GPU machines; strategy_config.max_staging_bytes " \
                  "bounds them, keep_staging_buffers keeps them)"

    def claims(self, name: str, tensor: Any, save: SaveContext) -> bool:
        return True

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext) -> list[Any]:
        if not save.is_async:
            return [tensor for _, tensor in items]
        arenas = save.reuse.get(self.name)
        if arenas is None:
            arenas = save.reuse[self.name] = Arenas()
        return arenas.stage(items, save, self.name, save.budget)

    def release(self, save: SaveContext) -> None:
        """The write is done: free the buffers' memory unless they are kept or a save is near
        (the manager runs one save at a time, so nothing else reads them now)."""
        arenas = save.reuse.get(self.name)
        if arenas is not None and not save.keep_buffers:
            arenas.free()

    def prepare(self, reuse: Any) -> Callable[[], None] | None:
        """A save is near (the caller's thread): the write in flight keeps the buffers, and
        what the writer thread runs next brings their memory back, touched, so the save only copies."""
        arenas = reuse.get(self.name)
        if arenas is None:
            return None
        arenas.wanted = True  # (before ready() is queued behind the write in flight)
        return arenas.ready


class Arenas:
    """The arenas and wrappers of the latest layout (one per manager, in ``save.reuse``).

    Their memory can be freed and made again under the same tensors (the storage resized):
    the views and wrappers built for the layout stay valid. ``_lock`` orders the caller's
    copy against the writer thread's :meth:`free` and :meth:`ready`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.wanted = False
        """A save is near: the write in flight must not free the buffers (set in the caller's
        thread by :meth:`RegularCopy.prepare`; the next save's copy clears it)."""
        self._layout: tuple = ()
        self._arenas: dict[Any, Any] = {}
        self._views: list[Any] = []
        self._outputs: list[tuple[Any, Any]] = []
        self._flats: list[Any] = []
        self._kept: dict[tuple, tuple] = {}

    def stage(self, items: Sequence[tuple[str, Any]], save: SaveContext, policy: str, budget: int) -> list[Any]:
        from ..runtime.torch_compat import local_tensor, rewrap_dtensor

        locals_ = [local_tensor(t) for _, t in items]
        total = sum(t.nbytes for t in locals_)
        if budget and total > budget:
            return WaveGate.start(items, locals_, save, policy, budget, self)
        layout = tuple((name, tuple(t.shape), t.dtype, t.device.type) for (name, _), t in zip(items, locals_))
        with self._lock:
            self.wanted = False
            if layout != self._layout:
                save.bytes_allocated += self._switch(layout)
            # a save nobody announced: fresh pages, in the call
            save.bytes_allocated += self._restore(self._arenas, touch=False)
            self._copy(locals_)
        # what note_staged records per tensor, for all of them at once: every byte was copied
        save.staging.update(dict.fromkeys([name for name, _ in items], policy))
        save.bytes_copied += total
        # what the write reads: the arena's view, a DTensor's wrapped around it (as the source's
        # mesh and placements), built once per source tensor and reused while it lasts
        outputs = []
        for i, ((_, src), local) in enumerate(zip(items, locals_)):
            cached_src, out = self._outputs[i]
            if cached_src is not src:
                out = self._views[i] if local is src else rewrap_dtensor(src, self._views[i])
                self._outputs[i] = (src, out)
            outputs.append(out)
        return outputs

    def ready(self) -> None:
        """The latest layout's memory allocated and every page touched (off the loop)."""
        with self._lock:
            if self.wanted:
                self._restore(self._arenas, touch=True)

    def free(self) -> None:
        """Give the memory of every layout's arenas back (a near save keeps it)."""
        with self._lock:
            if self.wanted:
                return
            try:
                for arenas in [self._arenas] + [kept[0] for kept in self._kept.values()]:
                    for arena in arenas.values():
                        arena.untyped_storage().resize_(0)
            except RuntimeError:  # a storage that cannot be resized: the layout goes, laid out again next time
                self._layout, self._arenas, self._views, self._outputs, self._flats = (), {}, [], [], []
                self._kept.clear()

    @staticmethod
    def _restore(arenas: dict[Any, Any], *, touch: bool) -> int:
        """Bring back the memory of ``arenas`` that was freed; the bytes allocated."""
        allocated = 0
        for arena in arenas.values():
            storage = arena.untyped_storage()
            if storage.nbytes() < arena.nbytes:
                storage.resize_(arena.nbytes)
                allocated += arena.nbytes
                if touch:  # the kernel's page faults and zeroing, here instead of in the copy
                    arena.zero_()
        return allocated

    def _switch(self, layout: tuple) -> int:
        """Use ``layout``'s arenas: kept from an earlier save (a job that saves both with its
        state offloaded and live alternates between two), else made; the bytes allocated."""
        self._kept[self._layout] = (self._arenas, self._views, self._outputs, self._flats)
        allocated = 0
        if layout in self._kept:
            self._arenas, self._views, self._outputs, self._flats = self._kept.pop(layout)
            self._layout = layout
        else:
            self._lay_out(layout)
            allocated = sum(arena.nbytes for arena in self._arenas.values())
        while len(self._kept) > _KEPT_LAYOUTS - 1:
            self._kept.pop(next(iter(self._kept)))
        return allocated

    def _lay_out(self, layout: tuple) -> None:
        import torch

        sizes: dict[Any, int] = {}
        spans = []
        for _, shape, dtype, device in layout:
            n = 1
            for d in shape:
                n *= d
            key = (dtype, device)
            spans.append((key, sizes.get(key, 0), n, shape))
            sizes[key] = sizes.get(key, 0) + n
        pin = torch.cuda.is_available() and any(device == "cuda" for *_, device in layout)
        self._arenas = {key: torch.empty(n, dtype=key[0], pin_memory=pin) for key, n in sizes.items()}
        self._views = [self._arenas[key].narrow(0, off, n).view(shape) for key, off, n, shape in spans]
        self._outputs = [(None, None)] * len(layout)
        self._flats = [None] * len(layout)
        self._layout = layout

    def _copy(self, locals_: list[Any]) -> None:
        import torch

        by_arena: dict[Any, list[Any]] = {}
        for i, t in enumerate(locals_):
            # t as one flat view, kept across saves while t is the same tensor over the same memory
            # (a new flat view per tensor per save is an allocation the garbage collector counts:
            # thousands per save set off collections of the whole heap)
            cached, ptr = self._flats[i], t.data_ptr()
            if cached is not None and cached[0] is t and cached[1] == ptr:
                flat = cached[2]
            else:
                flat = t.reshape(-1)
                # only a view stays current: a copy (t not contiguous) is made again every time
                self._flats[i] = (t, ptr, flat) if t.is_contiguous() and flat.data_ptr() == ptr else None
            by_arena.setdefault((t.dtype, t.device.type), []).append(flat)
        for (dtype, device), sources in by_arena.items():
            arena = self._arenas[(dtype, device)]
            if device == "cpu":  # one call for the whole dtype: the copies loop in C++
                torch.cat(sources, out=arena)
        views = iter(self._views)
        for t, view in zip(locals_, views):
            if t.device.type != "cpu":  # device-to-host, into pinned memory, asynchronous
                view.copy_(t.detach(), non_blocking=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()



class WaveGate:
    """Regular staging within a budget: the caller fills the arena's halves in turn, the
    writer writes each half's tensors once they are there and hands the half back.

    The writer asks :meth:`order` for the order to write in, calls :meth:`expect` with the
    tensors its plan writes (DCP gives a tensor every rank holds alike to one rank only:
    the others must not wait for it), then :meth:`before`/:meth:`after` around each one.
    The caller (``save``) returns from :meth:`fill` once the last wave is staged.
    """

    def __init__(self, waves: list[list[int]], names: list[str]) -> None:
        self.waves = waves
        self.names = names
        self.wave_of = {names[i]: w for w, idx in enumerate(waves) for i in idx}
        self.staged = [threading.Event() for _ in waves]
        self.pending = [set(names[i] for i in idx) for idx in waves]
        self.freed = [threading.Event() for _ in waves]
        self.error: BaseException | None = None
        self.caller_done = threading.Event()
        """Set once the caller recorded its blocked time (the writer reads it after)."""
        self.direct: list[bool] = []
        self.copied: list[int] = []
        self._lock = threading.Lock()
        self._fill: Any = None

    @classmethod
    def start(cls, items: Sequence[tuple[str, Any]], locals_: list[Any], save: SaveContext, policy: str,
              budget: int, arenas: Arenas) -> list[Any]:
        import torch

        from ..runtime.torch_compat import rewrap_dtensor

        half = max(1, budget // 2)
        waves: list[list[int]] = []
        direct: list[bool] = []
        size = half + 1
        for i, t in enumerate(locals_):
            n = t.nbytes
            if n > half:  # written from the live tensor while the caller waits
                waves.append([i])
                direct.append(True)
                size = half + 1
                continue
            if size + n > half:
                waves.append([])
                direct.append(False)
                size = 0
            waves[-1].append(i)
            size += n
        copied = [w for w, d in enumerate(direct) if not d]
        half_of = {w: k % 2 for k, w in enumerate(copied)}
        cap = max([sum(locals_[i].nbytes for i in waves[w]) for w in copied] + [0])
        buffers = [torch.empty(cap, dtype=torch.uint8) for _ in range(min(2, len(copied)))]
        save.bytes_allocated += cap * len(buffers)  # (made for this save, freed after it)
        views: list[Any] = list(locals_)  # a direct wave's tensors are the live ones
        for w in copied:
            off = 0
            for i in waves[w]:
                t = locals_[i]
                views[i] = buffers[half_of[w]].narrow(0, off, t.nbytes).view(t.dtype).view(t.shape)
                off += t.nbytes
        gate = cls(waves, [name for name, _ in items])
        gate.direct, gate.copied = direct, copied
        outputs = [src if view is local else (view if local is src else rewrap_dtensor(src, view))
                   for (_, src), local, view in zip(items, locals_, views)]

        def fill_wave(w: int) -> None:
            for i in waves[w]:
                if not direct[w]:
                    views[i].copy_(locals_[i].detach())
                save.note_staged(items[i][0], policy, 0 if direct[w] else locals_[i].nbytes)
            gate.staged[w].set()

        gate._fill = fill_wave
        save.gate = gate
        return outputs

    # -- the caller
    def fill(self) -> None:
        """Stage every wave, each once the writer freed the half it reuses; a direct wave is
        written from the live tensors, so it must be written before the caller goes on."""
        position = {w: k for k, w in enumerate(self.copied)}
        for w in range(len(self.waves)):
            k = position.get(w)
            if k is not None and k >= 2:
                self._wait(self.freed[self.copied[k - 2]])
            self._fill(w)
            if self.direct[w]:
                self._wait(self.freed[w])

    def abort(self, error: BaseException) -> None:
        """The write failed: nobody waits any more."""
        self.error = error
        for e in self.staged + self.freed:
            e.set()

    # -- the writer
    def order(self, names: Sequence[str]) -> list[int]:
        """Indices of ``names`` in writing order: ungated first, then wave by wave."""
        return sorted(range(len(names)), key=lambda i: self.wave_of.get(names[i], -1))

    def expect(self, names: Sequence[str]) -> None:
        """The tensors this process's plan writes; the others count as written."""
        mine = set(names)
        for w in range(len(self.waves)):
            with self._lock:
                self.pending[w] &= mine
                done = not self.pending[w]
            if done:
                self.freed[w].set()

    def before(self, name: str) -> None:
        w = self.wave_of.get(name)
        if w is not None:
            self._wait(self.staged[w])

    def after(self, name: str) -> None:
        w = self.wave_of.get(name)
        if w is None:
            return
        with self._lock:
            self.pending[w].discard(name)
            done = not self.pending[w]
        if done:
            self.freed[w].set()

    def _wait(self, event: threading.Event) -> None:
        while not event.wait(_WAIT_S):
            if self.error is not None:
                break
        if self.error is not None:
            raise self.error
