"""What the network did to a save: fault counts read from the backend, one log line per save.

A networked backend counts the faults it met (``Storage.network_counts()``, a
:class:`~roll_ckpt.contracts.NetworkCounts`; the S3 backend's policy is in
``roll_ckpt_fs.network``). The save pipeline reads the counts when a save starts and when
it ends: the difference is ``SaveStats.network``, and a save that met any fault says so in
one ``WARNING`` line (retried requests are otherwise silent). ``manager.stats.network`` holds the
totals. Before the manifest of an object-store checkpoint is written, every object is
checked to be there with the size the writer wrote (:func:`check_objects`): a checkpoint
with a missing or short object is never committed.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Mapping

from ..contracts import CountsNetwork, NetworkCounts, Storage
from ..errors import SaveError

__all__ = ["read_counts", "report_save", "check_objects"]

log = logging.getLogger("roll_ckpt")


def read_counts(storage: Storage) -> NetworkCounts | None:
    """The backend's fault counts now (``None``: it keeps none, e.g. a local disk)."""
    return storage.network_counts() if isinstance(storage, CountsNetwork) else None


def report_save(what: str, rank: int, counts: NetworkCounts | None, *, failed: bool = False) -> None:
    """One line for a save that met network faults (nothing when it met none)."""
    if counts is None or not counts.faults:
        return
    outcome = "failed" if failed else "committed"
    log.warning("roll-ckpt: %s %s on rank %d after %s", what, outcome, rank, counts.describe())


def check_objects(storage: Storage, folder: str, sizes: Mapping[str, int]) -> None:
    """Every file of ``sizes`` (relative to ``folder``) is listed there with that size, or a
    :class:`SaveError` names the first that is not (nothing is committed then)."""
    listed: dict[str, dict[str, int]] = {}
    for name, size in sorted(sizes.items()):
        sub = posixpath.dirname(name)
        if sub not in listed:
            where = storage.join(folder, sub) if sub else folder
            listed[sub] = {e.name: e.size for e in storage.list(where) if not e.is_dir}
        found = listed[sub].get(posixpath.basename(name))
        if found != size:
            state = "is missing" if found is None else f"holds {found} bytes"
            raise SaveError(f"{storage.join(folder, name)} {state}, the writer wrote {size}: the upload did not "
                            "complete; nothing of this checkpoint was committed and the next save tries again")
