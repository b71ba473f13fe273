"""Test double of ROLL's roll.models: model_providers.py (tokenizer, actor and value models)."""
