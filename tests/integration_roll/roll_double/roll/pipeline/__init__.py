"""Test double of ROLL's roll.pipeline: base_worker.py, base_pipeline.py, and toy_pipeline.py (not in ROLL)."""
