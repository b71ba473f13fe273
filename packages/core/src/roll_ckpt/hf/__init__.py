"""The exporter (:mod:`.export`): checkpoints as Hugging Face folders (``export --format hf``),
as one safetensors file (``export``), and the folder inside every checkpoint, written by the
save's commit. It reads through the DCP I/O (:mod:`roll_ckpt.dcp`), not through the resume path.

Layer 6: imports ``tiers``, ``config``, ``dcp``, ``format``, ``runtime``; ``save`` and the CLI call it.
"""
