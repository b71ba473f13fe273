"""Test double of ROLL's roll.distributed.strategy: strategy.py, fsdp2_strategy.py, factory.py."""
