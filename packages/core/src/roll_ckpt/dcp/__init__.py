"""The DCP I/O: every byte a strategy saves or resumes goes through these modules.

- :mod:`.files`: DCP's file system on any storage, hashing what it writes; tensor frames;
  views of memory without copies.
- :mod:`.writer`: the planner that reuses a structure's plan, the writer that hashes each
  file, the fixed layout of periodic saves, and incremental saves' take-over of unchanged files.
- :mod:`.global_plan`: the coordinator's global plan in linear time (full saves only).
- :mod:`.checked`: reading files checked against the manifest (whole, or piece by piece).
- :mod:`.reader`: DCP's reader over checked files, the job's one read of ``.metadata``, and
  what a resume loads into.

Layer 3: imports ``format``, ``runtime`` and the base modules.
"""
