"""Peer replicas of the fast recovery tier: which ranks keep a copy of whose unit, and the
transfers between them, on a gloo group of the tier's own.

A *unit* is one rank's local checkpoint of one step (:mod:`roll_ckpt.tiers.local_tier`). It
travels as one byte string (:func:`pack`): every file of the unit, ``manifest.json``
included, so the receiver checks each file against the manifest's sizes and checksums
(:func:`unpack_verified`) before anything is written.

Nodes form a ring in the order of their first rank: the ``k``-th replica of a rank's unit
goes to the rank of the same local index on the ``k``-th next node. Ranks of one node
never replicate to each other (they share the folder). Every transfer first sends the
payload's size (-1: nothing to send, e.g. the sender's own write failed), so a receiver
never waits for a payload that will not come.

torch.distributed is imported when a group is made, never when this module is imported.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Mapping

from ..format.manifest import hash_bytes, MANIFEST_NAME, Manifest, UnsafeManifestError
from ..runtime.torch_compat import collective
from ..format.manifest import list_files

__all__ = ["ring_targets", "PeerGroup", "pack", "unpack_verified"]


def ring_targets(nodes: list[str], replicas: int) -> dict[int, list[int]]:
    """For each rank (index into ``nodes``, each rank's node), the ranks that keep its replicas."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in members:
            order.append(node)
            members[node] = []
        members[node].append(rank)
    n = len(order)
    out: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        i, j = order.index(node), members[node].index(rank)
        peers = []
        for k in range(1, min(replicas, n - 1) + 1):
            ranks = members[order[(i + k) % n]]
            peers.append(ranks[j % len(ranks)])
        out[rank] = peers
    return out


def pack(storage: Any, unit: str) -> bytearray:
    """Every file of the unit folder ``unit`` as one byte string (sent without another copy)."""
    names = sorted(list_files(storage, unit))
    blobs = []
    for name in names:
        with storage.open_read(storage.join(unit, name)) as f:
            blobs.append(f.read())
    header = json.dumps({"files": [[n, len(b)] for n, b in zip(names, blobs)]}).encode()
    return bytearray().join([struct.pack("<Q", len(header)), header, *blobs])


def unpack_verified(payload: bytes | memoryview) -> tuple[Manifest, dict[str, bytes], bytes]:
    """The manifest, data files and manifest bytes of a packed unit; ``ValueError`` naming
    the first file that is missing, extra, of the wrong size or with the wrong checksum."""
    view = memoryview(payload)
    (hlen,) = struct.unpack("<Q", view[:8])
    header = json.loads(bytes(view[8:8 + hlen]))
    files: dict[str, bytes] = {}
    pos = 8 + hlen
    for name, size in header["files"]:
        files[str(name)] = bytes(view[pos:pos + size])
        pos += size
    if pos != len(view):
        raise ValueError(f"the payload holds {len(view) - pos} bytes more than its files")
    raw = files.pop(MANIFEST_NAME, None)
    if raw is None:
        raise ValueError("no manifest.json")
    try:
        manifest, problems = Manifest.from_bytes(raw)
    except UnsafeManifestError as exc:
        raise ValueError(f"unsafe manifest: {exc}") from None
    if problems:
        raise ValueError(f"manifest: {'; '.join(problems)}")
    if set(files) != set(manifest.files):
        raise ValueError(f"the files {sorted(set(files) ^ set(manifest.files))} do not match the manifest")
    for name, entry in manifest.files.items():
        size, digest = hash_bytes(files[name])
        if size != entry.size or digest != entry.checksum:
            raise ValueError(f"{name}: checksum mismatch")
    return manifest, files, raw


class PeerGroup:
    """The tier's gloo group (made in the caller's thread, once, by every rank at the same
    point), every rank's node, and transfers on it (run in the save's writer thread)."""

    def __init__(self, node: str, replicas: int, timeout_s: float = 0.0) -> None:
        import torch.distributed as dist

        from ..runtime.distributed import checkpoint_group

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = checkpoint_group(dist, timeout_s)  # (checkpoint_config.collective_timeout_s)
        self.nodes: list[str] = [str(n) for n in self.all_gather(node)]
        self.targets = ring_targets(self.nodes, replicas)
        self.sources = [r for r, peers in self.targets.items() if self.rank in peers]

    def node_of(self, rank: int) -> str:
        return self.nodes[rank]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON values: nothing is unpickled), by rank.

        Not ``all_gather_object``: its tensors are dropped while gloo's worker may still hold
        them, and a release that falls into interpreter exit aborts the process (a job that
        ends right after a resume). Here they are held until gloo has let go."""
        import torch

        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        collective(self.dist.all_gather, (size, *sizes), sizes, size, group=self.group)
        longest = max(int(t.item()) for t in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        collective(self.dist.all_gather, (mine, *parts), parts, mine, group=self.group)
        return [json.loads(p[:int(n.item())].numpy().tobytes()) for p, n in zip(parts, sizes)]

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather(bool(flag)))

    def barrier(self) -> None:
        self.all_gather(None)

    def transfer(self, sends: Mapping[int, bytearray | None], receives: list[int]) -> dict[int, bytes | None]:
        """Send ``sends[dst]`` to each ``dst`` and receive one payload from each rank in
        ``receives`` (``None``: the sender had nothing). Both sides must agree on the pairs."""
        import torch

        dist = self.dist
        P2POp = dist.P2POp
        sizes_out = {dst: torch.tensor([-1 if p is None else len(p)], dtype=torch.int64) for dst, p in sends.items()}
        sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in receives}
        self._run([P2POp(dist.isend, t, dst, self.group) for dst, t in sizes_out.items()]
                  + [P2POp(dist.irecv, t, src, self.group) for src, t in sizes_in.items()])
        data_out = {dst: torch.frombuffer(p, dtype=torch.uint8) for dst, p in sends.items()
                    if p is not None and len(p)}
        data_in = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in sizes_in.items()
                   if int(t.item()) > 0}
        self._run([P2POp(dist.isend, t, dst, self.group) for dst, t in data_out.items()]
                  + [P2POp(dist.irecv, t, src, self.group) for src, t in data_in.items()])
        out: dict[int, bytes | None] = {}
        for src, t in sizes_in.items():
            n = int(t.item())
            out[src] = None if n < 0 else (data_in[src].numpy().tobytes() if n else b"")
        return out

    def _run(self, ops: list[Any]) -> None:
        if ops:
            collective(_exchange, tuple(op.tensor for op in ops), self.dist, ops)


def _exchange(dist: Any, ops: list[Any]) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()
