"""The global plan's planner-data merge and chunk validation give DCP's own answers, in linear time."""

from __future__ import annotations

import random
from collections import ChainMap
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)

from roll_ckpt.dcp.global_plan import chunk_errors, merge_planner_data

pytestmark = pytest.mark.timeout(60)


def _md(tensors: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]]) -> Metadata:
    sdm: dict = {"v": BytesStorageMetadata()}
    for key, (size, chunks) in tensors.items():
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                         [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    return Metadata(state_dict_metadata=sdm)


def _grid(size: tuple[int, int], rng: random.Random) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Chunks cutting a 2-D tensor along one dimension or both, sometimes damaged."""
    cuts = [sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) for n in size]
    if rng.random() < 0.5:
        cuts[rng.randrange(2)] = []
    edges = [[0, *c, n] for c, n in zip(cuts, size)]
    chunks = [((a0, b0), (a1 - a0, b1 - b0)) for a0, a1 in zip(edges[0], edges[0][1:])
              for b0, b1 in zip(edges[1], edges[1][1:])]
    damage = rng.random()
    if damage < 0.2 and len(chunks) > 1:
        chunks.pop(rng.randrange(len(chunks)))  # a hole
    elif damage < 0.4:
        (o0, o1), (s0, s1) = chunks[0]
        chunks.append(((o0, o1), (s0, s1 + 1)))  # an overlap, perhaps out of bounds too
    elif damage < 0.5:
        (o0, o1), (s0, s1) = chunks[-1]
        chunks[-1] = ((o0, o1 + 1), (s0, s1))  # out of bounds
    return chunks


def _dcp_errors(md: Metadata) -> list[str] | None:
    """DCP's own answer: its messages (torch 2.13 and 2.14 return them), or only valid ``[]`` /
    invalid ``None`` (torch 2.6-2.11 return a bool and log the messages)."""
    verdict = _validate_global_plan([None, None], md)  # type: ignore[arg-type]
    if isinstance(verdict, bool):
        return [] if verdict else None
    return verdict


def test_chunk_validation_agrees_with_dcp_on_random_chunkings() -> None:
    rng = random.Random(0)
    for _ in range(400):
        tensors = {f"t{k}": ((size := (rng.randint(1, 9), rng.randint(1, 9))), _grid(size, rng)) for k in range(3)}
        md = _md(tensors)
        ours = chunk_errors(md, whole=True)
        theirs = _dcp_errors(md)
        assert bool(ours) == (theirs != []), (tensors, ours, theirs)
        if theirs is not None:
            assert {e.split(" ")[0] for e in ours} == {e.split(" ")[0] for e in theirs}


def test_chunk_validation_is_linear_for_fsdp2_shards_of_wide_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 cuts dim 0 and dim 1 is the larger: DCP's sweep (along the larger dim) compares
    every pair of chunks, n^2/2; ours compares each chunk only with those it reaches along
    the dimension that was cut."""
    from roll_ckpt.dcp import global_plan

    compared = []
    real = global_plan._overlap
    monkeypatch.setattr(global_plan, "_overlap", lambda a, b: compared.append(1) or real(a, b))
    n = 4096
    md = _md({"w": ((n, 8 * n), [((r, 0), (1, 8 * n)) for r in range(n)])})
    assert chunk_errors(md, whole=True) == []
    assert len(compared) <= n, len(compared)
    # chunks two rows high, each overlapping the next by one row: every overlap is found,
    # still with each chunk compared with its neighbour only
    compared.clear()
    md = _md({"w": ((n + 1, 8 * n), [((r, 0), (2, 8 * n)) for r in range(n)])})
    errors = chunk_errors(md, whole=True)
    assert sum("overlapping" in e for e in errors) == n - 1 and len(compared) <= 2 * n, (len(errors), len(compared))


def test_planner_data_merge_is_the_chainmap() -> None:
    plans = [SimpleNamespace(planner_data={"a": (r,), f"per_rank.{r}.x": ("per_rank", str(r), "x")}) for r in range(50)]
    assert merge_planner_data(plans) == dict(ChainMap(*[p.planner_data for p in plans]))


def test_small_replicated_values_go_to_the_lowest_rank_and_large_ones_are_spread() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from roll_ckpt.dcp.global_plan import SMALL_REPLICATED, dedup_plans

    def item(fqn: str, n: int) -> WriteItem:
        props = TensorProperties(dtype=torch.uint8)
        data = TensorWriteData(ChunkStorageMetadata(torch.Size([0]), torch.Size([n])), props, torch.Size([n]))
        return WriteItem(MetadataIndex(fqn, torch.Size([0])), WriteItemType.TENSOR, tensor_data=data)

    ranks = 8
    big = [item(f"w{k}", SMALL_REPLICATED * 4) for k in range(ranks)]
    plans = [SavePlan([item(f"own{r}", 10), *(item(f"step{k}", 8) for k in range(20)), *big]) for r in range(ranks)]
    out = dedup_plans(plans)
    names = [[i.index.fqn for i in p.items] for p in out]
    assert all(f"step{k}" in names[0] for k in range(20))  # every small one on rank 0
    assert not any(n.startswith("step") for r in range(1, ranks) for n in names[r])
    assert all(f"own{r}" in names[r] for r in range(ranks))
    assert sorted(sum(n.startswith("w") for n in ns) for ns in names) == [1] * ranks  # spread: one each
