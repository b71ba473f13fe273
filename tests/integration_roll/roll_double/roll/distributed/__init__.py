"""Test double of ROLL's roll.distributed (see roll/__init__.py)."""
