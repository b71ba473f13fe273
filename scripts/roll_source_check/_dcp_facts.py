"""Digests of a ROLL-layout DCP folder, read offline in one process (no ROLL classes):

    $ROLL_PYTHON _dcp_facts.py DCP_DIR OUT.json

Model tensors by key, the optimizer's state by parameter position (``"<position>::<field>"``),
its param groups (less ``params``), the scheduler's state dict, the RNG ROLL keeps
(``rng_state``: torch's CPU generator digested as roll_cpu_shims.rng_digests does)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile


def _sha(t) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha1(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()[:16]


def main() -> int:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp, out = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(dcp, path)
        sd = torch.load(path, weights_only=False)
    own = ("optimizer", "scheduler", "rng_state")
    facts = {"model": {k: _sha(v) for k, v in sd.items() if k not in own and torch.is_tensor(v)}}
    opt = sd.get("optimizer") or {}
    facts["optimizer_state"] = {f"{int(pos)}::{field}": (_sha(v) if torch.is_tensor(v) else repr(v))
                                for pos, st in sorted((opt.get("state") or {}).items(), key=lambda kv: int(kv[0]))
                                for field, v in sorted(st.items())}
    facts["param_groups"] = [{k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                              for k, v in g.items() if k != "params"} | {"n_params": len(g["params"])}
                             for g in opt.get("param_groups") or []]
    sched = sd.get("scheduler")
    facts["scheduler"] = json.loads(json.dumps({k: v for k, v in (sched or {}).items() if k != "lr_lambdas"},
                                               default=repr)) if sched is not None else None
    rng = sd.get("rng_state") or {}
    facts["rng_torch"] = _sha(rng["cpu"].to(torch.uint8)) if torch.is_tensor(rng.get("cpu")) else None
    facts["rng_keys"] = sorted(rng)
    with open(out, "w") as f:
        json.dump(facts, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
