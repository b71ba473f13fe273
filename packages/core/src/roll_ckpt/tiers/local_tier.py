"""The fast recovery tier (``checkpoint_config.local``): node-local checkpoints every few
steps, each rank's copied to peers on other nodes, resumed from when they are newer than
the persistent tier.

::

    <local.dir>/<node>/checkpoint-<step>/rank-<r>/     one rank's *unit* of one step
        dcp/                 a DCP folder this rank wrote alone (its own chunks, replicated
                             values in full): it loads without any other rank's files
        trainer_state.json   as in a persistent checkpoint
        manifest.json        sizes and checksums; written last, the unit committed by rename

A node is the host name, or ``ROLL_CKPT_NODE``. A node folder holds the units of its own
ranks and the replicas it keeps for ranks of other nodes (:mod:`roll_ckpt.tiers.peer_replicas`).

Saving (the save's writer thread, after the same staging as a persistent save): write the
unit, exchange units with the ring peers, keep ``max_to_keep`` steps. A failure (a full
tmpfs) is logged and counted, never raised: training and persistent saves go on.

Resuming (``latest``): every rank verifies the units its node folder holds, the ranks
gather what they found and take the newest step every rank's unit is found for (own or
replica), if it is not older than the persistent tier's newest. A rank whose unit is not in
its node folder (a replaced node) gets it from the lowest rank holding it. Any failure
tries the next step, then the persistent tier. Steps newer than the one resumed are removed.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid
from typing import Any, MutableMapping

from ..format.commit import pending_checkpoint, utc_now
from ..errors import RollCkptError
from ..format.layout import DCP_DIR, TRAINER_STATE, checkpoint_name, parse_step
from ..config.local import LocalTierConfig
from ..format.manifest import MANIFEST_NAME, FileEntry, Manifest
from ..format.manifest import list_files, read_manifest, verify

__all__ = ["LocalTier", "node_name", "NODE_ENV"]

log = logging.getLogger("roll_ckpt")

NODE_ENV = "ROLL_CKPT_NODE"
UNIT_RE = re.compile(r"^rank-(\d+)$")


def node_name() -> str:
    """This process's node: ``ROLL_CKPT_NODE``, else the host name."""
    name = os.environ.get(NODE_ENV) or socket.gethostname()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise RollCkptError(f"node name {name!r} ({NODE_ENV} or the host name) is not a plain folder name")
    return name


def unit_name(rank: int) -> str:
    return f"rank-{rank}"


class LocalTier:
    def __init__(self, config: LocalTierConfig, storage: Any) -> None:
        self.config = config
        self.storage = storage
        self.node = node_name()
        self.node_dir = storage.join(storage.root, self.node)
        self.peers: Any = None
        self.strategy: Any = None
        self.io: Any = None
        """The strategy's I/O, which writes and loads the units (the manager's, given to :meth:`bind`)."""
        self.failed_saves = 0
        self.last_save: dict[str, Any] | None = None
        """What the latest local save did: step, ok, seconds, bytes, replicas sent and kept."""
        self.partly_loaded = False
        """True once a local load failed after it may have changed the state."""
        self._bound = False

    # ------------------------------------------------------------------ binding

    def bind(self, io: Any, *, forget_after: int | None = None) -> None:
        """Make the tier's group (caller's thread, every rank at the same point). From a save
        (``forget_after``: the step before it), units left newer than that by an earlier
        launch are removed first."""
        if self._bound:
            return
        self.io, self.strategy = io, io.strategy
        strategy = io.strategy
        if forget_after is not None:
            self._forget_after(forget_after)
        if strategy.world_size > 1:  # (several processes: torch.distributed is initialized)
            from .peer_replicas import PeerGroup

            self.peers = PeerGroup(self.node, self.config.replicas,
                                   float(strategy.collective_timeout_s))
            if self.config.replicas and len(set(self.peers.nodes)) < 2:
                log.warning("roll-ckpt: checkpoint_config.local.replicas is %d but every rank is on node %s: local "
                            "checkpoints get no replica (set %s per node to simulate nodes)",
                            self.config.replicas, self.node, NODE_ENV)
        self._bound = True

    def step_dir(self, step: int) -> str:
        return self.storage.join(self.node_dir, checkpoint_name(step))

    def unit_path(self, step: int, rank: int) -> str:
        return self.storage.join(self.step_dir(step), unit_name(rank))

    # ------------------------------------------------------------------ saving (writer thread)

    def save(self, staged: dict[str, Any], step: int, trainer_state: bytes, save: Any = None) -> bool:
        """Write this rank's unit of ``step``, exchange replicas, apply retention. Never raises
        a storage error (logged, counted in :attr:`failed_saves`); True when the own unit is committed."""
        t0 = time.perf_counter()
        strategy = self.strategy
        rank = strategy.rank
        path = self.unit_path(step, rank)
        ok, size = False, 0
        try:
            size = self._write_unit(staged, step, rank, trainer_state, save)
            ok = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self.failed_saves += 1
            log.warning("roll-ckpt: local checkpoint of step %d (rank %d) failed: %s -- training and persistent "
                        "saves go on (%d failed local save(s) so far)", step, rank, _cause(exc), self.failed_saves)
        sent: list[int] = []
        kept: list[int] = []
        if self.peers is not None:
            try:
                sent, kept = self._replicate(step, path if ok else None)
            except Exception as exc:  # a peer gone (its job is ending): the persistent save must go on
                log.warning("roll-ckpt: replicating local step %d failed: %s", step, _cause(exc))
        self._retain()
        used = self.bytes_used()
        self.last_save = {"step": step, "ok": ok, "seconds": time.perf_counter() - t0, "bytes": size,
                          "replicated_to": sent, "replicas_kept": kept, "node_bytes": used}
        if ok:
            log.info("roll-ckpt: local step %d of rank %d in %s (%d bytes%s); node folder %s holds %.1f MiB",
                     step, rank, self.node, size, f", replicas on ranks {sent}" if sent else "", self.node_dir,
                     used / 2**20)
        return ok

    def _write_unit(self, staged: dict[str, Any], step: int, rank: int, trainer_state: bytes, save: Any) -> int:
        storage, strategy = self.storage, self.strategy
        path = self.unit_path(step, rank)
        if storage.isdir(path):  # left by an earlier launch that got no further
            storage.remove_tree(path)
        pending = pending_checkpoint(storage, path, uuid.uuid4().hex[:12])
        pending.begin()
        try:
            digests = self.io.write(staged, storage, storage.join(pending.write_path, DCP_DIR), save=save, alone=True)
            files = {f"{DCP_DIR}/{name}": FileEntry(*d) for name, d in digests.items()}
            with storage.open_write(storage.join(pending.write_path, TRAINER_STATE)) as f:
                f.write(trainer_state)
            from ..format.manifest import hash_bytes

            files[TRAINER_STATE] = FileEntry(*hash_bytes(trainer_state))
            manifest = Manifest(step=step, files=files, created=utc_now(), world_size=strategy.world_size,
                                extra={"strategy": strategy.name, "tier": "local", "rank": rank, "node": self.node})
            pending.commit(manifest.to_bytes())
        except BaseException:
            try:
                pending.abort()
            except Exception:
                log.warning("roll-ckpt: could not clean up %s", pending.write_path, exc_info=True)
            raise
        return sum(e.size for e in files.values())

    def _replicate(self, step: int, unit: str | None) -> tuple[list[int], list[int]]:
        """Send this rank's unit to its ring peers, keep the units sent to this rank."""
        from .peer_replicas import pack

        peers = self.peers
        payload = None
        if unit is not None and peers.targets[peers.rank]:
            try:
                payload = pack(self.storage, unit)
            except OSError as exc:
                log.warning("roll-ckpt: cannot read the local unit %s to replicate it: %s", unit, exc)
        got = peers.transfer({dst: payload for dst in peers.targets[peers.rank]}, peers.sources)
        kept = [src for src, data in sorted(got.items()) if data is not None and self._keep(step, src, data)]
        return (list(peers.targets[peers.rank]) if payload is not None else []), kept

    def _keep(self, step: int, src: int, data: bytes) -> bool:
        """Verify a unit received from ``src`` and commit it into this node's folder."""
        from .peer_replicas import unpack_verified

        storage = self.storage
        path = self.unit_path(step, src)
        pending = None
        try:
            manifest, files, raw = unpack_verified(data)
            if manifest.step != step or manifest.extra.get("rank") != src:
                raise ValueError(f"it holds step {manifest.step} of rank {manifest.extra.get('rank')}")
            if storage.isdir(path):
                storage.remove_tree(path)
            pending = pending_checkpoint(storage, path, uuid.uuid4().hex[:12])
            pending.begin()
            for name, blob in files.items():
                target = storage.join(pending.write_path, name)
                if "/" in name:
                    storage.makedirs(storage.join(pending.write_path, name.rsplit("/", 1)[0]))
                with storage.open_write(target) as f:
                    f.write(blob)
            pending.commit(raw)
            return True
        except Exception as exc:
            log.warning("roll-ckpt: the replica of rank %d's local step %d is not kept: %s", src, step, _cause(exc))
            if pending is not None:
                try:
                    pending.abort()
                except Exception:
                    pass
            return False

    # ------------------------------------------------------------------ what the node folder holds

    def steps(self) -> list[tuple[int, str]]:
        """``(step, folder)`` of this node folder, oldest first."""
        out = []
        for e in self.storage.list(self.node_dir):
            step = parse_step(e.name)
            if step is not None and e.is_dir:
                out.append((step, e.path))
        return sorted(out)

    def units(self, step_dir: str) -> dict[int, str]:
        """The committed units of a step folder, by rank."""
        out = {}
        for e in self.storage.list(step_dir):
            m = UNIT_RE.match(e.name)
            if m and e.is_dir and self.storage.exists(self.storage.join(e.path, MANIFEST_NAME)):
                out[int(m.group(1))] = e.path
        return out

    def bytes_used(self) -> int:
        """Bytes of the node folder (this node's units and the replicas it keeps)."""
        try:
            return sum(list_files(self.storage, self.node_dir).values())
        except OSError:
            return 0

    def _retain(self) -> None:
        for _, folder in self.steps()[:-self.config.max_to_keep]:
            _remove(self.storage, folder)

    def _forget_after(self, step: int) -> None:
        for s, folder in self.steps():
            if s > step:
                _remove(self.storage, folder)

    # ------------------------------------------------------------------ resuming

    def resume(self, state: MutableMapping[str, Any], io: Any, not_before: int, *,
               stream: bool = False) -> tuple[int, dict[str, Any], str] | None:
        """Load the newest whole local step not older than ``not_before`` (the persistent
        tier's newest step, -1 without one); ``(step, trainer_state, unit)`` or ``None``."""
        self.bind(io)
        world = io.strategy.world_size
        found = self._verified(world, not_before)
        seen = self.peers.all_gather(found) if self.peers is not None else [found]
        holders: dict[int, dict[int, list[int]]] = {}
        for holder, pairs in enumerate(seen):
            for step, r in pairs:
                holders.setdefault(step, {}).setdefault(r, []).append(holder)
        for step in sorted(holders, reverse=True):
            have = holders[step]
            if any(r not in have for r in range(world)):
                continue
            loaded = self._try_step(state, step, have, stream)
            if loaded is not None:
                return loaded
        return None

    def _verified(self, world: int, not_before: int) -> list[tuple[int, int]]:
        """``(step, rank)`` of the units in this node folder that verify, for this world size."""
        out = []
        for step, folder in self.steps():
            if step < not_before:
                continue
            for r, path in self.units(folder).items():
                try:
                    manifest = verify(self.storage, path).manifest
                except Exception as exc:
                    log.warning("roll-ckpt: local unit %s is refused: %s", path, _cause(exc))
                    continue
                if manifest.world_size == world and manifest.step == step and r < world:
                    out.append((step, r))
        return out

    def _try_step(self, state: MutableMapping[str, Any], step: int, have: dict[int, list[int]],
                  stream: bool) -> tuple[int, dict[str, Any], str] | None:
        import json

        strategy = self.strategy
        rank = strategy.rank
        need = [r for r in range(strategy.world_size) if r not in have[r]]
        ok = True
        if need and self.peers is not None:
            from .peer_replicas import pack

            source = {r: min(have[r]) for r in need}
            sends: dict[int, bytearray | None] = {}
            for r in need:
                if source[r] == rank:
                    try:
                        sends[r] = pack(self.storage, self.unit_path(step, r))
                    except OSError as exc:
                        log.warning("roll-ckpt: cannot read local unit of rank %d step %d: %s", r, step, exc)
                        sends[r] = None
            got = self.peers.transfer(sends, [source[rank]] if rank in need else [])
            if rank in need:
                data = got.get(source[rank])
                ok = data is not None and self._keep(step, rank, data)
                if ok:
                    log.info("roll-ckpt: fetched rank %d's local step %d from rank %d (node %s)", rank, step,
                             source[rank], self.peers.node_of(source[rank]))
        if self.peers is not None and not self.peers.all_true(ok):
            log.warning("roll-ckpt: local step %d could not be gathered on every rank; trying an older one", step)
            return None
        unit = self.unit_path(step, rank)
        try:
            manifest = read_manifest(self.storage, unit)  # (the data files are checked again as they are read)
            files = {n[len(DCP_DIR) + 1:]: e for n, e in manifest.files.items() if n.startswith(f"{DCP_DIR}/")}
            with self.storage.open_read(self.storage.join(unit, TRAINER_STATE)) as f:
                trainer_state = json.loads(f.read().decode())
            self.io.load(state, self.storage, self.storage.join(unit, DCP_DIR), files=files, checkpoint=unit,
                          stream=stream, alone=True)
        except Exception as exc:
            log.warning("roll-ckpt: loading local unit %s failed: %s", unit, _cause(exc))
            ok = False
        if self.peers is not None:
            ok = self.peers.all_true(ok)
        if not ok:
            self.partly_loaded = True
            return None
        return step, trainer_state, unit

    def started(self, step: int) -> None:
        """After resume (every rank): units newer than ``step`` are from a launch that went
        further and must not mix with this one's; removed, then every rank waits for it."""
        if self.strategy is None:
            return
        self._forget_after(step)
        if self.peers is not None:
            self.peers.barrier()


def _remove(storage: Any, folder: str) -> None:
    try:
        storage.remove_tree(folder)
    except FileNotFoundError:
        pass  # another rank of this node removed it first
    except OSError as exc:
        log.warning("roll-ckpt: cannot remove %s: %s", folder, exc)


def _cause(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # DCP's CheckpointException
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) and first else first
    return f"{type(exc).__name__}: {exc}"
