"""The saver: staging (:mod:`.staging`: the copy policies, the regular copy and the state-dict
cache) and the pipeline that launches, writes through :mod:`roll_ckpt.dcp` and commits
(:mod:`.pipeline`).

Layer 8: imports ``hf``, ``tiers``, ``config``, ``dcp``, ``format``, ``runtime``; never ``load``.
"""
