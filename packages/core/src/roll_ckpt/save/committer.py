"""The coordinator's commit of a written checkpoint, and what follows it.

::

    Committer.commit         the HF files, trainer_state.json, the manifest, the commit
        commit_step              with components: the step, once its last part is in
        after_commit             retention, replication

:class:`~roll_ckpt.save.pipeline.SavePipeline` calls :meth:`Committer.commit` on the
coordinator once every rank has written its part; every rank then agrees on its outcome.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..contracts import SaveContext
from ..format import layout
from ..format.commit import PendingCheckpoint
from ..format.components import EXPECTS_KEY, STEP_ROOT_KEY, try_complete
from ..format.manifest import BESIDE_KEY
from ..format.digest import hash_bytes
from ..format.layout import TRAINER_STATE
from ..format.manifest import FileEntry, Manifest
from ..format.owners import utc_now
from ..hf.in_checkpoint import HFPart
from ..runtime.network import check_objects
from ..runtime.units import human_bytes
from ..tiers.job import Job
from ..tiers.retention import apply_retention

__all__ = ["Committer"]

log = logging.getLogger("roll_ckpt")


def _plugin_versions(job: Job) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("roll-ckpt-core", "torch", *sorted(set(job.plugins.distributions()))):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


class Committer:
    def __init__(self, job: Job, hf: HFPart | None) -> None:
        self.job = job
        self.hf = hf
        """The Hugging Face files each checkpoint carries, or ``None``."""

    def commit(self, pending: PendingCheckpoint, ctx: SaveContext, user: dict[str, Any],
                digests: dict[str, tuple], module: Any = None) -> tuple[int, int]:
        """Coordinator: the HF files, trainer state, manifest, commit; then the step, retention, replication."""
        job = self.job
        storage, strategy = job.storage, job.strategy
        files = {f"{strategy.data_dir}/{name}": FileEntry(*digest) for name, digest in digests.items()}
        extra: dict[str, Any] = {"strategy": strategy.name}
        if job.config.strategy_config.save_only_model:
            extra["save_only_model"] = self.hf.config.key  # type: ignore[union-attr]
        if self.hf is not None and module is not None:  # from the dcp/ files just written (hf_in_checkpoint)
            hf_files, extra["hf"] = self.hf.write(storage, pending.write_path, module,
                                                  storage.join(pending.write_path, strategy.data_dir))
            files.update(hf_files)
            if job.component and self.hf.config.step_root and hf_files:  # at checkpoint-<step>/ too
                extra[STEP_ROOT_KEY] = sorted(hf_files)
        cc = job.config.checkpoint_config
        if job.component:  # every part this manager knows of: the step waits for them all
            extra[EXPECTS_KEY] = list(cc.components or ())
        if cc.beside:  # files another program adds to the folder once it is committed
            extra[BESIDE_KEY] = list(cc.beside)
        ts = self.trainer_state(ctx, user)
        with storage.open_write(storage.join(pending.write_path, TRAINER_STATE)) as f:
            f.write(ts)
        files[TRAINER_STATE] = FileEntry(*hash_bytes(ts))
        if not storage.atomic_rename:  # an object store: every upload completed, whole
            check_objects(storage, pending.write_path, {name: e.size for name, e in files.items()})
        manifest = Manifest(step=ctx.step, files=files, created=utc_now(), world_size=strategy.world_size,
                            component=job.component, plugins=_plugin_versions(job), extra=extra)
        pending.commit(manifest.to_bytes())
        job.announce(ctx.path, manifest, job.component)
        step_path = layout.parent(ctx.path) if job.component else ctx.path
        if self.commit_step(step_path, ctx.step):  # the whole checkpoint, or the last part of the step
            self.after_commit(step_path, ctx.step)
        total, taken = sum(e.size for e in files.values()), sum(e.size for e in files.values() if e.taken_over)
        if taken:
            log.info("roll-ckpt: %s: %s written, %s taken over unchanged from %s", layout.basename(ctx.path),
                     human_bytes(total - taken), human_bytes(taken),
                     ", ".join(sorted({e.taken_over for e in files.values() if e.taken_over})))
        return total, taken

    def commit_step(self, step_path: str, step: int, parts: Any = None, files: Any = ()) -> bool:
        """True when the step is committed by this process: always without components;
        with them, when this part was the last one and this process's create won.
        ``parts``/``files``: a step something else commits (``CheckpointManager.commit_step``)."""
        job = self.job
        if not job.component:
            return True
        if parts is None and not job.config.checkpoint_config.commit_steps:
            return False  # another commits the step: it knows which parts it has
        try:
            manifest = try_complete(job.storage, step_path, step,
                                    job.config.checkpoint_config.components or () if parts is None else parts,
                                    files=files)
        except Exception as exc:  # this part is committed; the step can be committed later
            log.warning("roll-ckpt: the part of %s is committed, but committing step %d failed (%s: %s); the "
                        "next resume commits the step once every part is there", job.component, step,
                        type(exc).__name__, exc)
            return False
        if manifest is None:
            return False
        job.announce(step_path, manifest)
        log.info("roll-ckpt: step %d committed (every component's part is in %s)", step, step_path)
        return True

    def protected(self, path: str) -> set[str]:
        """Local checkpoints retention must leave alone: the one just written, the one being replicated."""
        copying = self.job.backup.copying if self.job.backup is not None else None
        return {path} | ({copying} if copying else set())

    def after_commit(self, path: str, step: int) -> None:
        """Retention and replication for the checkpoint just committed at ``path``."""
        job = self.job
        keep = job.config.checkpoint_config.max_ckpt_to_keep
        if keep:
            with job.local_lock:
                removed = apply_retention(job.storage, job.root, keep, protect=self.protected(path),
                                          own_run=job.run_dir)
            for removed_path in removed:
                log.info("roll-ckpt: retention removed %s", removed_path)
        if job.backup is not None:
            job.backup.submit(path, step)

    def trainer_state(self, ctx: SaveContext, user: dict[str, Any]) -> bytes:
        job = self.job
        body = {
            "step": ctx.step,
            "time": utc_now(),
            "timestamp": time.time(),
            "world_size": ctx.world_size,
            "strategy": job.strategy.name,
            "exp_name": job.config.exp_name,
            "component": job.component,
            "resumed_from": job.resumed_from,
            "user": user,
        }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
