"""Stands in for roll/distributed/scheduler/protocol.py: the part of ``DataProto`` the
checkpoint path uses (``meta_info``, ``materialize_concat``). Not ROLL's code."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import ray


@dataclass
class DataProto:
    meta_info: Dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def materialize_concat(data_refs: Any, *, global_keys: Optional[Set[str]] = None) -> "DataProto":
        """Fetch DataProto objects from Ray refs and concatenate them; ``meta_info`` is rank
        0's unless ``global_keys`` names keys to gather from every rank (as ROLL's)."""
        if isinstance(data_refs, DataProto):
            data_refs = [data_refs]
        items: List[DataProto] = [r if isinstance(r, DataProto) else ray.get(r) for r in data_refs]
        meta = dict(items[0].meta_info) if items else {}
        for key in global_keys or ():
            meta[key] = [item.meta_info.get(key) for item in items]
        return DataProto(meta_info=meta)
