"""Helpers shared by the benchmark's processes: peak-RSS sampling, page-cache dropping, sizes."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterable

__all__ = ["announce", "PeakRSS", "rss_bytes", "drop_cache", "tree_bytes", "tree_files", "median", "io_read_bytes", "state_size",
           "cpu_all", "writer_digest"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Statm:
    """The process's resident set size, read from /proc/self/statm (psutil elsewhere)."""

    def __init__(self) -> None:
        self._fd = -1
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            import psutil

            self._proc = psutil.Process()

    def __call__(self) -> int:
        if self._fd >= 0:
            return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE
        return self._proc.memory_info().rss


rss_bytes = _Statm()


def _hwm_reset() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak RSS of this process while the block runs, relative to the RSS just before it.

    A thread samples RSS every ``interval`` seconds; where the kernel lets us reset its
    high-water mark (``/proc/self/clear_refs``), VmHWM catches peaks shorter than that.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.base = self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None
        self._hwm = False

    def _run(self) -> None:
        read, stop, interval = rss_bytes, self._stop, self.interval
        peak = self.peak
        n = 0
        while not stop.is_set():
            v = read()
            if v > peak:
                peak = v
            n += 1
            time.sleep(interval)
        self.peak = max(self.peak, peak)
        self.samples += n

    def start(self) -> "PeakRSS":
        self._hwm = _hwm_reset()
        self.base = self.peak = rss_bytes()
        self._stop.clear()
        self._t = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._t.start()
        return self

    def stop(self) -> int:
        """Stop sampling; returns the extra peak (bytes above the starting RSS)."""
        self._stop.set()
        if self._t is not None:
            self._t.join()
        self.peak = max(self.peak, rss_bytes())
        if self._hwm:
            hwm = _hwm()
            if hwm is not None:
                self.peak = max(self.peak, hwm)
        return max(0, self.peak - self.base)

    def __enter__(self) -> "PeakRSS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


def tree_files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.join(d, f) for f in files]
    return out


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in tree_files(root))


def drop_cache(paths: Iterable[str]) -> None:
    """Evict the files' pages from the page cache (they are clean: written and fsynced).

    ``POSIX_FADV_DONTNEED`` needs no privileges, unlike ``/proc/sys/vm/drop_caches``.
    """
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def io_read_bytes() -> int:
    """Bytes this process (all its threads) made the kernel fetch from storage (/proc/self/io
    ``read_bytes``: page-cache hits do not count); 0 where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def state_size(model: Any, opt: Any) -> tuple[int, int]:
    """(tensors, bytes) of a model's parameters and its optimizer's state on this rank
    (a DTensor counts its local shard)."""
    tensors = [p for p in model.parameters()] + [v for st in opt.state.values() for v in st.values()]
    local = [getattr(t, "_local_tensor", t) for t in tensors]
    return len(tensors), sum(t.numel() * t.element_size() for t in local if hasattr(t, "numel"))


def cpu_all() -> float:
    """CPU seconds (user + system) of this process (every thread) and of its children: the
    live ones (psutil; DCP's process-mode checkpointer stays alive between saves) and the
    ones that ended and were waited for (``RUSAGE_CHILDREN``)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except ImportError:
        pass
    return total


def available(methods: list[str], needs: dict[str, Callable[[], Any]],
              say: Callable[[str], None]) -> tuple[list[str], dict[str, str]]:
    """The methods this interpreter can run, and why each other cannot: ``needs[m]()`` raises
    a ``TorchCompatError`` (a DCP option of a newer torch, a peer not installed); ``say`` logs it."""
    from roll_ckpt.errors import TorchCompatError

    unavailable: dict[str, str] = {}
    for m in methods:
        try:
            needs.get(m, lambda: None)()
        except TorchCompatError as exc:
            unavailable[m] = str(exc)
            say(f"{m} not available: {exc}")
    return [m for m in methods if m not in unavailable], unavailable


def announce(manager: Any) -> None:
    """What ``maybe_save`` does the step before a save step (``prepare_save``: the staging
    buffers, freed between saves, made ready in the writer thread), waited for here as a
    training step in between would let it finish: the timed save then only copies. The work
    itself is counted where a loop runs beside it (T6, T11, T26)."""
    ready = manager.prepare_save()
    if ready is not None:
        ready.result()



class _Nowhere:
    """A backend that keeps nothing: its one stream takes the writes and drops them."""

    def open_write(self, path: str) -> "_Nowhere":
        return self

    def write(self, b: Any) -> None:
        return None

    def close(self) -> None:
        return None


def writer_digest(data: Any) -> tuple:
    """``data``'s ``(size, checksum, chunk checksums)`` as roll-ckpt's writer hashes a file it
    writes (``roll_ckpt.dcp.files.StorageFileSystem.create_stream``: the whole file and its
    8 MiB pieces), writing nothing."""
    from roll_ckpt.dcp.files import StorageFileSystem

    fs = StorageFileSystem(_Nowhere())  # type: ignore[arg-type]
    with fs.create_stream("f", "wb") as stream:
        stream.write(data)
    return fs.digests["f"]
