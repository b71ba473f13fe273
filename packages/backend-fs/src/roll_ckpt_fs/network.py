"""Retries, timeouts and fault counts for S3 (``s3://``): roll-ckpt's own policy, stated.

The S3 client's defaults are made for interactive use: botocore waits 60 s for a silent
server, retries up to 5 times, and s3fs retries each of those again up to 5 times, so one
request that never answers costs minutes and nobody is told. For checkpoints
:class:`RetryPolicy` decides instead, from ``storage_options``:

=====================  =======  ==========================================================
key                    default  meaning
=====================  =======  ==========================================================
``connect_timeout``    5        seconds to open a connection
``read_timeout``       10       seconds without a byte from the server before the attempt
                                fails (a request that never answers ends here)
``max_attempts``       5        attempts per request, the first included (1: no retry)
``retry_backoff``      0.25     seconds before the first retry; doubled for each next one
                                (with jitter: 50-100 % of it)
``retry_backoff_max``  5        the longest wait between two attempts
=====================  =======  ==========================================================

An upload the server stops reading fails its attempt after ``read_timeout`` too
(:mod:`roll_ckpt_fs.upload_watch`; aiohttp alone would wait for ever). So whatever a server
does, one request ends within :attr:`RetryPolicy.worst_case_s` (78.75 s with the defaults).

Retried: a connection refused, reset or closed part-way (upload or download), a connect
or read timeout, and answers 500, 502, 503 (``SlowDown``), 504 and 429. Anything else (403,
404, 412...) fails at once. A request is retried by botocore (it re-sends the whole
request, so a part of a multipart upload goes again whole); a download that breaks while
its body is read is read again from where it broke (:class:`RetryingReader`). s3fs's own
retry loop is set to one pass (``S3FileSystem.retries = 1``) so attempts do not multiply.
A user's own botocore setting (``config_kwargs: {retries: {...}}``) bounds the attempts instead
of ``max_attempts`` for each request botocore sends (it stops there), and the counts follow it
(:func:`botocore_attempts`); a broken download is still read again up to ``max_attempts`` times.

Every fault is counted (:class:`FaultCounter`): the save pipeline reads the counts before
and after each save (``SaveStats.network``, one log line per save that met any) and the
manager keeps the totals (``manager.stats.network``).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from roll_ckpt import StorageError
from roll_ckpt.plugin import NetworkCounts

__all__ = ["RetryPolicy", "FaultCounter", "RetryingReader", "ObjectWriter", "RETRY_KEYS"]

RETRY_KEYS = ("connect_timeout", "read_timeout", "max_attempts", "retry_backoff", "retry_backoff_max")
_RETRIED_STATUS = {500, 502, 503, 504, 429}


@dataclass(frozen=True)
class RetryPolicy:
    """``checkpoint_config.storage_options`` keys on ``s3://``: roll-ckpt's retries and timeouts."""

    connect_timeout: float = 5.0
    """Seconds to open a connection."""
    read_timeout: float = 10.0
    """Seconds without a byte from the server before an attempt fails: a request that never answers ends here."""
    max_attempts: int = 5
    """Attempts per request, the first included (``1``: no retry)."""
    retry_backoff: float = 0.25
    """Seconds before the first retry, doubled for each next one (50-100 % of it, jittered)."""
    retry_backoff_max: float = 5.0
    """The longest wait between two attempts (seconds)."""

    @classmethod
    def pop_from(cls, options: dict[str, Any], url: str) -> "RetryPolicy":
        """The policy set in ``options`` (its keys removed from it); bad values are errors."""
        values: dict[str, Any] = {}
        for key in RETRY_KEYS:
            if key not in options:
                continue
            value = options.pop(key)
            integer = key == "max_attempts"
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
                and (not integer or float(value).is_integer())
            if not ok or (key.startswith("retry_") and value <= 0):
                what = "an integer >= 1" if integer else "a number of seconds > 0"
                raise StorageError(f"checkpoint_config.storage_options.{key} must be {what}, got {value!r} (for {url})")
            values[key] = int(value) if integer else float(value)
        return cls(**values)

    @property
    def worst_case_s(self) -> float:
        """The longest one request can take against a server that goes silent, whatever it
        does (accepts and never answers, answers headers and stalls the body, stops reading
        an upload): each attempt ends ``connect_timeout`` + ``read_timeout`` after it began at
        the latest, and the waits between attempts are at most the backoffs. A server that
        keeps sending a byte now and then, each within ``read_timeout``, is not silent: that
        request takes as long as its bytes take."""
        waits = sum(min(self.retry_backoff_max, self.retry_backoff * 2 ** (k - 1)) for k in range(1, self.max_attempts))
        return self.max_attempts * (self.connect_timeout + self.read_timeout) + waits

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first)."""
        full = min(self.retry_backoff_max, self.retry_backoff * (2 ** (retry - 1)))
        return full * random.uniform(0.5, 1.0)

    def s3fs_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` with the client set up for this policy (what the user set wins)."""
        out = dict(options)
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("connect_timeout", self.connect_timeout)
        config.setdefault("read_timeout", self.read_timeout)
        # botocore's own retries off: FaultCounter.needs_retry decides (and counts)
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        from .upload_watch import WatchedSession  # imports aiobotocore: s3:// only

        # aiohttp times out reads only: an upload the server stops taking would wait for ever
        config.setdefault("http_session_cls", WatchedSession)
        out["config_kwargs"] = config
        return out


def fault_kind(response: Any, exc: BaseException | None) -> str | None:
    """What went wrong in one attempt (``None``: it did not, or it must not be retried)."""
    if exc is not None:
        name = type(exc).__name__
        text = str(exc).lower()
        if "timeout" in name.lower() or "timed out" in text:
            return "connect timeout" if "connect" in name.lower() else "read timeout"
        from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError

        if isinstance(exc, (HTTPClientError, BotoConnectionError, ConnectionError, OSError)):
            return f"connection error ({name})"
        return None
    if response is None:
        return None
    http, parsed = response
    status = getattr(http, "status_code", None)
    if status in _RETRIED_STATUS:
        code = ((parsed or {}).get("Error") or {}).get("Code") if isinstance(parsed, dict) else None
        return f"{status} {code}" if code else str(status)
    return None


def _unused(client: Any) -> bool:
    """A botocore client whose HTTP session has opened no connection pool yet."""
    sessions = getattr(getattr(getattr(client, "_endpoint", None), "http_session", None), "_sessions", None)
    return isinstance(sessions, dict) and not sessions


def botocore_attempts(options: Mapping[str, Any]) -> int | None:
    """The attempts of one request a user's own ``config_kwargs.retries`` allows (botocore stops
    there whatever :meth:`FaultCounter.needs_retry` says; ``total_max_attempts`` counts the first
    attempt, ``max_attempts`` does not); ``None`` when it sets none."""
    retries = (options.get("config_kwargs") or {}).get("retries")
    if not isinstance(retries, Mapping):
        return None
    if isinstance(retries.get("total_max_attempts"), int):
        return max(1, retries["total_max_attempts"])
    if isinstance(retries.get("max_attempts"), int):
        return max(1, retries["max_attempts"] + 1)
    return None


class FaultCounter:
    """The faults one storage met, counted thread-safely; also botocore's retry decision.
    ``request_attempts``: the bound a user's own botocore retries set on each request
    (:func:`botocore_attempts`; ``None``: the policy's ``max_attempts``), which the counts
    follow; ``max_attempts`` still bounds roll-ckpt's own re-reads of a broken download."""

    def __init__(self, policy: RetryPolicy, request_attempts: int | None = None) -> None:
        self.policy = policy
        self.request_attempts = request_attempts
        self._lock = threading.Lock()
        self._faults = 0
        self._retries = 0
        self._lost = 0.0
        self._kinds: dict[str, int] = {}

    def counts(self) -> NetworkCounts:
        with self._lock:
            return NetworkCounts(self._faults, self._retries, self._lost, dict(self._kinds))

    def record(self, kind: str, lost_s: float, retried: bool) -> None:
        with self._lock:
            self._faults += 1
            self._retries += int(retried)
            self._lost += lost_s
            self._kinds[kind] = self._kinds.get(kind, 0) + 1

    def install(self, fs: Any) -> None:
        """Take over ``fs``'s (an ``S3FileSystem``) retries: s3fs's own loop set to one pass
        (it would multiply the attempts), and on its client's events: the start of each
        call, the end of each attempt."""
        fs.retries = 1
        self._hook(fs.s3)
        if getattr(fs.set_session, "__roll_ckpt__", False):
            return
        original = fs.set_session

        async def set_session(refresh: bool = False, kwargs: Any = None) -> Any:
            # s3fs up to 2026.2 (fsspec <= 2026.2: datasets < 4.8, hence torchtitan's stack) makes a
            # new client in place of one that has sent nothing yet (its connection pool is empty):
            # the first call would drop the client these events are on. 2026.9 keeps it; so does this.
            if not refresh and fs._s3 is not None and _unused(fs._s3):
                return fs._s3
            client = await original(refresh=refresh, kwargs=kwargs or {})
            self._hook(client)
            return client

        set_session.__roll_ckpt__ = True  # type: ignore[attr-defined]
        fs.set_session = set_session

    def _hook(self, client: Any) -> None:
        events = client.meta.events  # (unique ids: a client is hooked once)
        events.register("before-call.s3", self._before_call, unique_id="roll-ckpt-before-call")
        events.register_first("needs-retry.s3", self.needs_retry, unique_id="roll-ckpt-needs-retry")

    @staticmethod
    def _before_call(context: Any = None, **_: Any) -> None:
        if isinstance(context, dict):
            context["roll_ckpt_attempt_t"] = time.monotonic()

    def needs_retry(self, response: Any = None, attempts: int = 1, caught_exception: Any = None,
                    request_dict: Any = None, **_: Any) -> float | None:
        """botocore's ``needs-retry`` event: the seconds to wait before the next attempt, or
        ``None`` (no retry: it succeeded, it must not be retried, or no attempt is left)."""
        kind = fault_kind(response, caught_exception)
        if kind is None:
            return None
        context = request_dict.get("context") if isinstance(request_dict, dict) else None
        now = time.monotonic()
        started = context.get("roll_ckpt_attempt_t", now) if isinstance(context, dict) else now
        retry = attempts < (self.request_attempts or self.policy.max_attempts)
        wait = self.policy.delay(attempts) if retry else 0.0
        self.record(kind, (now - started) + wait, retry)
        if isinstance(context, dict):
            context["roll_ckpt_attempt_t"] = now + wait
        return wait if retry else None


def _read_fault(exc: BaseException) -> BaseException:
    """What broke a download: ``exc``, or the network error it was raised while handling.

    s3fs's ``S3File._fetch_range`` handles an ``OSError`` by reading ``ex.args[0]``; the read
    timeout it gets (fsspec's ``FSTimeoutError``, an ``OSError`` with no args) makes that an
    ``IndexError``, which would name a stalled body as a bug of ours (s3fs 2024-2026)."""
    if isinstance(exc, IndexError) and isinstance(exc.__context__, OSError):
        return exc.__context__
    return exc


class RetryingReader:
    """A reader that reads again from where it broke when a download fails part-way."""

    def __init__(self, opener: Any, path: str, counter: FaultCounter) -> None:
        self._opener = opener
        self._path = path
        self._counter = counter
        self._f = opener()
        self._pos = 0

    def _again(self, op: Any) -> Any:
        for attempt in range(1, self._counter.policy.max_attempts + 1):
            t0 = time.monotonic()
            try:
                return op()
            except (FileNotFoundError, PermissionError, ValueError):
                raise  # not the network's doing (ValueError: a closed file)
            except Exception as exc:  # aiohttp's payload errors are not OSErrors
                cause = _read_fault(exc)
                if attempt == self._counter.policy.max_attempts:
                    raise StorageError(f"reading {self._path} failed after {attempt} attempt(s) "
                                       f"({type(cause).__name__}: {cause}); the object may well be whole: try "
                                       "again once the store answers (storage_options.max_attempts, "
                                       "read_timeout set how long roll-ckpt insists)") from exc
                wait = self._counter.policy.delay(attempt)
                self._counter.record(f"download broke ({type(cause).__name__})", time.monotonic() - t0 + wait, True)
                time.sleep(wait)
                try:
                    self._f.close()
                except Exception:
                    pass
                self._f = self._opener()
                self._f.seek(self._pos)
        raise AssertionError("unreachable")

    def read(self, n: int = -1) -> bytes:
        data = self._again(lambda: self._f.read(n))
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = self._again(lambda: self._f.readinto(b))
        self._pos += n or 0
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._f.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return bool(self._f.closed)

    def __enter__(self) -> "RetryingReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class ObjectWriter:
    """An object being uploaded: ``close()`` completes it, ``abort()`` (a failed write, or an
    exception inside ``with``) aborts its multipart upload so no short object is left."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.closed = False

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        return len(memoryview(b).cast("B")) if n is None else n

    def flush(self) -> None:
        pass  # s3fs uploads a part once its buffer is full; flushing here would upload small parts

    def writable(self) -> bool:
        return True

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._f.discard()
        self._f.closed = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._f.close()

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
