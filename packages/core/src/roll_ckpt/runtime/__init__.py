"""What the process provides, below any checkpoint: torch's version-specific APIs
(:mod:`.torch_compat`), the garbage collector's pause, collectives with timeouts,
background threads, progress, sizes, RNG capture and preemption signals.

Layer 1: imports only the base modules (``errors``, ``contracts``).
"""
