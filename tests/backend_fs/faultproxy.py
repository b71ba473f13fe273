"""A fault-injecting HTTP proxy for the S3 tests: between the client and SeaweedFS.

No maintained package on PyPI or Debian fits (toxiproxy is a Go server without a Debian or
PyPI build here and works on TCP, not per request; mitmproxy would pull a large tree in
for a few lines of scripting), so this is the tests' own: a threaded relay that reads
each HTTP/1.1 request (``Content-Length`` or chunked bodies), forwards it to the server
and relays the answer, and for the requests chosen injects one fault:

* ``reset_upload`` — half the request body reaches the server, then the client's
  connection is reset (RST);
* ``reset_download`` — the answer's headers and half its body reach the client, then RST;
* ``503`` — ``503 SlowDown`` (S3's throttling answer), the server never sees the request;
* ``500`` — ``500 InternalError``;
* ``slow`` — the answer trickles (``slow_bytes_per_s``);
* ``hang`` — the request is read and never answered: the connection is held open,
  silent, for ``hang_s`` or until the proxy stops, whatever the client does;
* ``stall_body`` — the answer's headers and half its body reach the client, then
  silence on an open connection (a server that stalls mid-download);
* ``stall_upload`` — a quarter of the request body is read, then nothing more: the
  connection stays open and the client's writes fill the socket's buffers and block
  (a server that stalls mid-upload).

A held connection is closed only when ``hang_s`` has passed or the proxy stops, so a client
that waits for it waits without bound unless its own timeouts end the wait.

Faults are chosen by :meth:`FaultProxy.inject` (the next ``count`` requests matching a
method and a path part) or at random (:meth:`FaultProxy.randomly`, seeded rates).
:func:`fault_proxy` always stops the proxy and its threads' sockets.
"""

from __future__ import annotations

import contextlib
import random
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

KINDS = ("reset_upload", "reset_download", "503", "500", "slow", "hang", "stall_body", "stall_upload")

_ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
               "<Message>{message}</Message><RequestId>proxy</RequestId></Error>")
_ERRORS = {"503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
           "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error.")}


@dataclass
class _Rule:
    kind: str
    method: str | None
    path: str | None
    count: int


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    port: int = 0
    slow_bytes_per_s: int = 256 << 10
    hang_s: float = 600.0
    requests: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    _rules: list[_Rule] = field(default_factory=list)
    _rates: dict[str, float] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=random.Random)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, kind: str, *, method: str | None = None, path: str | None = None, count: int = 1) -> None:
        """The next ``count`` requests with ``method`` whose path holds ``path`` get ``kind``."""
        assert kind in KINDS, kind
        with self._lock:
            self._rules.append(_Rule(kind, method, path, count))

    def randomly(self, rates: dict[str, float], seed: int) -> None:
        """From now on each request gets fault ``kind`` with probability ``rates[kind]``."""
        assert set(rates) <= set(KINDS), rates
        with self._lock:
            self._rates = dict(rates)
            self._rng = random.Random(seed)

    def _hold(self) -> None:
        """Keep this connection open and silent (``hang_s``, or until the proxy stops)."""
        self._stopping.wait(self.hang_s)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._rates = {}

    def _choose(self, method: str, path: str, has_body: bool) -> str | None:
        with self._lock:
            self.requests += 1
            kind = None
            for rule in self._rules:
                if (rule.method is None or rule.method == method) and (rule.path is None or rule.path in path):
                    kind = rule.kind
                    rule.count -= 1
                    if rule.count <= 0:
                        self._rules.remove(rule)
                    break
            if kind is None and self._rates:
                x = self._rng.random()
                for k, rate in self._rates.items():
                    if x < rate:
                        kind = k
                        break
                    x -= rate
            if kind in ("reset_upload", "stall_upload") and not has_body:
                kind = "reset_download" if kind == "reset_upload" else "hang"
            if kind is not None:
                self.injected[kind] = self.injected.get(kind, 0) + 1
            return kind


def _read_until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while (i := buf.find(marker)) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return i


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(max(65536, n - len(buf)))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_head(sock: socket.socket, buf: bytearray) -> tuple[bytes, dict]:
    """The head of one HTTP message from ``sock``: (head, lower-cased headers)."""
    end = _read_until(sock, buf, b"\r\n\r\n")
    head = bytes(buf[:end + 4])
    del buf[:end + 4]
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    headers[":start"] = lines[0]
    if headers.get("expect", "").lower() == "100-continue":  # answer it here; the server never sees it
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        head = "\r\n".join(line for line in lines if not line.lower().startswith("expect:")).encode("latin-1")
    return head, headers


def _has_body(headers: dict) -> bool:
    return int(headers.get("content-length", "0")) > 0 or "chunked" in headers.get("transfer-encoding", "").lower()


def _read_body(sock: socket.socket, buf: bytearray, headers: dict, *, response_to: str | None = None) -> bytes:
    """The body of the message whose head was ``headers``, as sent."""
    if response_to == "HEAD" or (response_to and headers[":start"].split(" ")[1] in ("204", "304")):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            i = _read_until(sock, buf, b"\r\n")
            size = int(bytes(buf[:i]).split(b";")[0], 16)
            body += _read_exact(sock, buf, i + 2)
            if size == 0:  # the last chunk, then trailers up to an empty line
                while True:
                    line = _read_exact(sock, buf, _read_until(sock, buf, b"\r\n") + 2)
                    body += line
                    if line == b"\r\n":
                        break
                break
            body += _read_exact(sock, buf, size + 2)
        return bytes(body)
    return _read_exact(sock, buf, int(headers.get("content-length", "0")))


def _read_message(sock: socket.socket, buf: bytearray, *, response_to: str | None = None) -> tuple[bytes, bytes, dict]:
    """One HTTP message from ``sock``: (head, body as sent, lower-cased headers)."""
    head, headers = _read_head(sock, buf)
    return head, _read_body(sock, buf, headers, response_to=response_to), headers


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        proxy = self.server.proxy
        client = self.request
        up: socket.socket | None = None
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while not proxy._stopping.is_set():
                try:
                    head, headers = _read_head(client, cbuf)
                    method, path = headers[":start"].split(" ")[:2]
                    kind = proxy._choose(method, path, _has_body(headers))
                    if kind == "stall_upload":  # a part of the body, then nothing read any more
                        want = int(headers.get("content-length", "0")) // 4
                        _read_exact(client, cbuf, want)
                        proxy._hold()
                        return
                    body = _read_body(client, cbuf, headers)
                except (ConnectionError, OSError):
                    return
                if kind in _ERRORS:
                    status, reason, code, message = _ERRORS[kind]
                    err = _ERROR_BODY.format(code=code, message=message).encode()
                    client.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                                   f"Content-Length: {len(err)}\r\nConnection: keep-alive\r\n\r\n".encode() + err)
                    continue
                if kind == "hang":
                    proxy._hold()
                    return
                if up is None:
                    up = socket.create_connection(proxy.upstream, timeout=60)
                    ubuf = bytearray()
                if kind == "reset_upload":
                    up.sendall(head + body[:len(body) // 2])
                    _reset(client)
                    return
                up.sendall(head + body)
                rhead, rbody, rheaders = _read_message(up, ubuf, response_to=method)
                if kind == "reset_download":
                    client.sendall(rhead + rbody[:len(rbody) // 2])
                    _reset(client)
                    return
                if kind == "stall_body":  # the headers and half the body, then silence, the connection open
                    client.sendall(rhead + rbody[:len(rbody) // 2])
                    proxy._hold()
                    return
                if kind == "slow":
                    client.sendall(rhead)
                    step = max(1, proxy.slow_bytes_per_s // 20)
                    for i in range(0, len(rbody), step):
                        client.sendall(rbody[i:i + step])
                        time.sleep(0.05)
                else:
                    client.sendall(rhead + rbody)
                if "close" in rheaders.get("connection", "").lower():
                    return
        except (ConnectionError, OSError):
            return
        finally:
            if up is not None:
                up.close()
            with contextlib.suppress(OSError):
                client.close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


@contextlib.contextmanager
def fault_proxy(upstream_endpoint: str) -> Iterator[FaultProxy]:
    """A proxy on a free loopback port in front of ``upstream_endpoint`` (``http://host:port``);
    stopped on exit (hung requests are let go, sockets closed)."""
    host, port = upstream_endpoint.split("//", 1)[1].rsplit(":", 1)
    proxy = FaultProxy((host, int(port)))
    server = _Server(("127.0.0.1", 0), _Handler)
    server.proxy = proxy
    proxy.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                              name="fault-proxy")
    thread.start()
    try:
        yield proxy
    finally:
        proxy._stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
