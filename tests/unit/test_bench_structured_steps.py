"""bench_structured_steps.py end to end on CPU: every mode of every batch gets a step time."""

import json

import pytest
from tpgtest.bench_modules import load_bench_module

pytest.importorskip("xgrammar")


def test_every_mode_is_timed(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "torch_dtype": "float32", "bos_token_id": 256, "eos_token_id": 257}))
    bench = load_bench_module("bench_structured_steps")
    result = bench.main([str(model), "--trials", "1", "--batches", "2", "--tokens", "40", "--device", "cpu",
                         "--out", str(tmp_path / "out.json")])
    modes = {(r["kind"], r["overlap"]) for r in result["summary"]}
    assert modes == {("free", True), ("free", False), ("json", True), ("json", False)}
    assert all(r["median_of_trials_ms"] > 0 for r in result["summary"])
    assert json.loads((tmp_path / "out.json").read_text())["summary"] == result["summary"]
