"""A third-party backend, as someone outside roll-ckpt would write one.

It stores checkpoints in a local folder like an object store would: no rename, the
manifest written last with ``O_EXCL``. It depends on roll-ckpt-core only.
"""
