"""What is on disk: the manifest and its digests, the folder layout and run folders, the
commit protocol with owners and holds, components, verification, the trainer state, the
hub's layout of Hugging Face folders. Saving, loading and the tiers all speak it; it knows
none of them.

Layer 2: imports ``runtime`` and the base modules.
"""
