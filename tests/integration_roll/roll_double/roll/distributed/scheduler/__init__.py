"""Test double of ROLL's roll.distributed.scheduler: initialize.py (init) only."""
