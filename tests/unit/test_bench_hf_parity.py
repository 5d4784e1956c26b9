"""bench/hf_parity.py's CPU parts: its arguments and the runner's length."""

import pytest
import torch
from tpgtest.bench_modules import load_bench_module


@pytest.fixture(scope="module")
def parity():
    return load_bench_module("hf_parity")


def test_the_runner_holds_every_step_asked_for(parity):
    prompts = parity.PROMPTS * 2
    assert parity.model_len(prompts, 64) == 256  # the recorded runs' length where it suffices
    longest = max(len(p) for p in prompts)
    assert parity.model_len(prompts, 300) == longest + 300  # (256 refused --steps 300 after the model was loaded)


@pytest.mark.parametrize(("argv", "reason"), [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--layers", "-1"], "--layers must be at least 1"),
    (["--copies", "0"], "--copies must be at least 1"),
    (["--embed-std", "0"], "--embed-std must be positive"),
    (["--out", "no/such/folder/p.json"], "does not exist"),
])
def test_bad_arguments_are_refused_before_any_gpu_work(parity, argv, reason, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        parity.parse_args(argv)
    assert e.value.code == 2 and reason in capsys.readouterr().err


def test_good_arguments(parity, tmp_path):
    args = parity.parse_args(["--steps", "300", "--out", str(tmp_path / "p.json"), "--embed-std", "4.0"])
    assert (args.steps, args.out, args.embed_std) == (300, tmp_path / "p.json", 4.0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_the_other_architectures_checkpoint_loads_as_transformers_names_it(parity, arch, tmp_path, monkeypatch):
    """--arch writes a checkpoint of that architecture (a layer of it here, its vocabulary cut, on CPU) whose config
    the engine reads with the architecture's own features, its biases drawn away from 0 and its head norms from 1."""
    from safetensors import safe_open

    from tpgraph.config import ModelConfig

    monkeypatch.setitem(parity.ARCH_SHAPES, arch, {**parity.ARCH_SHAPES[arch], "vocab_size": 1000})
    parity.make_checkpoint(tmp_path, 0, 1, None, arch)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.qkv_bias, cfg.qk_norm) == ((True, False) if arch == "qwen2" else (False, True))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        if arch == "qwen2":
            assert f.get_tensor("model.layers.0.self_attn.q_proj.bias").abs().max() > 0
        else:  # (transformers' init makes the head norms all 1: a weight left out, or q's and k's swapped, would pass)
            q_norm, k_norm = (f.get_tensor(f"model.layers.0.self_attn.{n}_norm.weight").float() for n in "qk")
            assert (q_norm - 1).abs().max() > 0.05 and (k_norm - 1).abs().max() > 0.05
            assert not torch.equal(q_norm, k_norm)
    assert parity.parse_args(["--arch", arch]).arch == arch
