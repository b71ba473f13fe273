"""Per-process random number generator state, as plain tensors.

Stored as tensors (not pickled Python objects) so it loads with ``weights_only=True``
and shows up in any DCP tool. Covers Python's ``random``, NumPy's global generator,
torch's CPU generator and, when present, every CUDA device's generator.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, torch.Tensor]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    if not isinstance(np_state, tuple) or np_state[0] != "MT19937":
        raise RuntimeError("numpy's global generator is not MT19937; cannot capture it")
    _, keys, pos, has_gauss, cached = np_state
    out = {
        "python": torch.tensor([version, *internal, 0 if gauss is None else 1], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*np.asarray(keys, dtype=np.int64).tolist(), pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return out


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"].tolist()
    gauss = float(state["python_gauss"][0]) if py[-1] else None
    random.setstate((py[0], tuple(py[1:-1]), gauss))
    npv = state["numpy"].tolist()
    np.random.set_state(("MT19937", np.array(npv[:624], dtype=np.uint32), npv[624], npv[625],
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([cuda[i].to(torch.uint8).cpu() for i in range(n)])
