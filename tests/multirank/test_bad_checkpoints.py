"""A bad checkpoint gives every rank a one-line error naming the tensor or file, and nobody hangs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file
from tpgtest.hf_fixtures import make_checkpoint
from tpgtest.spawn import run_ranks
from tpgtest.workers import fail_on_one_rank, load_expecting_error

CASE = "llama2_vocab32003_sharded"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_checkpoint(CASE, tmp_path_factory.mktemp("good"))


@pytest.fixture
def bad(good, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(good, path)
    return path


def shard_files(path):
    return sorted(path.glob("*.safetensors"))


def shard_holding(path, tensor):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def assert_all_ranks_fail(path, *needles, tp=2):
    errors = run_ranks(load_expecting_error, tp, str(path), timeout_s=120)
    for rank, err in enumerate(errors):
        assert err is not None, f"rank {rank} loaded a bad checkpoint"
        kind, message = err
        assert "\n" not in message, message
        for needle in needles:
            assert needle in message, f"rank {rank}: {needle!r} not in {message!r}"
    return errors


@pytest.mark.slow
def test_missing_shard_file(bad):
    victim = shard_files(bad)[1]
    victim.unlink()
    assert_all_ranks_fail(bad, victim.name, "missing")


@pytest.mark.slow
def test_truncated_safetensors(bad):
    victim = shard_files(bad)[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    assert_all_ranks_fail(bad, victim.name, "truncated")


@pytest.mark.slow
def test_wrong_shape(bad):
    name = "model.layers.1.mlp.down_proj.weight"
    file = shard_holding(bad, name)
    tensors = load_file(file)
    tensors[name] = tensors[name][:, :-2].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    assert_all_ranks_fail(bad, name, "(64, 174)", "(64, 176)")


@pytest.mark.slow
def test_missing_tensor(bad):
    name = "model.layers.0.self_attn.k_proj.weight"
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = bad / index["weight_map"].pop(name)
    index_path.write_text(json.dumps(index))
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    assert_all_ranks_fail(bad, name, "missing")


@pytest.mark.slow
def test_error_on_one_rank_reaches_all_ranks():
    results = run_ranks(fail_on_one_rank, 3, 1, timeout_s=120)
    for rank, (error, reduced) in enumerate(results):
        assert error is not None
        assert "on fire" in error[1]
        if rank != 1:
            assert "rank 1" in error[1]
        assert reduced == 3.0  # the group still works afterwards


def test_cli_prints_one_line_error(bad):
    (bad / "config.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "tpgraph.generate", "--model", str(bad), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "config.json" in lines[0], proc.stderr


def test_cli_heads_not_divisible(tmp_path):
    path = make_checkpoint("llama31_kv1_sharded", tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_attention_heads"] == 4
    env_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "-m", "tpgraph.generate",
               "--model", str(path), "--prompt", "x", "--device", "cpu"]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "num_attention_heads (4) is not divisible by the tensor-parallel size (3)" in proc.stderr + proc.stdout
