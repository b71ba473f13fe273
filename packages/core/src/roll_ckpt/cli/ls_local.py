"""``roll-ckpt ls``'s view of the fast recovery tier (``checkpoint_config.local``): for each
node folder and step, the ranks whose units it holds, its own ranks' and replicas."""

from __future__ import annotations

import re
from typing import Any

from ._common import format_table, human_bytes, say

__all__ = ["local_rows", "is_local_tier", "show_local"]

_UNIT = re.compile(r"^rank-(\d+)$")


def _step_folders(storage: Any, folder: str) -> list[tuple[int, str]]:
    from ..format.layout import parse_step

    out = []
    for e in storage.list(folder):
        step = parse_step(e.name)
        if step is not None and e.is_dir:
            out.append((step, e.path))
    return sorted(out)


def _has_units(storage: Any, folder: str) -> bool:
    return any(any(_UNIT.match(u.name) for u in storage.list(path)) for _, path in _step_folders(storage, folder))


def _node_folders(storage: Any, root: str) -> list[tuple[str, str]]:
    from ..format.layout import basename

    if _has_units(storage, root):  # DIR is one node's folder
        return [(basename(root), root)]
    return sorted((e.name, e.path) for e in storage.list(root)
                  if e.is_dir and not e.name.startswith(".") and _has_units(storage, e.path))


def is_local_tier(storage: Any, root: str) -> bool:
    """True when ``root`` is a ``local.dir`` (node folders) or one node folder."""
    return bool(_node_folders(storage, root))


def local_rows(storage: Any, root: str) -> list[dict[str, Any]]:
    """One row per node folder and step: committed units by rank, which are the node's own."""
    from ..format.manifest import MANIFEST_NAME, Manifest
    from ..format.manifest import list_files

    rows = []
    for node, folder in _node_folders(storage, root):
        for step, path in _step_folders(storage, folder):
            own, replicas, unfinished, size = [], [], [], 0
            for e in storage.list(path):
                m = _UNIT.match(e.name)
                if not (m and e.is_dir):
                    continue
                rank = int(m.group(1))
                size += sum(list_files(storage, e.path).values())
                try:
                    with storage.open_read(storage.join(e.path, MANIFEST_NAME)) as f:
                        manifest, _ = Manifest.from_bytes(f.read())
                except (OSError, ValueError):
                    unfinished.append(rank)
                    continue
                (own if manifest.extra.get("node") == node else replicas).append(rank)
            rows.append({"tier": "local", "node": node, "step": step, "path": path, "own": sorted(own),
                         "replicas": sorted(replicas), "unfinished": sorted(unfinished), "bytes": size})
    return rows


def show_local(rows: list[dict[str, Any]], where: str) -> None:
    if not rows:
        say(f"no local checkpoints under {where}")
        return
    cells = [[r["node"], str(r["step"]), ",".join(map(str, r["own"])) or "-", ",".join(map(str, r["replicas"])) or "-",
              ",".join(map(str, r["unfinished"])) or "-", human_bytes(r["bytes"])] for r in rows]
    say(*format_table(["NODE", "STEP", "OWN RANKS", "REPLICAS OF", "UNFINISHED", "SIZE"], cells, right={1, 5}))
    total = sum(r["bytes"] for r in rows)
    say("", f"local tier: {len(rows)} step folder(s) on {len({r['node'] for r in rows})} node(s), "
            f"{human_bytes(total)} under {where}",
        "a local step is resumable when every rank's unit is committed on some node (`roll-ckpt verify` "
        "checks one unit: <node>/checkpoint-<step>/rank-<r>)")


def local_units(storage: Any, root: str) -> list[str] | None:
    """The unit folders below ``root`` (a ``local.dir``, a node folder or one step folder of
    it), committed or not; ``None`` when ``root`` is none of those."""
    direct = [e.path for e in storage.list(root) if e.is_dir and _UNIT.match(e.name)]
    if direct:
        return sorted(direct)
    nodes = _node_folders(storage, root)
    if not nodes:
        return None
    return [e.path for _, folder in nodes for _, path in _step_folders(storage, folder)
            for e in sorted(storage.list(path), key=lambda e: e.name) if e.is_dir and _UNIT.match(e.name)]
