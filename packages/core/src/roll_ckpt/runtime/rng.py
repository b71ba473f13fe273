"""Per-process random number generator state: Python's ``random``, NumPy's global
generator, torch's CPU generator and, when present, every CUDA device's generator.

:func:`plain_rng_state` is the Python and NumPy part as JSON values (a driver process,
which never imports torch, saves it as JSON). :func:`capture_rng` adds torch's and keeps
everything as plain tensors, so it loads with ``weights_only=True`` and shows in any DCP
tool.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["plain_rng_state", "restore_plain_rng_state", "capture_rng", "restore_rng"]


def plain_rng_state() -> dict[str, list]:
    """``{"python": [version, internal, gauss], "numpy": [kind, keys, pos, has_gauss, cached]}``."""
    import numpy as np  # (here: ``import roll_ckpt`` does not import NumPy)

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    if kind != "MT19937":
        raise RuntimeError("numpy's global generator is not MT19937; cannot capture it")
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}


def restore_plain_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state.get("numpy")
    if saved is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = saved
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def capture_rng() -> dict[str, Any]:
    import torch

    plain = plain_rng_state()
    version, internal, gauss = plain["python"]
    _, keys, pos, has_gauss, cached = plain["numpy"]
    out = {
        "python": torch.tensor([version, *internal, 0 if gauss is None else 1], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.tensor([*keys, pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return out


def restore_rng(state: dict[str, Any]) -> None:
    import torch

    py = state["python"].tolist()
    npv = state["numpy"].tolist()
    restore_plain_rng_state({
        "python": [py[0], py[1:-1], float(state["python_gauss"][0]) if py[-1] else None],
        "numpy": ["MT19937", npv[:624], npv[624], npv[625], float(state["numpy_gauss"][0])],
    })
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([cuda[i].to(torch.uint8).cpu() for i in range(n)])
