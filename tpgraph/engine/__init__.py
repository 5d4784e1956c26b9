"""Sequences, KV-cache blocks and the model runner."""
