"""Where checkpoints live: one job's storage and run folder (:mod:`.job`), retention and
space, the backup and its replication, copies between storages, the fast recovery tier
and its peer replicas.

Layer 5: imports ``config``, ``dcp``, ``format``, ``runtime`` and the base modules.
"""
