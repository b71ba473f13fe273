"""The load path: which checkpoint to resume and how (:mod:`.resume`), DCP's reader over
verified, streamed files (:mod:`.reader`), the job's one read of ``.metadata``
(:mod:`.job_load`), full tensors for exports (:mod:`.export`), initial weights from
Hugging Face folders (:mod:`.hf_folder`).

Layer 5: imports ``tiers``, ``config``, ``format``, ``runtime``; never ``save``.
"""
