"""What the verl jobs of these tests share (imported by ``_sft_job.py`` and ``_ppo_job.py`` in
their own processes, and by the tests): the tiny model, the data, verl's configs for the CPU,
a snapshot of everything a resume must restore, and its bit-for-bit comparison.

The CPU settings (test-side, nothing in roll-ckpt-verl depends on them): the platform of
``shim/`` (``VERL_PLATFORM=cpu``), ``VERL_ENGINE_DEVICE=cuda`` (verl registers its FSDP
engines for cuda and npu only: the lookup key, nothing runs on a GPU), SDPA attention
(verl's default is flash-attn), fp32 mixed precision (losses compared bit for bit).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
TOTAL_STEPS = 6
"""Training steps of every job (the optimizer's total_training_steps: the last is saved synchronously)."""


def cpu_env(vendor: bool) -> dict[str, str]:
    """The environment of a verl job here: the CPU shim, and the switch when ``vendor``."""
    env = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(SHIM), str(HERE.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    if vendor:
        env["VERL_ENGINE_VENDOR"] = "roll_ckpt"
    return env


def make_model(out: str, *, hidden: int = 32, layers: int = 2) -> str:
    """A tiny untied Llama (by default hidden 32, 2 layers, vocab 96: 24,736 parameters) and an
    offline character tokenizer, saved with ``save_pretrained`` as verl's ``HFModelConfig`` loads them."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + 92)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Toy:
    """Fixed variable-length token sequences, as verl's MultiTurnSFTDataset yields them in its
    no-padding mode (``input_ids``, ``position_ids``, ``loss_mask``)."""

    def __init__(self, n: int = 64) -> None:
        import torch

        g = torch.Generator().manual_seed(1234)
        self.items = []
        for _ in range(n):
            ln = int(torch.randint(6, 14, (1,), generator=g))
            ids = torch.randint(4, 96, (ln,), generator=g)
            mask = torch.ones(ln, dtype=torch.long)
            mask[: ln // 3] = 0
            self.items.append({"input_ids": ids, "position_ids": torch.arange(ln), "loss_mask": mask})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def worker_config(model: str, *, async_save: bool = False, contents: tuple[str, ...] = ("model", "optimizer", "extra"),
                  model_type: str = "language_model", seed: int = 7, total_steps: int = TOTAL_STEPS) -> Any:
    """verl's ``TrainingWorkerConfig`` of an FSDP2 engine on the CPU (AdamW, cosine schedule)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorkerConfig

    return TrainingWorkerConfig(
        model_type=model_type,
        model_config=HFModelConfig(path=model, override_config={"attn_implementation": "sdpa"},
                                   enable_gradient_checkpointing=False, use_remove_padding=True),
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, use_dynamic_bsz=False,
                                       micro_batch_size_per_gpu=2, seed=seed,
                                       mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                        "buffer_dtype": "fp32"}),
        optimizer_config=FSDPOptimizerConfig(lr=1e-2, lr_warmup_steps=2, total_training_steps=total_steps,
                                             lr_scheduler_type="cosine", weight_decay=0.1),
        checkpoint_config=CheckpointConfig(save_contents=list(contents),
                                           load_contents=[c for c in contents if c != "hf_model"],
                                           async_save=async_save))


def snapshot(engine: Any, loader: Any = None) -> dict[str, Any]:
    """Everything a resume must restore, as full tensors (a collective: every rank calls it):
    the model's parameters, every optimizer tensor (by position) and its param groups, the
    scheduler, this rank's RNG (taken first: a loader's first ``state_dict()`` may draw from
    torch's) and the dataloader's position."""
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}

    def full(t: Any) -> Any:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    model = {k: full(v) for k, v in engine.module.state_dict().items()}
    opt = engine.optimizer.state_dict()
    state = {f"{pid}.{k}": full(v) if isinstance(v, torch.Tensor) else v for pid, st in opt["state"].items()
             for k, v in st.items()}
    return {"model": model, "optim": state, "param_groups": opt["param_groups"],
            "lr_scheduler": engine.lr_scheduler.state_dict(), "rng": rng,
            **({"dataloader": loader.state_dict()} if loader is not None else {})}


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors bit for bit, NaN-safe); empty when identical."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        def bits(t: Any) -> Any:
            return t.reshape(-1).contiguous().view(torch.uint8)
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
        return [] if ok else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return [f"{path}: not a dict"]
        bad = [f"{path}/{k}: missing" for k in a if k not in b] + [f"{path}/{k}: extra" for k in b if k not in a]
        return bad + [x for k in a if k in b for x in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path}: length"]
        return [x for i, (u, v) in enumerate(zip(a, b)) for x in same(u, v, f"{path}[{i}]")]
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b) else [path]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def seed_everything(rank: int) -> None:
    """Python's, NumPy's and torch's generators seeded by rank: two runs of a job draw the same
    numbers, so a resumed run's RNG can be compared with another run's (unseeded, Python's and
    NumPy's start from the OS's entropy)."""
    import numpy as np
    import torch

    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)


def install_kill(step: int, rank: int, vendor: bool) -> None:
    """The tests' fault: this process dies (SIGKILL) half-way through writing its first data file
    of step ``step``: roll-ckpt's (a DCP ``.distcp`` file, through its file-system backend) or,
    without the switch, verl's own (``torch.save`` of its optimizer file). Half the bytes are on
    disk, as a crash leaves them."""
    folder = f"global_step_{step}"

    def die(path: str) -> None:
        print(f"[rank {rank}] killed mid-save: {path}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if vendor:
        from roll_ckpt_fs.storage import LocalStorage

        opened = LocalStorage.open_write

        class Dying:
            """The stream roll-ckpt writes a data file to, until its first write: half of it, then death."""

            def __init__(self, f: Any, path: str) -> None:
                self._f, self._path = f, path

            def write(self, data: Any) -> int:
                data = bytes(data)
                self._f.write(data[: max(1, len(data) // 2)])
                self._f.flush()
                die(self._path)
                return 0

            def __getattr__(self, name: str) -> Any:
                return getattr(self._f, name)

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: Any) -> Any:
                return self._f.__exit__(*exc)

        def open_write(self: Any, path: str) -> Any:
            f = opened(self, path)
            return Dying(f, path) if folder in path and path.endswith(".distcp") else f

        LocalStorage.open_write = open_write
    else:
        import io

        import torch

        save = torch.save

        def dying_save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
            if isinstance(f, str) and folder in f and "optim" in f:
                buf = io.BytesIO()
                save(obj, buf, *a, **k)
                with open(f, "wb") as out:
                    out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                die(f)
            return save(obj, f, *a, **k)

        torch.save = dying_save


def install_slow_writes(seconds: float) -> None:
    """roll-ckpt's data files of every ``global_step_<N>`` save start ``seconds`` late: an
    asynchronous save is then still in flight when the trainer's ``_save_checkpoint`` returns."""
    import time

    from roll_ckpt_fs.storage import LocalStorage

    opened = LocalStorage.open_write

    def open_write(self: Any, path: str) -> Any:
        if "global_step_" in path and path.endswith(".distcp"):
            time.sleep(seconds)
        return opened(self, path)

    LocalStorage.open_write = open_write


def write_json(path: str | Path, body: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__" and sys.argv[1:2] == ["make-model"]:
    print(make_model(sys.argv[2]))
