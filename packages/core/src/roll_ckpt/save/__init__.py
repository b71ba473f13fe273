"""The save path, in the data's order: staging (:mod:`.staging`, :mod:`.regular_copy`,
:mod:`.state_dict_cache`), DCP's writer (:mod:`.writer`; its tensors framed by :mod:`roll_ckpt.format.tensor_frames`), the global
plan and the fixed layout of periodic saves, and the pipeline that commits
(:mod:`.pipeline`).

Layer 7: imports ``hf``, ``tiers``, ``config``, ``format``, ``runtime``; never ``load``.
"""
