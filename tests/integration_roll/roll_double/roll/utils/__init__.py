"""Test double of ROLL's roll.utils: checkpoint_manager.py, upload_utils.py, worker_state.py."""
