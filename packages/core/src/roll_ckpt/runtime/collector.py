"""Python's cyclic garbage collector, held off while a save allocates in bulk.

DCP's planning, its gathers of plans and write results, and the pickle of ``.metadata``
allocate about 20 container objects per tensor, nearly all freed by reference counting
before the save ends. Each allocation counts towards the next collection, and on a
training process's heap (about 500,000 tracked objects with transformers and a model
loaded, here) the survivors of those steps set off full collections of 150-250 ms every
few saves, inside ``save`` or, for an asynchronous save, inside the writer thread, holding
the GIL that the training loop needs. With the collector held off they set off nothing:
an object freed by reference counting takes its count back with it.

The save pipeline also holds it while it builds and stages the state dict (the part the
training loop waits for). :class:`CollectorPause` holds it off; holds of several saves at once (two managers, the
fast recovery tier) nest. The collector is switched back on by the last release only if a
pause switched it off: a process that disabled it itself (torchtitan's and Megatron's
manual collection) is left as it is. A process that switches it off or on itself while a
save holds it has that overridden at the release.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["CollectorPause"]

_lock = threading.Lock()
_holds = 0
_switched_off = False


class CollectorPause:
    """One save's hold on the collector: :meth:`hold` and :meth:`release` may be called
    any number of times, in any order; only a hold not yet released counts."""

    __slots__ = ("_held", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._held = False

    def hold(self) -> "CollectorPause":
        global _holds, _switched_off
        if not self.enabled or self._held:
            return self
        with _lock:
            if _holds == 0 and gc.isenabled():
                gc.disable()
                _switched_off = True
            _holds += 1
            self._held = True
        return self

    def release(self, *exc: object) -> None:
        """Let go of this hold (``exc``: ``__exit__``'s arguments, not looked at)."""
        global _holds, _switched_off
        if not self._held:
            return
        with _lock:
            self._held = False
            _holds -= 1
            if _holds == 0 and _switched_off:
                _switched_off = False
                gc.enable()

    # ``with CollectorPause(...)``: a hold for the block (the same methods, no wrappers around them)
    __enter__ = hold
    __exit__ = release
