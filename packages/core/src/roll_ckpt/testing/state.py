"""The conformance suite's training state: a tiny model, its snapshot, a bitwise comparison."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["tiny_state", "state_snapshot", "assert_same_state"]


def tiny_state(seed: int = 0) -> dict[str, Any]:
    """A small model with dropout, AdamW after two steps, a LR scheduler and a counter dict."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counter = {"seen": 0}
    for _ in range(2):
        x = torch.randn(5, 8, generator=g)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counter["seen"] += 5
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "counter": counter}


def state_snapshot(state: Mapping[str, Any]) -> dict[str, Any]:
    """Deep copies of the comparable parts of a :func:`tiny_state`-like state."""
    import copy

    import torch

    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            out[key] = {k: v.detach().clone() for k, v in obj.state_dict().items()}
        elif hasattr(obj, "state_dict"):
            out[key] = copy.deepcopy(obj.state_dict())
        else:
            out[key] = copy.deepcopy(obj)
    return out


def _assert_equal(a: Any, b: Any, where: str) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Bitwise comparison of two :func:`state_snapshot` results."""
    _assert_equal(dict(a), dict(b), "state")
