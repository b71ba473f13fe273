"""Test double of ROLL's roll.distributed.executor: worker.py (Worker), cluster.py (Cluster)."""
