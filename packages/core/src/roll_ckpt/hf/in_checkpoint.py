"""The model as a Hugging Face folder inside every checkpoint (``checkpoint_config.hf_weights``,
``save_only_model``), written off the training loop.

::

    checkpoint-<step>/
        dcp/ ...                              the training state, as always
        config.json, generation_config.json   from the model's config (or hf_weights.config_dir)
        model-00001-of-0000N.safetensors ...  the weights, exactly as save_pretrained writes them
        model.safetensors.index.json
        tokenizer files                       those the job hands over (manager.hf_files) or config_dir's
        trainer_state.json, manifest.json

This is the folder ROLL's FSDP2 strategy writes beside ``dcp/`` (``save_pretrained`` into the
checkpoint folder), so vLLM, SGLang and ``from_pretrained`` open ``checkpoint-<step>/``
directly. ROLL gathers the full model on rank 0 and calls ``save_pretrained`` inside the
save; here nothing of it happens in ``save``: once ``dcp/`` is written (in the writer thread
of an asynchronous save), the coordinator reads the shards every rank just wrote, one HF
shard's tensors at a time (:mod:`roll_ckpt.format.hf_files`, in the hub's layout of
:mod:`roll_ckpt.format.hub_layout`), writes the HF files into the checkpoint being committed and
lists them in its manifest; the commit then publishes both at once. No collective, no
gather, no full copy of the model on any rank.

A process whose state holds no ``state[key]`` (a driver component saving ``DriverState``)
writes none.

**A failed HF part** (a model transformers cannot convert, a config that cannot be written,
an error while writing): the training state is what a resume needs, so the checkpoint is
still committed, without the HF files (those written are removed), and its manifest says
so: ``extra.hf = {"status": "failed", "error": ...}``, with a warning in the log;
``roll-ckpt ls`` shows ``hf: failed`` and ``roll-ckpt verify`` names it. A full disk is not
an HF failure: it fails the save as any write does. Otherwise ``extra.hf`` is
``{"status": "written", "files": N, "architecture": ...}``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any, Callable, Mapping

from ..errors import RollCkptError, disk_full
from ..config.hf_weights import HFWeightsConfig
from ..format.manifest import FileEntry

__all__ = ["HFPart", "CONFIG_FILES", "hf_status"]

log = logging.getLogger("roll_ckpt")

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                "processor_config.json")


class HFPart:
    """Writes the Hugging Face files of one checkpoint, on the coordinator."""

    def __init__(self, config: HFWeightsConfig) -> None:
        self.config = config
        self.extras: list[Any] = []
        """Objects with ``save_pretrained(dir)`` (tokenizer, processor) the job handed over."""
        self._extra_files: dict[str, bytes] | None = None
        self._layout: tuple[Any, Any] | None = None

    @staticmethod
    def of(cc: Any, strategy_config: Any) -> "HFPart | None":
        if cc.hf_weights is not None:
            return HFPart(cc.hf_weights)
        if strategy_config.save_only_model:
            return HFPart(HFWeightsConfig())
        return None

    def forget_files(self) -> None:
        """The handed-over objects changed: make their files again at the next write."""
        self._extra_files = None

    # ------------------------------------------------------------------ in the writer thread

    def write(self, storage: Any, write_path: str, module: Any, dcp_dir: str) -> tuple[dict[str, FileEntry], dict]:
        """Write the HF files into ``write_path``; returns their manifest entries and
        ``extra.hf``. A failure leaves no HF file behind and is returned as
        ``{"status": "failed"}`` (a full disk is raised)."""
        from ..format.manifest import hash_bytes

        folder = storage.join(write_path, self.config.subdir) if self.config.subdir else write_path
        prefix = f"{self.config.subdir}/" if self.config.subdir else ""

        def put(name: str, data: bytes) -> FileEntry:
            with storage.open_write(storage.join(folder, name)) as f:
                f.write(data)
            return FileEntry(*hash_bytes(data))

        written: dict[str, FileEntry] = {}
        try:
            if self.config.subdir:
                storage.makedirs(folder)
            arch = self._write(storage, write_path, module, dcp_dir,
                               lambda n, d: written.__setitem__(prefix + n, put(n, d)))
            return written, {"status": "written", "files": len(written), "architecture": arch}
        except Exception as exc:
            for name in written:
                try:
                    storage.remove(storage.join(write_path, *name.split("/")))
                except OSError:
                    pass
            if disk_full(exc) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
                raise
            message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RollCkptError) else str(exc)
            log.warning("roll-ckpt: the Hugging Face folder of %s could not be written (%s); the checkpoint is "
                        "committed without it (its manifest says so) and resumes as any other", write_path, message)
            return {}, {"status": "failed", "error": message}

    def _write(self, storage: Any, write_path: str, module: Any, dcp_dir: str, put: Callable[[str, bytes], None]) -> Any:
        import torch

        from ..dcp.reader import SafeReader
        from ..load.export import read_full_tensors
        from .export import module_keys
        from ..format.hf_files import INDEX_NAME, index_bytes, layout_of, shard_bytes, write_shards
        from ..format.hub_layout import transformers_model
        from ..runtime.units import parse_size

        cfg = self.config
        reader = SafeReader(storage, dcp_dir, checkpoint=write_path)
        md = reader.read_metadata()
        names, _ = module_keys(md, cfg.key, write_path)
        sizes = {n: (tuple(md.state_dict_metadata[f].size), md.state_dict_metadata[f].properties.dtype)
                 for n, f in names.items()}
        out_dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        model = transformers_model(module)
        signature = tuple(sorted((n, s, str(d)) for n, (s, d) in sizes.items()))
        if self._layout is None or self._layout[0] != signature:
            self._layout = (signature, layout_of(model, sizes, parse_size(cfg.max_shard_size), out_dtype))
        layout = self._layout[1]

        def read(keys: list[str]) -> dict[str, Any]:
            full = read_full_tensors(reader, md, [names[n] for n in keys], write_path)
            return {n: full.pop(names[n]) for n in keys}

        write_shards(layout, read, lambda filename, tensors: put(filename, shard_bytes(tensors)), out_dtype)
        index = index_bytes(layout)
        if index is not None:
            put(INDEX_NAME, index)
        for name, data in self._config_files(model, out_dtype).items():
            put(name, data)
        return layout.architecture

    def _config_files(self, model: Any, out_dtype: Any) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        if self.config.config_dir is not None:
            src = self.config.config_dir
            if not os.path.isfile(os.path.join(src, "config.json")):
                raise RollCkptError(f"checkpoint_config.hf_weights.config_dir {src}: no config.json there; give the "
                                    "folder of the model's Hugging Face config (config.json, tokenizer files)")
            for n in sorted(os.listdir(src)):
                if (n in CONFIG_FILES or n.endswith(".tiktoken")) and os.path.isfile(os.path.join(src, n)):
                    with open(os.path.join(src, n), "rb") as f:
                        files[n] = f.read()
        elif model is not None:
            from ..format.hub_layout import architecture_name
            from ..runtime.transformers_compat import saved_config

            config = saved_config(model, architecture_name(model))
            files["config.json"] = config.to_json_string(use_diff=True).encode()
            generation = getattr(model, "generation_config", None)
            if generation is not None and getattr(model, "can_generate", lambda: False)():
                files["generation_config.json"] = generation.to_json_string(use_diff=True).encode()
        else:
            raise RollCkptError(f"state['{self.config.key}'] is not a transformers model, so there is no config.json "
                                "to write beside its weights: set checkpoint_config.hf_weights.config_dir")
        if "config.json" in files:
            from ..runtime.transformers_compat import as_saved

            body = json.loads(files["config.json"])
            if out_dtype is not None or as_saved(body) is not body:  # else the bytes as they are
                body = as_saved(body)
                if out_dtype is not None:
                    for k in [k for k in ("dtype", "torch_dtype") if k in body] or ["dtype"]:
                        body[k] = str(out_dtype).removeprefix("torch.")
                files["config.json"] = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
        files.update(self._handed_over())
        return files

    def _handed_over(self) -> dict[str, bytes]:
        """The files of the tokenizer/processor the job handed over, made once."""
        if self._extra_files is None:
            import tempfile

            self._extra_files = {}
            with tempfile.TemporaryDirectory() as tmp:
                for obj in self.extras:
                    obj.save_pretrained(tmp)
                for n in sorted(os.listdir(tmp)):
                    if os.path.isfile(os.path.join(tmp, n)) and n != "config.json":
                        with open(os.path.join(tmp, n), "rb") as f:
                            self._extra_files[n] = f.read()
        return self._extra_files


def hf_status(extra: Mapping[str, Any]) -> str:
    """``written``, ``failed`` or ``""`` (no HF part) for a manifest's ``extra``."""
    hf = extra.get("hf")
    return str(hf.get("status", "")) if isinstance(hf, Mapping) else ""

