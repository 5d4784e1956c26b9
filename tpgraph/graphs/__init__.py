"""CUDA-graph decode support: capture ladders, the batch dispatcher, persistent input buffers, graph modes,
metrics and configuration. The runner that captures and replays builds on these."""
