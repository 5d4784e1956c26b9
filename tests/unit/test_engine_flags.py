"""vLLM's engine flags beyond the core ones, each doing what vLLM's does, or refused where this engine cannot:
--tokenizer and --tokenizer-mode, --max-logprobs, --generation-config and --override-generation-config, the flags
taken at the one value this engine runs (--kv-cache-dtype, --quantization, ...), and hub ids in the hub cache at a
--revision / --tokenizer-revision (--download-dir)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import processors

from tpgraph.engine.cli import engine_kwargs
from tpgraph.engine.tp_engine import TPEngine
from tpgraph.errors import CheckpointError, ConfigError
from tpgraph.serve import parse_args
from tpgraph.tokenizer import builtin_tokenizer

SMALL = dict(device="cpu", max_num_seqs=2, max_model_len=64, num_kv_blocks=20)


def tokenizer_dir(path, template: str = "T:{{ messages[0]['content'] }}"):
    """The built-in byte tokenizer, but adding no BOS, with a template and special tokens of its own."""
    path.mkdir()
    tok = builtin_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<B>"}))
    return path


def test_a_separate_tokenizer_directory_tokenizes_and_renders_chats(tmp_path):
    """vLLM's --tokenizer: the tokenizer, its special tokens and its chat template come from that directory."""
    tok = tokenizer_dir(tmp_path / "tok", "{{ bos_token }}T:{{ messages[0]['content'] }}")
    kwargs = engine_kwargs(parse_args(["--tokenizer", str(tok), "--device", "cpu"]))
    assert kwargs["tokenizer"] == str(tok)
    with TPEngine(**{**SMALL, "tokenizer": kwargs["tokenizer"]}) as engine:
        assert engine.encode("hi") == [104, 105]  # (the built-in tokenizer adds BOS, 256, first)
        assert engine.render_chat([{"role": "user", "content": "x"}]) == "<B>T:x"
    with TPEngine(**SMALL) as engine:
        assert engine.encode("hi") == [256, 104, 105]


def test_a_tokenizer_directory_without_tokenizer_json_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        TPEngine(**SMALL, tokenizer=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        TPEngine(**SMALL, tokenizer=tmp_path / "empty")


@pytest.mark.parametrize("broken,needle", [
    ("tokenizer.json", "cannot read"), ("tokenizer_config.json", "the chat template does not parse")])
def test_a_tokenizer_directory_that_cannot_be_read_is_refused_before_any_rank_starts_or_the_weights_load(
        broken, needle, tmp_path, monkeypatch):
    """--tokenizer's directory was checked for a tokenizer.json alone before loading; one that does not parse (or a
    chat template there that does not) was found only once the weights had loaded, on every rank (-tp N: after the
    ranks it starts had loaded them too)."""
    from tpgraph.engine import followers, tp_engine

    tok = tokenizer_dir(tmp_path / "tok")
    (tok / broken).write_text({"tokenizer.json": "{", "tokenizer_config.json": '{"chat_template": "{% if %}"}'}[broken])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tp_engine, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    monkeypatch.setattr(followers, "start_followers", lambda *a, **k: pytest.fail("a rank was started"))
    for tp_size in (1, 2):
        with pytest.raises(CheckpointError, match=needle):
            TPEngine(**SMALL, tp_size=tp_size, tokenizer=str(tok))


@pytest.mark.parametrize("mode", ["auto", "hf"])
def test_the_fast_tokenizer_modes_are_taken(mode):
    assert parse_args(["--tokenizer-mode", mode]).tokenizer_mode == mode


@pytest.mark.parametrize("mode", ["slow", "mistral", "custom"])
def test_tokenizer_modes_this_engine_cannot_run_are_refused_naming_the_flag(mode, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--tokenizer-mode", mode])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--tokenizer-mode" in err and f"'{mode}' is not supported" in err
    assert "'auto' or 'hf'" in err


def test_max_logprobs_refuses_requests_asking_more_and_takes_those_within():
    """vLLM's --max-logprobs (20 by default): a request asking more alternatives a token, for its output or its
    prompt, is refused (a 400 from the server, whose front end checks the same limits); the engine still warms up."""
    from tpgraph.engine.sampling_params import SamplingParams
    from tpgraph.errors import RequestError

    assert engine_kwargs(parse_args([]))["max_logprobs"] == 20
    kwargs = engine_kwargs(parse_args(["--max-logprobs", "1"]))
    with TPEngine(**{**SMALL, "max_logprobs": kwargs["max_logprobs"]}) as engine:
        engine.warm_up()
        (out,) = engine.generate("ab", SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1))
        assert [sorted(r.rank for r in e.values())[0] for e in out.outputs[0].logprobs] == [1, 1]  # (the top one)
        assert all(len(e) <= 2 for e in out.outputs[0].logprobs) and len(out.prompt_logprobs[1]) <= 2
        for asked in (dict(logprobs=2), dict(prompt_logprobs=5)):
            with pytest.raises(RequestError, match=r"more than the 1 this server returns \(its max_logprobs\)"):
                engine.generate("ab", SamplingParams(max_tokens=2, **asked))
        assert engine.core.limits.max_logprobs == 1  # (the front end's copy of the checks)


@pytest.mark.parametrize("value", ["-1", "21"])
def test_a_max_logprobs_the_sampler_cannot_return_is_refused_when_parsed(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--max-logprobs", value])
    assert "argument --max-logprobs: must be 0 to 20" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_logprobs must be an integer from 0 to 20"):
        TPEngine(**SMALL, max_logprobs=int(value))


def generation_config(path, **values):
    path.mkdir(exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(values))
    return path


def test_generation_config_auto_vllm_or_a_directory_and_overrides(tmp_path):
    """vLLM's --generation-config: auto reads the checkpoint's generation_config.json for request defaults, vllm
    takes none of them (its EOS ids still end a generation), a directory's file is read instead; then
    --override-generation-config sets values over them, or unsets one with null."""
    from tpgraph.chat import GenerationDefaults

    ckpt = generation_config(tmp_path / "ckpt", eos_token_id=7, temperature=0.6, top_k=20, max_new_tokens=64)
    other = generation_config(tmp_path / "other", top_p=0.5)
    assert GenerationDefaults.from_option("auto", ckpt) == GenerationDefaults((7,), {"temperature": 0.6, "top_k": 20},
                                                                              64)
    assert GenerationDefaults.from_option("vllm", ckpt) == GenerationDefaults((7,))
    assert GenerationDefaults.from_option(str(other), ckpt) == GenerationDefaults((), {"top_p": 0.5})
    overridden = GenerationDefaults.from_option("auto", ckpt, {"temperature": 0.5, "top_k": None, "max_new_tokens": 8})
    assert overridden == GenerationDefaults((7,), {"temperature": 0.5}, 8)
    assert GenerationDefaults.from_option("vllm", ckpt, {"min_p": 0.1}) == GenerationDefaults((7,), {"min_p": 0.1})
    assert GenerationDefaults.from_option("auto", None) == GenerationDefaults()  # (the built-in model has none)


def test_generation_config_vllm_neither_reads_nor_checks_the_checkpoints_defaults(tmp_path):
    """--generation-config vllm serves none of generation_config.json's defaults (its EOS ids alone, as vLLM's), so a
    value a request would refuse there (a temperature past 2, vLLM's and now SamplingParams' limit) does not stop the
    engine's start, as it does with auto, which serves it: it refused the checkpoint with vllm too."""
    from tpgraph.chat import GenerationDefaults
    from tpgraph.errors import CheckpointError

    ckpt = generation_config(tmp_path / "ckpt", eos_token_id=7, temperature=3.0)
    assert GenerationDefaults.from_option("vllm", ckpt) == GenerationDefaults((7,))
    with pytest.raises(CheckpointError, match=r"temperature must be in \[0.0, 2.0\], got 3.0"):
        GenerationDefaults.from_option("auto", ckpt)


def test_the_flags_reach_the_engines_defaults(tmp_path):
    other = generation_config(tmp_path / "other", temperature=0.25, max_new_tokens=5)
    args = parse_args(["--generation-config", str(other), "--override-generation-config", '{"top_p": 0.75}'])
    kwargs = engine_kwargs(args)
    assert (kwargs["generation_config"], kwargs["override_generation_config"]) == (str(other), {"top_p": 0.75})
    with TPEngine(**SMALL, generation_config=kwargs["generation_config"],
                  override_generation_config=kwargs["override_generation_config"]) as engine:
        params = engine.default_params()
        assert (params.temperature, params.top_p) == (0.25, 0.75)
        assert engine.prompts.generation_defaults.max_tokens == 5  # (the server's limit where a request sets none)
    assert engine_kwargs(parse_args([]))["generation_config"] == "auto"
    assert engine_kwargs(parse_args([]))["override_generation_config"] == {}


@pytest.mark.parametrize("overrides,needle", [
    ({"presence_penalty": 0.5}, "sets 'presence_penalty', which is not served as a default"),
    ({"do_sample": True}, "sets 'do_sample'"),
    ({"temperature": "hot"}, "temperature must be a number"), ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"temperature": -1}, "--override-generation-config: temperature must be in"),
])
def test_overrides_that_would_not_be_served_are_refused_before_loading(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        TPEngine(**SMALL, override_generation_config=overrides)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_an_override_out_of_range_is_refused_before_any_rank_starts_or_the_weights_load(tp_size, monkeypatch):
    """--override-generation-config's values were checked against SamplingParams only once the weights had loaded
    (and with -tp N, after the ranks it starts had joined and loaded them too): minutes late on a real checkpoint."""
    from tpgraph.engine import followers, tp_engine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tp_engine, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    monkeypatch.setattr(followers, "start_followers", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(ConfigError, match=r"--override-generation-config: top_p must be in \(0.0, 1.0\], got 0"):
        TPEngine(**SMALL, tp_size=tp_size, override_generation_config={"top_p": 0})


def test_a_generation_config_directory_without_the_file_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="neither 'auto'.*nor a directory holding a generation_config.json"):
        TPEngine(**SMALL, generation_config=str(tmp_path))
    with pytest.raises(SystemExit):
        parse_args(["--override-generation-config", "[1]"])
    assert "argument --override-generation-config: must be a JSON object" in capsys.readouterr().err


def test_vllm_flags_at_the_value_this_engine_runs_are_taken():
    """A vLLM command line that spells out what this engine does anyway runs unchanged."""
    args = parse_args(["--kv-cache-dtype", "auto", "--trust-remote-code", "--swap-space", "16",
                       "--max-num-partial-prefills", "1", "--disable-log-stats"])
    assert (args.kv_cache_dtype, args.trust_remote_code, args.max_num_partial_prefills) == ("auto", True, "1")
    assert engine_kwargs(args) == engine_kwargs(parse_args([]))  # (nothing the engine is built with differs)


def test_disable_custom_all_reduce_is_a_flag_that_reaches_the_engine(capsys):
    """vLLM's --disable-custom-all-reduce (every all-reduce through NCCL) was an unknown flag: taken, with vLLM's
    --no- form, and listed in --help."""
    assert engine_kwargs(parse_args([]))["disable_custom_all_reduce"] is False
    assert engine_kwargs(parse_args(["--disable-custom-all-reduce"]))["disable_custom_all_reduce"] is True
    assert engine_kwargs(parse_args(["--no-disable-custom-all-reduce"]))["disable_custom_all_reduce"] is False
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--disable-custom-all-reduce" in capsys.readouterr().out


def test_ranks_the_engine_starts_are_built_with_its_all_reduce_choice(monkeypatch):
    """Every rank must choose the same all-reduce (the custom one's set-up is a collective): the ranks TPEngine starts
    are given the setting with the others."""
    from tpgraph.engine import followers

    class Started(Exception):
        pass

    given = {}

    def start(tp_size, init, kwargs, threads=None, setup=None):
        given.update(kwargs)
        raise Started

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(followers, "start_followers", start)
    with pytest.raises(Started):
        TPEngine(**SMALL, tp_size=2, disable_custom_all_reduce=True)
    assert given["disable_custom_all_reduce"] is True


def test_torchrun_ranks_that_differ_on_the_all_reduce_are_refused_on_every_rank(monkeypatch):
    """Under torchrun each rank reads its own command line: one with --disable-custom-all-reduce beside one without
    would meet the other's custom all-reduce set-up in a different collective (a hang, or garbled exchanges). Every
    rank hears every rank's choice and refuses alike, naming them."""
    from tpgraph import distributed
    from tpgraph.distributed import ParallelState

    state = ParallelState(1, 2, 1, torch.device("cpu"), None, None)
    monkeypatch.setattr(distributed, "gather_objects", lambda state, value: [False, True])
    with pytest.raises(ConfigError, match=r"disable_custom_all_reduce differs between ranks: rank 0 False, "
                                          r"rank 1 True"):
        distributed.check_same_on_every_rank(state, "disable_custom_all_reduce", True)
    monkeypatch.setattr(distributed, "gather_objects", lambda state, value: [True, True])
    distributed.check_same_on_every_rank(state, "disable_custom_all_reduce", True)


@pytest.mark.parametrize("flags,needle", [
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: 'fp8' is not supported: the KV cache is kept in the "
                                  "model's dtype (no fp8 cache); use 'auto' or 'bfloat16' or 'float16' or 'float32'"),
    (["--kv-cache-dtype", "fp8_e5m2"], "'fp8_e5m2' is not supported"),
    (["--quantization", "fp8"], "argument --quantization/-q: 'fp8' is not supported: tpgraph runs unquantized"),
    (["-q", "awq"], "'awq' is not supported"),
    (["--max-num-partial-prefills", "4"], "argument --max-num-partial-prefills: '4' is not supported: prompts are "
                                          "chunked"),
    (["--swap-space", "-1"], "argument --swap-space: must be a number >= 0"),
    # (refused after the imports as "unknown dtype 'int8'; choose one of [...]", naming no flag)
    (["--dtype", "int8"], "argument --dtype: 'int8' is no dtype tpgraph runs in: use 'auto' or one of 'bf16', "
                          "'bfloat16', 'float', 'float16', 'float32', 'fp16', 'fp32', 'half'"),
    (["--dtype", "fp8"], "argument --dtype: 'fp8' is no dtype"),
])
def test_values_this_engine_cannot_honour_are_refused_naming_the_flag(flags, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


MAIN, V1 = "a" * 40, "b" * 40


def hub_cache(root, repo: str = "org/tiny"):
    """A hub cache as huggingface_hub lays it out: two snapshots of `repo`, main and the tag v1."""
    cached = root / f"models--{repo.replace('/', '--')}"
    for ref, commit in (("main", MAIN), ("v1", V1)):
        (cached / "snapshots" / commit).mkdir(parents=True)
        (cached / "refs").mkdir(exist_ok=True)
        (cached / "refs" / ref).write_text(commit)
    return cached


def cached_plain_tokenizer(root, monkeypatch) -> None:
    """The hub cache at `root` (HF_HUB_CACHE) with a repo org/plain whose main snapshot is a tokenizer with no chat
    template."""
    cached = hub_cache(root, "org/plain")
    builtin_tokenizer().save(str(cached / "snapshots" / MAIN / "tokenizer.json"))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))


def test_a_hub_id_is_its_cached_snapshot_at_the_revision_asked(tmp_path, monkeypatch):
    """vLLM's `--model org/name` (with --revision, --download-dir): the snapshot in the hub's cache, a ref's or a
    commit's; nothing is downloaded."""
    cached = hub_cache(tmp_path / "hub")

    def dirs(*flags: str) -> tuple[str | None, str | None]:
        kwargs = engine_kwargs(parse_args(list(flags)))
        return kwargs["model"], kwargs["tokenizer"]

    def at(commit: str) -> str:
        return str(cached / "snapshots" / commit)

    assert dirs("--model", "org/tiny", "--download-dir", str(tmp_path / "hub")) == (at(MAIN), None)
    assert dirs("--model", "org/tiny", "--download-dir", str(tmp_path / "hub"), "--revision", "v1")[0] == at(V1)
    assert dirs("--model", "org/tiny", "--download-dir", str(tmp_path / "hub"), "--revision", V1)[0] == at(V1)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # (the cache huggingface_hub uses, without the flag)
    assert dirs("--model", "org/tiny") == (at(MAIN), None)
    assert dirs("--model", "org/tiny", "--tokenizer-revision", "v1") == (at(MAIN), at(V1))
    assert dirs("--model", "org/tiny", "--tokenizer", "org/tiny", "--tokenizer-revision", V1) == (at(MAIN), at(V1))
    # a snapshot's directory given with the revision it is
    assert dirs("--model", at(V1), "--revision", "v1")[0] == at(V1)


@pytest.mark.parametrize("env,expected", [
    ({"HUGGINGFACE_HUB_CACHE": "/legacy"}, "/legacy"),  # (the legacy name, which huggingface_hub reads)
    ({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HUB_CACHE": "/new"}, "/new"),
    ({"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/home"}, "/legacy"),
    ({"HF_HOME": "/home"}, "/home/hub"),
    ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/huggingface/hub"),
    ({"HF_HUB_CACHE": "$DATA/hub", "DATA": "/data"}, "/data/hub"),  # (huggingface_hub expands variables too)
    ({"HF_HOME": "${DATA}/hf", "DATA": "/data"}, "/data/hf/hub"),
])
def test_the_hub_cache_is_where_huggingface_hub_keeps_snapshots(env, expected, monkeypatch):
    """huggingface_hub's own order (its constants.HF_HUB_CACHE): HF_HUB_CACHE, the legacy HUGGINGFACE_HUB_CACHE,
    HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, each with $VARIABLES expanded. The legacy name and the variables were
    ignored: a hub id cached there was refused as not on disk."""
    from tpgraph.hub import hub_cache

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_cache() == Path(expected)
    assert hub_cache("/flag") == Path("/flag")  # (--download-dir over them all)


def test_a_directory_written_from_home_is_the_directory_the_engine_loads(tmp_path, monkeypatch):
    """`--model=~/ckpt` reaches the program with its ~ (the shell expands none after "="): the hub lookup expanded
    it to find the directory, then passed on "~/ckpt" itself, which the loader refused as a directory that does not
    exist (the tokenizer likewise)."""
    from tpgtest.chat_fixtures import make_chat_checkpoint

    make_chat_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path))
    kwargs = engine_kwargs(parse_args(["--model=~/ckpt", "--tokenizer=~/ckpt", "--load-format", "dummy"]))
    assert (kwargs["model"], kwargs["tokenizer"]) == (str(tmp_path / "ckpt"), str(tmp_path / "ckpt"))
    with TPEngine(**{**kwargs, **SMALL}) as engine:
        assert engine.render_chat([{"role": "user", "content": "x"}]).startswith("<|begin_of_text|>")


@pytest.mark.parametrize("flags,needle", [
    (["--model", "org/tiny", "--revision", "v2"], "holds no snapshot of it at revision 'v2'; tpgraph downloads "
                                                  "nothing: fetch it with `hf download org/tiny "
                                                  "--revision v2`"),
    (["--model", "org/absent"], "holds no snapshot of it at revision 'main'"),
    (["--model", "not a/hub id"], "is not a directory (nor a hub id"),
    (["--model", "SNAPSHOT_MAIN", "--revision", "v1"], "not of revision 'v1'"),
    (["--model", "PLAIN", "--revision", "main"], "is a directory, not a hub snapshot"),
    (["--revision", "main"], "the built-in model has none"),
])
def test_a_checkpoint_or_revision_not_on_disk_is_refused_naming_the_flag(flags, needle, tmp_path, monkeypatch):
    cached = hub_cache(tmp_path / "hub")
    (tmp_path / "plain").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    swap = {"SNAPSHOT_MAIN": str(cached / "snapshots" / MAIN), "PLAIN": str(tmp_path / "plain")}
    with pytest.raises(ConfigError) as refused:
        engine_kwargs(parse_args([swap.get(f, f) for f in flags]))
    assert needle in str(refused.value)
    assert str(refused.value).startswith(("--model", "--revision"))


def test_cpu_ranks_started_and_gone_leave_the_users_torch_threads_as_they_were(monkeypatch):
    """TPEngine(tp_size=N) on CPU sets this process's torch threads to its rank's share of the cores; a start that
    failed (a started rank that died, a Ctrl-C while they join) left the user's process on that share for good."""
    from tpgraph.engine import followers

    def dies(*args, **kwargs):
        raise ConfigError("rank 1 exited before it started (injected)")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(followers, "cpu_threads_per_rank", lambda world_size: 1)  # (whatever this host's cores)
    monkeypatch.setattr(followers, "start_followers", dies)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ConfigError, match="injected"):
            TPEngine(**SMALL, tp_size=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_kv_cache_dtype_naming_a_dtype_is_taken_and_checked_against_the_models(capsys):
    """vLLM's --kv-cache-dtype bfloat16 (or float16) was refused here even where the model runs in it; a dtype's name
    is now taken, and one other than the model's is refused naming the flag (the built-in model: float32 on CPU)."""
    from tpgraph.generate import main

    assert engine_kwargs(parse_args(["--kv-cache-dtype", "bfloat16"]))["kv_cache_dtype"] == "bfloat16"
    assert main(["--prompt", "hi", "--device", "cpu", "--kv-cache-dtype", "float16"]) == 2
    assert "--kv-cache-dtype='float16' is not the model's dtype (float32)" in capsys.readouterr().err


def test_vllms_disable_sliding_window_flag_is_taken():
    """--disable-sliding-window (vLLM's) was an unknown flag: a vLLM command line for Mistral-7B-v0.1 did not parse."""
    assert engine_kwargs(parse_args([]))["disable_sliding_window"] is False
    assert engine_kwargs(parse_args(["--disable-sliding-window"]))["disable_sliding_window"] is True


@pytest.mark.parametrize("flag", ["--model", "--tokenizer"])
def test_a_file_given_for_a_checkpoint_is_refused_as_a_file_naming_what_to_give(flag, tmp_path, monkeypatch):
    """A file where a checkpoint directory goes was refused as "not a directory (nor a hub id ...)" and, where the
    path held a slash and no leading one (models/llama.gguf), taken for a hub id: the message said to `hf download`
    it. A GGUF file (which vLLM loads) is refused as a format tpgraph does not read; a file inside a checkpoint
    (its config.json, tokenizer.json) names its directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llama-q4.gguf").write_bytes(b"GGUF")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "tokenizer.json").write_text("{}")

    def refusal(path: str) -> str:
        with pytest.raises(ConfigError) as refused:
            engine_kwargs(parse_args([flag, path]))
        return str(refused.value)

    for gguf in ("models/llama-q4.gguf", str(tmp_path / "models" / "llama-q4.gguf")):
        message = refusal(gguf)
        assert message.startswith(f"{flag} {gguf!r} is a GGUF file") and "hf download" not in message
        assert "not supported" in message
    for inside in ("ckpt/config.json", str(ckpt / "tokenizer.json")):
        message = refusal(inside)
        assert message.startswith(f"{flag} {inside!r} is a file, not a directory")
        assert f"give its directory, {str(Path(inside).parent)!r}" in message and "hf download" not in message


@pytest.mark.parametrize("model", ["org/tiny", "PLAIN"])
def test_a_tokenizer_revision_of_the_models_tokenizer_refused_names_the_model_not_the_tokenizer_flag(
        model, tmp_path, monkeypatch):
    """`--model M --tokenizer-revision R` (no --tokenizer), R not on disk: the refusal named --tokenizer, a flag the
    command line did not give."""
    hub_cache(tmp_path / "hub")
    (tmp_path / "plain").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = str(tmp_path / "plain") if model == "PLAIN" else model
    with pytest.raises(ConfigError) as refused:
        engine_kwargs(parse_args(["--model", model, "--tokenizer-revision", "v2"]))
    assert str(refused.value).startswith(f"the tokenizer of --model {model!r} is ")
    assert "--tokenizer " not in str(refused.value)
    with pytest.raises(ConfigError, match=r"^the tokenizer of model 'org/tiny' is not a directory"):
        TPEngine("org/tiny", device="cpu", tokenizer_revision="v2")


def test_a_tokenizer_given_as_a_hub_id_is_read_at_the_models_revision_unless_given_its_own(tmp_path, monkeypatch):
    """vLLM's tokenizer_revision defaults to --revision: `--model org/tiny --revision v1 --tokenizer org/tiny` read
    the weights at v1 and the tokenizer at main. A tokenizer directory has no revision to take (vLLM's, as
    transformers', ignores it), so it is read as it is."""
    cached = hub_cache(tmp_path / "hub")
    hub_cache(tmp_path / "hub", "org/tok")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "tok").mkdir()

    def tokenizer(*flags: str) -> str:
        return engine_kwargs(parse_args(["--model", "org/tiny", *flags]))["tokenizer"]

    assert tokenizer("--revision", "v1", "--tokenizer", "org/tiny") == str(cached / "snapshots" / V1)
    assert tokenizer("--revision", "v1", "--tokenizer", "org/tok") == str(
        tmp_path / "hub" / "models--org--tok" / "snapshots" / V1)
    assert tokenizer("--revision", "v1", "--tokenizer", "org/tiny", "--tokenizer-revision", "main") == str(
        cached / "snapshots" / MAIN)
    assert tokenizer("--revision", "v1", "--tokenizer", str(tmp_path / "tok")) == str(tmp_path / "tok")
    (cached / "refs" / "v3").write_text(V1)  # (a tag of the model's that the tokenizer's repo has not)
    with pytest.raises(ConfigError, match=r"^--tokenizer 'org/tok' is not a directory, and the hub cache .* at "
                                          r"revision 'v3'.*--tokenizer-revision defaults to --revision"):
        tokenizer("--revision", "v3", "--tokenizer", "org/tok")


def test_a_tokenizer_path_refused_with_revision_given_says_nothing_of_the_revision(tmp_path, monkeypatch):
    """(The model's revision is a hub-id tokenizer's alone: a tokenizer path refused is refused for what it is.)"""
    hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    for path in (str(tmp_path / "t.gguf"), str(tmp_path / "missing")):
        with pytest.raises(ConfigError) as refused:
            engine_kwargs(parse_args(["--model", "org/tiny", "--revision", "v1", "--tokenizer", path]))
        assert "revision" not in str(refused.value)


def test_a_checkpoint_whose_files_link_to_nothing_is_refused_naming_them(tmp_path, monkeypatch):
    """A hub snapshot copied with `cp -r` (its files are relative links to ../../blobs, copied as links) was refused
    as holding "no config.json", which it lists; its weights, where config.json was a real file, raised a bare
    FileNotFoundError traceback, and a tokenizer.json link to nothing was passed over for the byte tokenizer."""
    from tpgtest.chat_fixtures import make_chat_checkpoint

    hub = tmp_path / "hub" / "models--org--tiny"
    make_chat_checkpoint(hub / "blobs")
    snapshot = hub / "snapshots" / MAIN
    snapshot.mkdir(parents=True)
    for blob in (hub / "blobs").iterdir():
        (snapshot / blob.name).symlink_to(Path("../../blobs") / blob.name)
    copy = tmp_path / "copy"
    copy.mkdir()
    for link in snapshot.iterdir():  # (as `cp -r` copies them: the links themselves, pointing nowhere from here)
        (copy / link.name).symlink_to(link.readlink())
    for flag in ("--model", "--tokenizer"):
        with pytest.raises(ConfigError) as refused:
            engine_kwargs(parse_args([flag, str(copy)]))
        message = str(refused.value)
        assert message.startswith(f"{flag} {str(copy)!r} holds links to files that do not exist: config.json -> "
                                  f"../../blobs/config.json")
        assert "cp -rL" in message
    (copy / "config.json").unlink()
    (copy / "config.json").write_text((hub / "blobs" / "config.json").read_text())
    with pytest.raises(ConfigError, match="generation_config.json -> ../../blobs/generation_config.json"):
        TPEngine(str(copy), **SMALL)
    assert engine_kwargs(parse_args(["--model", str(snapshot)]))["model"] == str(snapshot)  # (links that resolve)


def test_a_chat_refused_for_want_of_a_template_names_the_tokenizer_as_given(tmp_path, monkeypatch):
    """The template is --tokenizer's where one is given: a chat it cannot render was refused as "<--model's
    directory> has no chat template", the directory that holds one; a hub id's as its snapshot's path in the
    server's cache, not the name given."""
    from tpgtest.chat_fixtures import make_chat_checkpoint

    from tpgraph.errors import RequestError

    model = make_chat_checkpoint(tmp_path / "model")  # (its tokenizer_config.json holds a template)
    plain = tmp_path / "plain"
    plain.mkdir()
    builtin_tokenizer().save(str(plain / "tokenizer.json"))  # (a tokenizer with no template)
    chat = [{"role": "user", "content": "x"}]
    with TPEngine(str(model), tokenizer=str(plain), load_format="dummy", **SMALL) as engine:
        with pytest.raises(RequestError, match=rf"^{plain} has no chat template"):
            engine.render_chat(chat)
    cached_plain_tokenizer(tmp_path / "hub", monkeypatch)
    with TPEngine(str(model), tokenizer="org/plain", load_format="dummy", **SMALL) as engine:
        with pytest.raises(RequestError, match="^org/plain has no chat template"):
            engine.render_chat(chat)


def test_a_hub_caches_repo_folder_given_as_the_model_is_refused_naming_the_hub_id_and_a_snapshot(tmp_path):
    """--model ~/.cache/huggingface/hub/models--org--tiny (the repo's folder in the cache, not a snapshot of it)
    was refused as "no config.json in ...: is this a Hugging Face checkpoint?", once the engine read it."""
    cached = hub_cache(tmp_path / "hub")
    for flag in ("--model", "--tokenizer"):
        with pytest.raises(ConfigError) as refused:
            engine_kwargs(parse_args([flag, str(cached)]))
        message = str(refused.value)
        assert message.startswith(f"{flag} {str(cached)!r} is the hub cache's folder of 'org/tiny', not a checkpoint")
        assert f"--download-dir {tmp_path / 'hub'}" in message and str(cached / "snapshots" / MAIN) in message
    with pytest.raises(ConfigError, match=r"^model .* is the hub cache's folder of 'org/tiny', not a checkpoint: give "
                                          r"the hub id 'org/tiny' \(with download_dir='.*hub'\)"):
        TPEngine(str(cached), device="cpu")


@pytest.mark.parametrize("flag", ["--revision", "--tokenizer-revision", "--download-dir"])
def test_an_empty_revision_or_cache_is_refused_not_read_as_the_default(flag, tmp_path, monkeypatch):
    """`--revision "$REV"` with REV unset served main as though no revision were given (and --download-dir "" read
    the working directory as the hub cache), where --model "" is refused as an unset variable."""
    hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=rf"^{flag} is empty \(an unset variable\?\)"):
        engine_kwargs(parse_args(["--model", "org/tiny", flag, " "]))
    keyword = flag.removeprefix("--").replace("-", "_")
    with pytest.raises(ConfigError, match=rf"^{keyword} is empty"):
        TPEngine("org/tiny", device="cpu", **{keyword: ""})


def test_vllms_config_format_is_taken_at_the_format_this_engine_reads():
    """vLLM's --config-format (config_format=) was an unknown flag and keyword, its "auto" and "hf" too, which
    name config.json, the one format read here; Mistral's params.json format is refused saying so."""
    from tpgraph.engine.config import vllm_keywords

    for value in ("auto", "hf"):
        assert engine_kwargs(parse_args(["--config-format", value])) == engine_kwargs(parse_args([]))
        assert vllm_keywords(None, 1, {"config_format": value}) == (None, 1, {})
    with pytest.raises(SystemExit):
        parse_args(["--config-format", "mistral"])
    with pytest.raises(ConfigError, match=r"config_format='mistral' \(vLLM's\) is not taken: config_format takes "
                                          r"'auto' or 'hf'"):
        vllm_keywords(None, 1, {"config_format": "mistral"})


def test_a_chat_refused_for_want_of_a_template_names_the_tokenizers_hub_id_from_the_command_line(tmp_path,
                                                                                                   monkeypatch):
    """`--tokenizer org/plain` on the command line: engine_kwargs resolves it to its snapshot before TPEngine is
    made, so the 400 named the snapshot's path in the server's cache, not the hub id the user typed."""
    from tpgtest.chat_fixtures import make_chat_checkpoint

    from tpgraph.engine.cli import engine_from_args
    from tpgraph.errors import RequestError

    model = make_chat_checkpoint(tmp_path / "model")
    cached_plain_tokenizer(tmp_path / "hub", monkeypatch)
    args = parse_args(["--model", str(model), "--tokenizer", "org/plain", "--load-format", "dummy", "--device", "cpu",
                       "--max-num-seqs", "2", "--max-model-len", "64", "--num-gpu-blocks-override", "20"])
    with engine_from_args(args) as engine:
        with pytest.raises(RequestError, match="^org/plain has no chat template"):
            engine.render_chat([{"role": "user", "content": "x"}])
