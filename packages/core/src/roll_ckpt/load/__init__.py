"""The resumer: which checkpoint to resume and how (:mod:`.resume`); initial weights from
Hugging Face folders (:mod:`.hf_folder`), plain DCP folders and ``torch.save`` files
(:mod:`.dcp_folder`, :mod:`.torch_file`). The reads themselves are :mod:`roll_ckpt.dcp`'s.

Layer 7: imports ``tiers``, ``config``, ``dcp``, ``format``, ``runtime``; never ``save``.
"""
