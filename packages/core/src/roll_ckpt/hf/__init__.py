"""Hugging Face folders written from checkpoints: ``export --format hf`` (:mod:`.export`) and
the folder inside every checkpoint, written off the loop (:mod:`.in_checkpoint`).

Layer 7: reads checkpoints through ``load``; the save pipeline calls it.
"""
