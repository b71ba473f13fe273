"""Exact-size aliases of the offload store's slots: core's :func:`roll_ckpt.dcp.files.exact_alias`.

A shard that views a flat buffer has ``storage_offset() != 0`` and shares the whole
buffer's storage. DCP's stagers copy the whole buffer or crash on such tensors, and a
writer would clone them; the alias has offset 0 and a storage of exactly its own bytes,
yet the same memory.
"""

from roll_ckpt.plugin import exact_alias

__all__ = ["exact_alias"]
