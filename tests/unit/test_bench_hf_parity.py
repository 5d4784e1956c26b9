"""bench/hf_parity.py's CPU parts: its arguments and the runner's length."""

import pytest
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
