"""An upload the server stops taking ends after ``read_timeout``, like a server that stops answering.

botocore's ``read_timeout`` becomes aiohttp's ``sock_read``, which runs only while the
client waits for the answer. While it still writes a request body that the server has
stopped reading, nothing runs: the write waits for the socket to drain for ever. Measured
with aiohttp 3.14: a 10 MiB PUT to a server that reads 1 MiB and then stays silent, the
connection open, never ends, while a body small enough to fit the socket buffers times
out after ``read_timeout`` as it should. A part of a multipart upload (5 MiB and up) is
exactly such a body; and a small body that does not fit the socket's buffers on a slow link is
one too: aiohttp starts its read timer only once the whole body has left the client.

:class:`WatchedSession` is aiobotocore's HTTP session with one change: a body is sent in
slices, and an attempt in which no slice has gone for ``read_timeout`` seconds fails with
botocore's ``ReadTimeoutError``, so the retry policy treats it as it treats any silent
server (counted, retried, bounded by ``RetryPolicy.worst_case_s``). It is installed through
aiobotocore's own option for it (``AioConfig(http_session_cls=...)``, aiobotocore >= 2.13).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from aiobotocore.httpsession import AIOHTTPSession
from botocore.exceptions import ReadTimeoutError

__all__ = ["WatchedSession", "SLICE"]

SLICE = 256 << 10
"""Bytes handed to aiohttp at a time: each slice waits for the socket to take the last one."""


class _Progress:
    """A body sent slice by slice, with the time the last slice was taken."""

    def __init__(self, body: Any) -> None:
        self._body = body
        self.last = time.monotonic()

    async def slices(self) -> AsyncIterator[Any]:
        body = self._body
        if isinstance(body, (bytes, bytearray, memoryview)):
            view = memoryview(body).cast("B")
            pieces: Any = (view[i:i + SLICE] for i in range(0, len(view), SLICE))
        else:  # botocore hands a seekable stream (BytesIO), read from where its retry reset it
            pieces = iter(lambda: body.read(SLICE), b"")
        for piece in pieces:
            self.last = time.monotonic()
            yield piece
        # Not "done" here: the last bytes may still sit in the transport's buffer, and aiohttp
        # starts its read timer only once they have gone. So the watch runs until the answer
        # comes: after the last slice, silence for read_timeout fails the attempt, as sock_read
        # would.

    def stalled_for(self) -> float:
        return time.monotonic() - self.last


class WatchedSession(AIOHTTPSession):  # type: ignore[misc]
    """aiobotocore's session whose uploads fail an attempt when the server stops taking bytes."""

    async def send(self, request: Any) -> Any:
        body = request.body
        limit = self._timeout.sock_read
        sized = int(request.headers.get("Content-Length") or 0) > 0  # sent as is, not chunked
        if not sized or not limit or not (isinstance(body, (bytes, bytearray, memoryview)) or hasattr(body, "read")):
            return await super().send(request)
        progress = _Progress(body)
        request.body = progress.slices()
        sending = asyncio.ensure_future(super().send(request))
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=min(1.0, limit / 4))
                if done:
                    return sending.result()
                if progress.stalled_for() > limit:
                    raise ReadTimeoutError(endpoint_url=request.url,
                                           error=f"the server took no byte of the request body for {limit:g} s")
        finally:
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
            request.body = body  # botocore's retry resets and sends the original again
