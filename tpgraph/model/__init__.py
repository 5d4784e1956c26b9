"""The hand-written tensor-parallel Llama and its checkpoint loader."""
