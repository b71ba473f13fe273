"""Counting what a save and a resume ask of storage and of the collectives.

* :class:`CountingStorage` wraps any roll-ckpt :class:`~roll_ckpt.contracts.Storage` and
  counts each call by method (files created, renames, mkdirs, listings and the entries they
  returned, stats/exists, syncs, removes, reads). ``manager.storage = CountingStorage(manager.storage)``
  before the first save puts it under a :class:`~roll_ckpt.CheckpointManager`.
* :class:`S3Requests` counts the HTTP requests an s3fs client sends, by kind (PUT, GET,
  HEAD, LIST, DELETE, POST), through botocore's ``before-send`` event on the client.
* :class:`CollectiveBytes` wraps ``torch.distributed``'s object collectives and
  ``all_reduce``/``broadcast``/``gather``/``all_gather``/``barrier``/``scatter``: per call, the bytes
  this rank puts in (the pickled object, or the tensor's bytes) and the bytes it gets back.

Every counter keeps its counts under the current *phase* (``with counter.phase("save-3"):``).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections import defaultdict
from typing import Any, Iterator

__all__ = ["CountingStorage", "S3Requests", "CollectiveBytes", "CATEGORIES", "categorise"]

# Storage methods -> what they cost a file system / object store.
CATEGORIES = {
    "open_write": "files_created", "write_create": "files_created",
    "rename_dir": "renames", "rename_file": "renames",
    "makedirs": "mkdirs",
    "list": "listings",
    "exists": "stats", "isdir": "stats", "free_bytes": "stats",
    "sync_dir": "syncs",
    "remove": "removes", "remove_tree": "removes",
    "open_read": "reads",
}


def categorise(methods: dict[str, int]) -> dict[str, int]:
    """Counts by method -> counts by category (and ``total``). A file written durably (its
    ``close`` syncs it on a POSIX backend) is counted as a sync too."""
    out: dict[str, int] = defaultdict(int)
    for m, n in methods.items():
        cat = CATEGORIES.get(m)
        if cat is not None:
            out[cat] += n
    out["syncs"] += methods.get("open_write", 0) + methods.get("write_create", 0)
    out["total"] = sum(n for m, n in methods.items() if m in CATEGORIES)
    return dict(out)


class _Phased:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = "other"
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[self._phase][key] += n

    def of(self, phase: str) -> dict[str, int]:
        return dict(self.counts.get(phase, {}))


class CountingStorage(_Phased):
    """A :class:`~roll_ckpt.contracts.Storage` that counts every call of ``inner``'s methods."""

    COUNTED = tuple(CATEGORIES)

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name in CountingStorage.COUNTED and callable(value):
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.add(name)
                out = value(*args, **kwargs)
                if name == "list":
                    self.add("entries_listed", len(out))
                return out

            return counted
        return value

    # the protocol's attributes, read through
    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def root(self) -> str:
        return self.inner.root

    @property
    def atomic_rename(self) -> bool:
        return self.inner.atomic_rename

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def __repr__(self) -> str:
        return f"CountingStorage({self.inner!r})"


class S3Requests(_Phased):
    """HTTP requests of an s3fs file system (``FsspecStorage.fs``), by kind."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.fs = fs
        self._hooked: set[int] = set()

    def hook(self) -> "S3Requests":
        """Register on the client's events (made now if it is not yet)."""
        from fsspec.asyn import sync

        client = getattr(self.fs, "_s3", None)
        if client is None:
            client = sync(self.fs.loop, self.fs.set_session)
        if id(client) not in self._hooked:
            client.meta.events.register("before-send.s3", self._before_send)
            self._hooked.add(id(client))
        return self

    def _before_send(self, request: Any = None, **_: Any) -> None:
        if request is None:
            return
        method = getattr(request, "method", "?").upper()
        url = getattr(request, "url", "")
        query = url.split("?", 1)[1] if "?" in url else ""
        if method == "GET" and ("list-type=" in query or query.startswith("delimiter") or "prefix=" in query):
            kind = "LIST"
        else:
            kind = method
        self.add(kind)
        self.add("total")


def _nbytes(x: Any) -> int:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
            return sum(t.numel() * t.element_size() for t in x)
    except ImportError:
        pass
    return 0


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - an unpicklable object: counted as 0
        return 0


class CollectiveBytes(_Phased):
    """Wraps ``torch.distributed``'s collectives (module attributes, so DCP's ``_DistWrapper``
    and roll-ckpt's calls go through it). Per call name: ``calls``, ``sent`` (the bytes this
    rank contributes) and ``received`` (the bytes it gets back)."""

    OBJECT = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")
    TENSOR = ("all_reduce", "broadcast", "gather", "all_gather", "scatter", "reduce_scatter", "barrier",
              "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier")

    def __init__(self) -> None:
        super().__init__()
        self._saved: dict[str, Any] = {}

    def install(self) -> "CollectiveBytes":
        import torch.distributed as dist

        for name in self.OBJECT + self.TENSOR:
            f = getattr(dist, name, None)
            if f is None or name in self._saved:
                continue
            self._saved[name] = f
            setattr(dist, name, self._wrap(name, f))
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, f in self._saved.items():
            setattr(dist, name, f)
        self._saved.clear()

    def _rank(self, group: Any) -> tuple[int, int]:
        import torch.distributed as dist

        return dist.get_rank(group), dist.get_world_size(group)

    def _wrap(self, name: str, f: Any) -> Any:
        counter = self

        def inner(*args: Any, **kwargs: Any) -> Any:
            sent = received = 0
            if name == "all_gather_object":
                obj = kwargs.get("obj", args[1] if len(args) > 1 else None)
                sent = _pickled(obj)
            elif name == "gather_object":
                obj = kwargs.get("obj", args[0] if args else None)
                sent = _pickled(obj)
            elif name == "broadcast_object_list":
                lst = kwargs.get("object_list", args[0] if args else None)
                src = kwargs.get("src", args[1] if len(args) > 1 else 0)
                import torch.distributed as dist

                if dist.get_rank() == src:
                    sent = _pickled(lst)
            elif name == "scatter_object_list":
                lst = kwargs.get("scatter_object_input_list", args[1] if len(args) > 1 else None)
                if lst is not None:
                    sent = sum(_pickled(o) for o in lst)
            else:
                tensors = args[0] if args else kwargs.get("tensor", kwargs.get("tensor_list"))
                sent = _nbytes(tensors)
            out = f(*args, **kwargs)
            if name == "all_gather_object":
                lst = kwargs.get("object_list", args[0] if args else None)
                received = sum(_pickled(o) for o in (lst or []))
            elif name == "gather_object":
                lst = kwargs.get("object_gather_list", args[1] if len(args) > 1 else None)
                received = sum(_pickled(o) for o in (lst or []))
            elif name == "broadcast_object_list":
                lst = kwargs.get("object_list", args[0] if args else None)
                received = _pickled(lst) if not sent else 0
            elif name == "scatter_object_list":
                lst = kwargs.get("scatter_object_output_list", args[0] if args else None)
                received = _pickled(lst[0]) if lst else 0
            elif name in ("all_reduce", "broadcast"):
                received = sent
            counter.add(f"{name}.calls")
            counter.add(f"{name}.sent", sent)
            counter.add(f"{name}.received", received)
            counter.add("sent", sent)
            counter.add("received", received)
            counter.add("calls")
            return out

        inner.__wrapped__ = f  # type: ignore[attr-defined]
        return inner
