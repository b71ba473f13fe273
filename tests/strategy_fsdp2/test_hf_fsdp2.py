"""Hugging Face folders and FSDP2 on 2 gloo ranks: a ``save_pretrained`` folder (dense, or MoE
in the hub's layout) loaded
through ``initial_load`` (each rank reading its slices), trained, saved, and exported in
one process with ``--format hf`` for transformers' ``from_pretrained``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from core._hf_helpers import from_pretrained, logits, tiny_llama, tiny_moe
from roll_ckpt.cli import main
from test_fsdp2 import torchrun

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(400)
WORKERS = Path(__file__).with_name("hf_workers.py")


def test_initial_load_train_and_export_on_two_ranks(tmp_path: Path) -> None:
    sources, folders = {}, []
    for name, tied in (("untied", False), ("tied", True)):
        sources[name] = tiny_llama(tied=tied, seed=0)
        sources[name].save_pretrained(tmp_path / f"hf-{name}", max_shard_size="20KB")
        folders.append(f"{name}={tmp_path / f'hf-{name}'}")
    for family in ("qwen2_moe", "mixtral"):                  # the hub's layout: one tensor per expert
        sources[family] = tiny_moe(family, seed=0)
        sources[family].save_pretrained(tmp_path / f"hf-{family}", max_shard_size="20KB")
        folders.append(f"{family}={tmp_path / f'hf-{family}'}")
    tiny_llama(intermediate_size=48).save_pretrained(tmp_path / "hf-narrow", max_shard_size="20KB")
    folders.append(f"refused={tmp_path / 'hf-narrow'}")  # loaded into the untied model's configuration
    torchrun(2, "hf_roundtrip", str(tmp_path), *folders, timeout=360, workers=WORKERS)

    refusals = [json.loads((tmp_path / f"result-refused-{r}.json").read_text()) for r in range(2)]
    assert refusals[0] == refusals[1] and refusals[0]["untouched"]  # the same error on both ranks, nothing loaded
    assert "shape mismatch" in refusals[0]["error"] and "'model.layers.0.mlp.down_proj.weight' is [32, 48]" \
        in refusals[0]["error"]

    for name, source in sources.items():
        ranks = [json.loads((tmp_path / f"result-{name}-{r}.json").read_text()) for r in range(2)]
        got = torch.load(tmp_path / f"{name}.pt")
        expected = source.state_dict()
        # initial load: identical parameters, each rank having read only its own slices
        assert [(r["start"], r["strategy"]) for r in ranks] == [(0, "fsdp2")] * 2
        assert got["loaded"].keys() == expected.keys()
        assert all(torch.equal(got["loaded"][k], expected[k]) for k in expected), name
        distinct = {id(p): p for p in source.parameters()}.values()  # a tied tensor is read once
        total = sum(p.numel() * p.element_size() for p in distinct)
        assert sum(r["bytes_read"] for r in ranks) == total
        assert all(r["bytes_read"] < 0.6 * total for r in ranks), ranks
        assert not all(torch.equal(got["trained"][k], expected[k]) for k in expected)  # it trained

        # the checkpoint's own Hugging Face files (hf_weights), written by the coordinator from the
        # dcp/ shards of both ranks: transformers opens the checkpoint folder itself
        # logits compared in this process: the workers run one thread each, and an MoE layer's
        # sums can round differently with another thread count (seen once under load)
        reference = copy.deepcopy(source)
        reference.load_state_dict(got["trained"])
        want = logits(reference)
        torch.testing.assert_close(want, got["logits"], rtol=1e-5, atol=1e-6)
        inside = from_pretrained(Path(ranks[0]["checkpoint"]))
        assert all(torch.equal(v, got["trained"][k]) for k, v in inside.state_dict().items()), name
        # (transformers 4.x marks a config whose model it built: _attn_implementation_autoset)
        bookkeeping = ("_name_or_path", "_attn_implementation_autoset")
        same = {k: v for k, v in inside.config.to_dict().items() if k not in bookkeeping}
        assert same == {k: v for k, v in reference.config.to_dict().items() if k not in bookkeeping}, name
        # the same parameters, bit for bit, and the same config: the logits agree to the last bits
        # (a model loaded by from_pretrained and one filled by load_state_dict differed by one ulp,
        # 1.5e-8, in Mixtral's sums on the roll-2.6 and roll-2.8 legs rebuilt on 2026-12-05, at the
        # commit before as well: a release of a dependency, not the checkpoint)
        torch.testing.assert_close(logits(inside), want, rtol=1e-6, atol=1e-7)
        assert json.loads((Path(ranks[0]["checkpoint"]) / "manifest.json").read_text())["extra"]["hf"]["status"] \
            == "written"

        # the 2-rank checkpoint exported by one process, read back by transformers
        out = tmp_path / f"export-{name}"
        rc = main(["--quiet", "export", ranks[0]["checkpoint"], "--format", "hf", "--out", str(out),
                   "--max-shard-size", "20KB", "--hf-config", str(tmp_path / f"hf-{name}")])
        assert rc == 0
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
        exported = from_pretrained(out)
        sd = exported.state_dict()
        assert all(torch.equal(sd[k], got["trained"][k]) for k in got["trained"]), name
        torch.testing.assert_close(logits(exported), want, rtol=1e-6, atol=1e-7)  # one ulp, as above

        rc = main(["--quiet", "export", ranks[0]["checkpoint"], "--format", "hf", "--out", str(out) + "-bf16",
                   "--dtype", "bfloat16", "--hf-config", str(tmp_path / f"hf-{name}")])
        assert rc == 0
        half = from_pretrained(Path(str(out) + "-bf16"))
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(logits(half).float(), got["logits"], rtol=1.6e-2, atol=1e-2)
