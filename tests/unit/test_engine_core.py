"""The engine on CPU with the built-in model: continuous batching, chunked prefill, preemption, stops and sampling
through TPEngine.generate, checked against the plain greedy loop."""

import dataclasses

import pytest

from tpgraph import ConfigError, RequestError, SamplingParams, TPEngine
from tpgraph.comm import TPCommunicator
from tpgraph.distributed import init_distributed
from tpgraph.engine.greedy import greedy_generate
from tpgraph.engine.runner import ModelRunner, RunnerConfig
from tpgraph.engine.sequence import Sequence
from tpgraph.model.loader import load_model

PROMPTS = ["The quick brown fox", "tpgraph", "a" * 30, "Hello, world! How are you today, my friend?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def engine(**kw):
    base = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=64, block_size=4)
    return TPEngine(**{**base, **kw})


@pytest.fixture(scope="module")
def reference():
    """The plain greedy loop's tokens for PROMPTS (whole prompts, one batch)."""
    with engine() as e:
        ids = [e.encode(p) for p in PROMPTS]
    state = init_distributed("cpu")
    model = load_model(state, TPCommunicator(state))
    runner = ModelRunner(model, RunnerConfig(block_size=4, max_batch=4, max_model_len=64))
    return greedy_generate(runner, ids, 12).tokens


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_generate_equals_the_greedy_loop(reference):
    with engine() as e:
        out = e.generate(PROMPTS, GREEDY)
    assert tokens(out) == reference
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12 for o in out)
    assert out[1].prompt == "tpgraph" and out[1].prompt_token_ids[0] == 256
    assert all(0 < o.ttft_s <= o.latency_s for o in out)


def test_preemption_and_queueing_change_nothing(reference):
    # 16 usable blocks of 4 tokens hold one sequence of max_model_len (64) but not all four (151 tokens)
    with engine(num_kv_blocks=17) as e:
        out = e.generate(PROMPTS, GREEDY)
        assert e.core.scheduler.num_preemptions > 0
        assert e.runner.allocator.num_free == e.runner.allocator.num_blocks  # every block came back
    assert tokens(out) == reference


def test_a_cache_smaller_than_max_model_len_is_refused():
    with pytest.raises(ConfigError, match="max_model_len 64 needs that many tokens of KV cache, but only 48 fit"):
        engine(num_kv_blocks=13)


def test_num_kv_blocks_too_few_or_too_many_names_the_flag():
    # the cache was sized by hand: memory flags change nothing, the fix is the setting itself (named as typed: the
    # keyword here, the flag on the command line)
    with pytest.raises(ConfigError, match=r"only 48 fit \(12 blocks of 4; .*raise num_kv_blocks to 17"):
        engine(num_kv_blocks=13)
    # block 0 is the null block: one block leaves none to use (was 'needs at least one block, got 0')
    with pytest.raises(ConfigError, match=r"num_kv_blocks 1 leaves no block to use.*num_kv_blocks 2 or more"):
        engine(num_kv_blocks=1, max_model_len=None)
    # more than the device holds: refused by name, not a raw allocator error
    with pytest.raises(ConfigError, match=r"--num-kv-blocks 1000000000000 .* lower --num-kv-blocks"):
        engine(num_kv_blocks=10 ** 12)


def test_num_kv_blocks_that_cannot_serve_is_refused_before_the_weights_load(monkeypatch):
    """num_kv_blocks 1 (the null block alone) or too few blocks for one sequence of an asked max_model_len were
    refused by the runner, once every rank had loaded the weights (minutes for a large checkpoint)."""
    from tpgraph.engine import tp_engine
    from tpgraph.engine.cli import engine_from_args
    from tpgraph.engine.config import EngineConfig
    from tpgraph.serve import parse_args

    monkeypatch.setattr(tp_engine, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(ConfigError, match=r"num_kv_blocks 1 leaves no block to use"):
        EngineConfig(num_kv_blocks=1)
    with pytest.raises(ConfigError, match=r"max_model_len 64 needs .* only 48 fit .*raise num_kv_blocks to 17"):
        EngineConfig(num_kv_blocks=13, max_model_len=64, block_size=4)
    EngineConfig(num_kv_blocks=17, max_model_len=64, block_size=4)
    EngineConfig(num_kv_blocks=2)  # (the model's own max_model_len is capped to the cache instead)
    with pytest.raises(ConfigError, match=r"only 48 fit"):
        engine(num_kv_blocks=13)
    # the command line names its flags
    args = parse_args(["--device", "cpu", "--num-gpu-blocks-override", "13", "--max-model-len", "64", "--block-size",
                       "4"])
    with pytest.raises(ConfigError, match=r"^--max-model-len 64 needs .*lower --max-model-len, or raise "
                                          r"--num-kv-blocks/--num-gpu-blocks-override to 17"):
        engine_from_args(args)


def test_vllms_kv_cache_memory_bytes_sizes_the_cache():
    """vLLM's kv_cache_memory_bytes (--kv-cache-memory-bytes): the cache's bytes, in place of what
    gpu_memory_utilization leaves. It was refused as an unknown keyword and an unrecognized flag."""
    from tpgraph.engine.cli import engine_kwargs
    from tpgraph.serve import parse_args

    with engine(num_kv_blocks=None) as e:
        block = e.runner.block_bytes
    with engine(num_kv_blocks=None, kv_cache_memory_bytes=20 * block + block // 2) as e:
        assert e.runner.num_kv_blocks == 20  # (the null block among them)
        assert e.generate("Hi", GREEDY)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ConfigError, match=rf"kv_cache_memory_bytes {10 * block} holds 10 KV blocks .* needs at least "
                                          rf"17 .*raise kv_cache_memory_bytes to {17 * block}, or lower max_model_len"):
        engine(num_kv_blocks=None, kv_cache_memory_bytes=10 * block)
    with pytest.raises(ConfigError, match="both size the KV cache: give one of them"):
        engine(num_kv_blocks=20, kv_cache_memory_bytes=20 * block)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be a positive integer"):
        engine(num_kv_blocks=None, kv_cache_memory_bytes=0)
    for flag in ("--kv-cache-memory-bytes", "--kv-cache-memory"):
        assert engine_kwargs(parse_args([flag, "8G"]))["kv_cache_memory_bytes"] == 8 << 30
    assert engine_kwargs(parse_args([]))["kv_cache_memory_bytes"] is None


def test_a_cpu_cache_too_large_for_memory_names_the_flags_that_size_it(monkeypatch):
    """On CPU the cache is sized for every sequence at max_model_len, not from free memory: one past the host's memory
    was an allocator traceback, or (its pages taken lazily) the OOM killer once serving wrote them."""
    monkeypatch.setattr("tpgraph.engine.runner.host_memory_bytes", lambda: 4096)
    with pytest.raises(ConfigError, match=r"--max-num-seqs 4 sequences of --max-model-len 64 tokens: the KV cache, "
                                          r".* GiB, more than this host's 0.0 GiB \(or its container's limit\): lower "
                                          r"either, or pass --num-kv-blocks"):
        engine(num_kv_blocks=None)


def test_a_cpu_cache_sized_by_hand_past_the_hosts_memory_is_refused(monkeypatch):
    """A cache sized by hand (--num-kv-blocks, --kv-cache-memory-bytes) skipped the host-memory check the default size
    meets: one past the host's memory but within its address space was zeroed page by page into the OOM killer."""
    with engine() as e:
        need = 64 * e.runner.block_bytes
    monkeypatch.setattr("tpgraph.engine.runner.host_memory_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match=r"on CPU --num-kv-blocks 64 asks for the KV cache, .* GiB, more than this "
                                          r"host's .* GiB \(or its container's limit\): lower --num-kv-blocks"):
        engine(num_kv_blocks=64)
    with pytest.raises(ConfigError, match=rf"on CPU --kv-cache-memory-bytes {need} asks for .*: lower "
                                          r"--kv-cache-memory-bytes"):
        engine(num_kv_blocks=None, kv_cache_memory_bytes=need)
    monkeypatch.setattr("tpgraph.engine.runner.host_memory_bytes", lambda: need)
    with engine(num_kv_blocks=64):
        pass


def test_the_cpu_caches_of_every_rank_on_the_host_must_fit_its_memory(monkeypatch):
    """Ranks on one host (torchrun's, or those TPEngine(tp_size=N) starts) each take their shard of the cache from
    the same memory: the check compared one rank's shard with the whole host. Here two ranks' caches outgrow a host
    that holds one (the gather stands in for a second rank on this host)."""
    from tpgraph.engine import runner

    with engine(num_kv_blocks=None) as e:
        one = (e.runner.max_blocks_per_seq * e.runner.cfg.max_batch + 1) * e.runner.block_bytes
    monkeypatch.setattr(runner, "host_memory_bytes", lambda: int(1.5 * one))
    with engine(num_kv_blocks=None):  # (one rank: it fits)
        pass
    real = runner.gather_objects
    monkeypatch.setattr(runner, "gather_objects", lambda state, obj: [obj, obj] if isinstance(obj, str) else
                        real(state, obj))
    with pytest.raises(ConfigError, match=r"tokens: this host's 2 ranks' caches, .* GiB, more than this host's"):
        engine(num_kv_blocks=None)


def test_host_memory_is_a_containers_cgroup_limit_where_one_is_set(tmp_path):
    """In a container the OOM killer acts at the cgroup's limit, not at the host's memory: the CPU cache's check read
    the host's alone. cgroup v2 writes "max" for no limit; a missing file is no limit."""
    from tpgraph.engine.memory import host_memory_bytes

    physical = host_memory_bytes(limit_files=())
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{2 << 30}\n")
    assert host_memory_bytes((v2, v1)) == min(physical, 2 << 30)  # (v2 unlimited: v1's limit read next)
    v2.write_text(f"{1 << 30}\n")
    assert host_memory_bytes((v2, v1)) == min(physical, 1 << 30)
    assert host_memory_bytes((tmp_path / "absent",)) == physical
    v1.write_text(f"{physical * 4}\n")  # (v1's "no limit" is a number past the host's memory)
    assert host_memory_bytes((v1,)) == physical


def test_chunked_prefill_and_one_sequence_at_a_time(reference):
    with engine(max_num_seqs=1) as e:
        assert tokens(e.generate(PROMPTS, GREEDY)) == reference
    with engine(max_model_len=48, max_num_batched_tokens=48) as e:  # 4 prompts of 5-44 tokens share 48 a step
        out = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
        chunks = [row for row in e.runner.stats.frequency_table() if row[0] == "prefill"]
    assert tokens(out) == [t[:4] for t in reference]
    assert len(chunks) >= 2


def test_without_chunked_prefill_the_default_budget_holds_a_whole_prompt_past_8192(tmp_path):
    """The default max_num_batched_tokens (at most 8192) could not hold a prompt of a longer max_model_len, so an
    engine with chunked prefill off and no budget given was refused after loading. vLLM's default is then
    max(max_model_len, 2048): here the budget holds one whole prompt of max_model_len."""
    import json

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 9000, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with TPEngine(str(tmp_path), device="cpu", load_format="dummy", max_num_seqs=1, enable_chunked_prefill=False,
                  num_kv_blocks=600) as e:
        assert e.core.scheduler.cfg.max_num_batched_tokens == e.runner.max_model_len == 9000
        out = e.generate([[7] * 8999], SamplingParams(temperature=0.0, max_tokens=1))
        assert out[0].outputs[0].finish_reason == "length"


def test_stop_strings_cut_the_text(reference):
    assert reference[2][:12] == [97] * 12  # the built-in model answers "a" * 30 with more "a"s
    with engine() as e:
        full = e.generate(PROMPTS[2], GREEDY)[0].outputs[0]
        cut = e.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop=["aaa"]))[0].outputs[0]
        kept = e.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop="aaa",
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert full.text == "a" * 12
    assert (cut.text, cut.token_ids, cut.finish_reason) == ("", [97] * 3, "stop")
    assert (kept.text, kept.finish_reason) == ("aaa", "stop")


def test_stop_token_ids_min_tokens_and_eos(reference):
    first = reference[0][0]
    with engine() as e:
        one = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, stop_token_ids=[first]))[0].outputs[0]
        assert (one.token_ids, one.finish_reason) == ([first], "stop")
        later = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, stop_token_ids=[first], min_tokens=3,
                                                      max_tokens=5))[0].outputs[0]
        assert first not in later.token_ids[:3] and len(later.token_ids) >= 3


def test_min_tokens_holds_the_eos_back_under_ignore_eos_too():
    """vLLM's min_tokens bans all_stop_token_ids, which hold every EOS id whether or not ignore_eos is set: the first
    min_tokens tokens are never an EOS. With ignore_eos they were not banned here, and an EOS the logits favoured came
    first (ignored, but sampled where vLLM samples another token)."""
    with engine() as e:
        eos = e.core.eos_ids[0]
        params = SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=3, max_tokens=5, logit_bias={eos: 100})
        out = e.generate(PROMPTS[0], params)[0].outputs[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos, eos] and out.finish_reason == "length"


def test_the_tokenizers_eos_ends_a_sample_with_no_stop_reason_and_the_others_with_their_id(tmp_path):
    """vLLM's model EOS is the tokenizer's (<|eot_id|> here): a sample ending on it has stop_reason None, and it ends
    a generation though config.json names another. generation_config's other EOS ids are read as stop token ids: a
    sample ending on one (Llama-3.1's <|eom_id|> beside <|eot_id|>) has that id as stop_reason. Every EOS id gave None,
    and the tokenizer's EOS ended nothing unless the configs listed it."""
    import json

    from tpgtest.chat_fixtures import EOS_ID, EOT_ID, make_chat_checkpoint

    path = make_chat_checkpoint(tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 97]}))  # (not <|eot_id|>)
    forced = {token: SamplingParams(temperature=0.0, max_tokens=4, logit_bias={token: 100})
              for token in (EOT_ID, EOS_ID, 97)}
    with TPEngine(path, device="cpu", load_format="dummy", max_num_seqs=2, max_model_len=64, block_size=4) as e:
        assert e.core.main_eos == EOT_ID and set(e.core.eos_ids) == {EOT_ID, EOS_ID, 97}
        outs = {token: e.generate(["hi"], p)[0].outputs[0] for token, p in forced.items()}
    assert {t: (o.token_ids, o.finish_reason, o.stop_reason) for t, o in outs.items()} == {
        EOT_ID: ([EOT_ID], "stop", None), EOS_ID: ([EOS_ID], "stop", EOS_ID), 97: ([97], "stop", 97)}


def test_config_jsons_eos_ends_a_generation_only_without_a_generation_config(tmp_path):
    """vLLM's EOS ids beside the tokenizer's are generation_config.json's; config.json's stand in only where there is
    no such file (try_get_generation_config falls back to GenerationConfig.from_model_config). config.json's EOS id
    (<|end_of_text|> here), named by neither the tokenizer nor generation_config.json, ended a sample here."""
    import json

    from tpgtest.chat_fixtures import EOS_ID, EOT_ID, make_chat_checkpoint

    path = make_chat_checkpoint(tmp_path / "ckpt")  # (config.json's eos_token_id: EOS_ID; the tokenizer's: EOT_ID)
    forced = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={EOS_ID: 100})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOT_ID, 97]}))
    with TPEngine(path, device="cpu", load_format="dummy", max_num_seqs=2, max_model_len=64, block_size=4) as e:
        assert e.core.eos_ids == (EOT_ID, 97)
        out = e.generate(["hi"], forced)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([EOS_ID] * 3, "length")
    (path / "generation_config.json").unlink()
    with TPEngine(path, device="cpu", load_format="dummy", max_num_seqs=2, max_model_len=64, block_size=4) as e:
        assert e.core.eos_ids == (EOT_ID, EOS_ID)
        out = e.generate(["hi"], forced)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([EOS_ID], "stop", EOS_ID)


def test_stop_strings_wait_for_min_tokens(reference):
    """As in vLLM: a stop string ends a sequence only from its (min_tokens + 1)-th token on; the ones before stay in
    the text. (PROMPTS[2] makes the built-in model say "aaaa...", a token a character.)"""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, stop=["a"])
    with engine() as e:
        at_once = e.generate(PROMPTS[2], greedy)[0].outputs[0]
        later = e.generate(PROMPTS[2], dataclasses.replace(greedy, min_tokens=4))[0].outputs[0]
    assert reference[2][:5] == [ord("a")] * 5
    assert (at_once.token_ids, at_once.text, at_once.finish_reason) == (reference[2][:1], "", "stop")
    assert (later.token_ids, later.text, later.finish_reason) == (reference[2][:5], "aaaa", "stop")


def test_a_tiny_temperature_is_raised_and_draws_no_nan(reference):
    """Logits over a temperature of 1e-40 overflow fp32; vLLM's floor raises it to 0.01, at which this model's tokens
    are its greedy ones."""
    with engine() as e:
        out = e.generate(PROMPTS, SamplingParams(temperature=1e-40, max_tokens=12))
    assert tokens(out) == reference


def test_seeded_samples_repeat_and_n_gives_n():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, n=3, max_tokens=8, logprobs=2)
    unseeded = SamplingParams(temperature=1.0, max_tokens=8)
    with engine() as e:
        a = e.generate(PROMPTS[:2], params)
        # again, beside unseeded requests that draw from (and advance) the shared generator
        b = e.generate(PROMPTS[:3], [unseeded, params, params])[1:]
        c = e.generate(PROMPTS[:2], unseeded)
        d = e.generate(PROMPTS[:2], unseeded)
    assert [x.token_ids for x in a[1].outputs] == [x.token_ids for x in b[0].outputs]  # PROMPTS[1], seeded
    assert tokens(c) != tokens(d)  # unseeded draws move on
    assert len(a[0].outputs) == 3 and len({tuple(x.token_ids) for x in a[0].outputs}) > 1
    c0 = a[0].outputs[0]
    assert len(c0.logprobs) == len(c0.token_ids)
    assert all(len(entry) in (2, 3) and entry[t].logprob <= 0
               for entry, t in zip(c0.logprobs, c0.token_ids, strict=True))


def test_the_service_delivers_every_samples_last_update():
    """The loop the server drives (EngineService): with n > 1 the samples finish in the same step, and each one's
    final update reaches the request's sink, not only the first (the sink used to be forgotten after it)."""
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, ignore_eos=True)
    with engine() as e:
        service = EngineService(e.core, ControlPlane(e.state))
        got = []
        service.enqueue("r", e.encode(PROMPTS[0]), params, got.append)
        while e.core.has_work or service.pending:
            service.turn()
    finished = {u.sample_index: u.finish_reason for u in got if u.finish_reason is not None}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert [sum(1 for u in got if u.sample_index == i and u.token_id is not None) for i in range(3)] == [4, 4, 4]
    assert not service._sinks


def test_a_bad_prompt_of_a_batch_is_named_by_its_index_and_the_others_still_run():
    """A refusal said "the prompt is empty" or "prompt token ids must be integers in [0, 258)" alone: which of a batch
    of thousands, and which id, was the user's to find. Each now names the prompt (or conversation) by its index and
    the id by its value and position, wherever it is refused (read, encoded, checked or added); a single prompt's
    refusal reads as before, and nothing stays queued behind one."""
    from tpgraph.engine.structured import StructuredOutput

    regex = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[0-9"))
    with engine() as e:
        for prompts, params, named in [
            ([[1, 2], [1, 10 ** 6]], GREEDY, r"prompt 1 was refused: prompt token ids must be integers in \[0, 258\), "
                                             r"got 1000000 at position 1"),
            (["a", "b", "x" * 80], GREEDY, "prompt 2 was refused: the prompt has 81 tokens"),
            (["a", [1, 2.5]], GREEDY, r"prompt 1 was refused: token ids must be integers, got 2.5"),
            (["a", "b"], [GREEDY, regex], "prompt 1 was refused: the regex cannot be used"),  # (refused when added)
        ]:
            with pytest.raises(RequestError, match=named):
                e.generate(prompts, params, use_tqdm=False)
            assert not e.core.has_work and not e.core.requests
        with pytest.raises(RequestError, match="conversation 1 was refused: .*an empty conversation"):
            e.chat([[{"role": "user", "content": "hi"}], []], GREEDY, use_tqdm=False)
        alone = r"^prompt token ids must be integers in \[0, 258\), got -1 at position 0$"  # (one prompt: as before)
        with pytest.raises(RequestError, match=alone):
            e.generate([[-1]], GREEDY, use_tqdm=False)
        assert len(e.generate(["a", "b"], GREEDY, use_tqdm=False)) == 2


@pytest.mark.parametrize("loop", ["alone", "service"])
def test_a_single_prompt_refused_when_added_reads_as_before_on_every_path(loop):
    """A refusal met when the request is added (a regex that does not compile) named "prompt 0" even for a single
    prompt, on the path every rank runs alone or under torchrun, and on the started ranks' service path; a refusal
    met when checked read as before, as it does with one prompt everywhere. Every path now names the prompt only
    where the call had several."""
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService
    from tpgraph.engine.structured import StructuredOutput

    regex = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[0-9"))
    with engine() as e:
        if loop == "service":  # (the loop rank 0 drives where TPEngine started the other ranks)
            e.service = EngineService(e.core, ControlPlane(e.state))
        with pytest.raises(RequestError, match=r"^the regex cannot be used"):
            e.generate(["a"], regex, use_tqdm=False)
        with pytest.raises(RequestError, match=r"^prompt 1 was refused: the regex cannot be used"):
            e.generate(["a", "b"], [GREEDY, regex], use_tqdm=False)
        assert not e.core.has_work and not e.core.requests
        assert len(e.generate(["a", "b"], GREEDY, use_tqdm=False)) == 2


def test_a_closed_engine_lets_go_of_its_weights_refuses_work_and_closes_again_harmlessly():
    """close() (or leaving its with block) released the KV cache and the graphs, but the weights stayed held for as
    long as the engine object lived: `llm`, still bound after `with TPEngine(...) as llm`, kept them, and the next
    engine in the process found that memory in use. They go at close now; work after it is refused, naming why."""
    import gc
    import weakref

    from tpgraph.engine.beam_search import BeamSearchParams

    with engine() as e:
        weights = [weakref.ref(p) for p in e.model.parameters()]
        assert e.generate("a", GREEDY, use_tqdm=False)[0].outputs[0].finished()
    gc.collect()
    assert [w for w in weights if w() is not None] == []  # (e is still bound here)
    e.close()  # a second close changes nothing
    for work in (lambda: e.generate("a", GREEDY), lambda: e.chat([{"role": "user", "content": "hi"}], GREEDY),
                 lambda: e.beam_search(["a"], BeamSearchParams(beam_width=2, max_tokens=2)), e.warm_up,
                 e.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="this TPEngine is closed; start a new one"):
            work()
    assert e.get_tokenizer().decode(e.get_tokenizer().encode("hi", add_special_tokens=False)) == "hi"


def test_bad_requests_are_refused_and_the_engine_keeps_working(reference):
    with engine() as e:
        with pytest.raises(RequestError, match="the prompt is empty"):
            e.generate([[]], GREEDY)
        with pytest.raises(RequestError, match="max_model_len is 64"):
            e.generate("x" * 80, GREEDY)
        with pytest.raises(RequestError, match="prompt token ids must be integers in"):
            e.generate([[1, 10 ** 6]], GREEDY)
        with pytest.raises(RequestError, match="2 SamplingParams for 1 prompts"):
            e.generate(["a"], [GREEDY, GREEDY])
        assert len(e.generate(["a", "b"], (GREEDY, GREEDY))) == 2  # (a tuple of them, as a list)
        # (stop ids index the logits while min_tokens bans them: one past the vocabulary used to fail the step,
        # and with it every request in flight)
        with pytest.raises(RequestError, match="stop_token_ids must be below the vocabulary size"):
            e.generate("a", SamplingParams(stop_token_ids=[10 ** 6], min_tokens=2, max_tokens=4))
        assert not e.core.has_work and e.runner.allocator.num_free == e.runner.allocator.num_blocks
        assert tokens(e.generate(PROMPTS, GREEDY)) == reference


def test_mistyped_params_and_prompts_are_refused_with_a_reason(reference):
    """A truthy non-bool flag used to pass SamplingParams and then fail while the request was being queued."""
    import numpy as np
    import torch

    for kw, needle in [({"skip_special_tokens": 0}, "skip_special_tokens must be true or false"),
                       ({"ignore_eos": "no"}, "ignore_eos must be true or false"),
                       ({"stop": 123}, "stop must be a string or a list of strings"),
                       ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids")]:
        with pytest.raises(RequestError, match=needle):
            SamplingParams(**kw)
    with engine() as e:
        for prompts, needle in [(None, "prompts must be a prompt"), (5, "prompts must be a prompt"),
                                ([[256, 1.5]], r"token ids must be integers, got 1.5 \(float\) at position 1"),
                                ([[256, True]], "token ids must be integers, got True")]:
            with pytest.raises(RequestError, match=needle):
                e.generate(prompts, GREEDY)
        ids = e.encode(PROMPTS[0])
        # token ids as a tuple, a numpy array or a tensor are the same prompt as the list
        for prompt in (tuple(ids), np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids]):
            assert tokens(e.generate(prompt, GREEDY)) == reference[:1]
        assert tokens(e.generate([np.array(ids), tuple(ids)], GREEDY)) == reference[:1] * 2
        # ... and any other iterable of prompts is a list of them, a 1-D array of texts among them
        assert len(e.generate(np.array(PROMPTS[:2]), GREEDY)) == 2 and len(e.generate({"a": 1}.keys(), GREEDY)) == 1
    with pytest.raises(RuntimeError, match="closed"):
        e.generate(PROMPTS[0], GREEDY)


def test_sampling_params_of_another_type_are_refused_saying_what_generate_takes():
    """A dict (or any other object) where a SamplingParams belongs failed with an AttributeError from inside
    generate ('dict' object has no attribute 'truncate_prompt_tokens'), not the refusal that names the type."""
    with engine() as e:
        for params in ({"temperature": 0.0}, [{"temperature": 0.0}], "greedy"):
            with pytest.raises(RequestError, match="sampling parameters must be a SamplingParams, got (dict|str)"):
                e.generate(["a"], params)
        with pytest.raises(RequestError, match="sampling parameters must be a SamplingParams, got dict"):
            e.chat([{"role": "user", "content": "hi"}], {"max_tokens": 2})
        assert not e.core.has_work


def test_generate_from_two_threads_at_once_gives_each_its_own_outputs():
    """Two threads' generate loops both stepped the core and read each other's updates: one failed with a KeyError,
    the other lost the tokens the first had taken. Calls now run one after the other."""
    import threading

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with engine() as e:
        alone = tokens(e.generate(PROMPTS[:2], params))
        results, start = {}, threading.Barrier(2)

        def call(k: int) -> None:
            start.wait()
            try:
                results[k] = tokens(e.generate(PROMPTS[:2], params))
            except Exception as exc:  # (reported in the assertion below)
                results[k] = exc

        threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {0: alone, 1: alone}


def test_whether_the_decoder_is_byte_fallback_is_read_once_per_tokenizer_not_per_sample(monkeypatch):
    """Every detokenizer serialized the tokenizer's decoder to JSON (its __getstate__) to find whether it is a
    byte-fallback one: once per request and sample, on the engine's path that builds each request. The tokenizer's
    answer is worked out once."""
    import tokenizers.decoders

    real = tokenizers.decoders.Decoder.__getstate__
    calls = []

    def counting(decoder):
        calls.append(type(decoder).__name__)
        return real(decoder)

    with engine() as e:
        monkeypatch.setattr(tokenizers.decoders.Decoder, "__getstate__", counting)
        for _ in range(3):
            out = e.generate(PROMPTS, SamplingParams(temperature=1.0, seed=0, max_tokens=2, n=2))
            assert all(len(o.outputs) == 2 and o.outputs[0].text is not None for o in out)
    assert len(calls) <= 1, calls


def test_a_request_that_fails_while_queued_is_taken_back_whole(reference, monkeypatch):
    """Whatever raises while a request is being added leaves none of its sequences queued: one left queued without
    its state broke every later step (KeyError, then 'pending tokens but token source -1')."""
    from tpgraph.engine import core as core_module
    from tpgraph.engine.control import ControlPlane
    from tpgraph.engine.service import EngineService

    real = core_module.Detokenizer

    def failing(tokenizer, prompt_ids, params, *rest):
        if params.max_tokens == 7:
            raise TypeError("a detokenizer that cannot be built")
        return real(tokenizer, prompt_ids, params, *rest)

    monkeypatch.setattr(core_module, "Detokenizer", failing)
    bad = SamplingParams(temperature=1.0, seed=1, max_tokens=7, n=2)  # (n > 1 samples: greedy takes one)
    with engine() as e:
        with pytest.raises(TypeError, match="cannot be built"):
            e.generate(PROMPTS[0], bad)
        assert not e.core.has_work and not e.core.requests
        assert tokens(e.generate(PROMPTS, GREEDY)) == reference
        # the loop the server (and every follower rank) drives answers it with an error and serves on
        service = EngineService(e.core, ControlPlane(e.state))
        got = []
        service.enqueue("bad", e.encode(PROMPTS[0]), bad, got.append)
        service.enqueue("good", e.encode(PROMPTS[0]), GREEDY, got.append)
        while e.core.has_work or service.pending:
            service.turn()
        assert [(u.request_id, u.finish_reason) for u in got if u.finish_reason] == [("bad", "error"),
                                                                                      ("good", "length")]
        assert [u.token_id for u in got if u.request_id == "good"] == reference[0]


def test_stop_token_text_is_kept_with_include_stop_str_in_output(reference):
    first = reference[0][0]
    with engine() as e:
        for include, text in [(False, ""), (True, e.tokenizer.decode([first]))]:
            out = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, stop_token_ids=[first],
                                                        include_stop_str_in_output=include))[0].outputs[0]
            assert (out.token_ids, out.text, out.finish_reason) == ([first], text, "stop")


def test_a_stop_string_in_a_kept_stop_tokens_text_names_the_stop_and_cuts_it(reference):
    """vLLM checks stop strings in the text a stop token adds where include_stop_str_in_output keeps it: a stop string
    found there is the stop_reason (and the text ends with it). The stop token's id was the stop_reason, and an EOS's
    text was kept whole past the stop string."""
    assert reference[2][0] == 97
    with engine() as e:
        eos = e.core.eos_ids[0]
        by_token = e.generate(PROMPTS[2], SamplingParams(temperature=0.0, stop_token_ids=[97], stop=["a"],
                                                         include_stop_str_in_output=True))[0].outputs[0]
        by_eos = e.generate(PROMPTS[0], SamplingParams(allowed_token_ids=[eos], stop=["<|end"],
                                                       skip_special_tokens=False,
                                                       include_stop_str_in_output=True))[0].outputs[0]
    assert (by_token.token_ids, by_token.text, by_token.finish_reason, by_token.stop_reason) == ([97], "a", "stop", "a")
    assert e.tokenizer.decode([eos], skip_special_tokens=False) == "<|end_of_text|>"
    assert (by_eos.token_ids, by_eos.text, by_eos.stop_reason) == ([eos], "<|end", "<|end")


def test_warm_up_fits_a_tiny_context():
    with engine(max_model_len=3, num_kv_blocks=8) as e:
        assert e.warm_up() > 0


def test_a_tp_size_the_model_cannot_split_over_is_refused_before_any_rank_starts(monkeypatch):
    from tpgraph.engine import followers

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(followers, "start_followers", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(8\) is not divisible by the tensor-parallel size"):
        TPEngine(tp_size=3, device="cpu")


def test_a_max_model_len_past_the_models_positions_is_refused_before_any_rank_starts(monkeypatch):
    """It was refused by the runner, after every rank had started and loaded the weights (minutes, for a large
    checkpoint); vLLM refuses it with the model's config, before loading anything."""
    from tpgraph.engine import followers, tp_engine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(followers, "start_followers", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.setattr(tp_engine, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    for tp in (1, 2):
        with pytest.raises(ConfigError, match=r"max_model_len 5000 exceeds the model's max_position_embeddings "
                                              r"\(4096\)"):
            TPEngine(tp_size=tp, device="cpu", max_model_len=5000)


def test_tp_size_must_match_torchruns_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun --nproc-per-node 1
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="tp_size=2 but 1 ranks were launched"):
        TPEngine(tp_size=2, device="cpu")


def test_closing_a_one_rank_engine_releases_the_process_group_it_made(tmp_path):
    """A world of one joined through a process group (an init method given, or MASTER_ADDR set, as under torchrun
    --nproc-per-node 1). Before: close() released process groups only of two ranks or more, so this one outlived the
    engine, and the next TPEngine(tp_size=2) in the process refused to start ("already holds a process group")."""
    import torch.distributed as dist

    try:
        with engine(dist_init=(0, 1, f"file://{tmp_path}/init")) as e:
            assert dist.is_initialized()
            assert tokens(e.generate(PROMPTS[:1], GREEDY))[0]
        assert not dist.is_initialized()
    finally:  # (what a failure left must not reach the next test)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_recomputed_sequence_gets_its_new_block_table_row():
    """Preemption gives a sequence's blocks back without the runner (the scheduler frees them): when it is recomputed
    into as many new blocks, its decode row must carry the new block ids, not the ones cached for that row."""
    with engine() as e:
        runner, alloc = e.runner, e.runner.allocator
        seq = Sequence(0, [5, 6, 7, 8, 9], 8)
        runner.prefill([seq], [4])
        runner.decode([seq])
        old = list(seq.block_table)
        alloc.free(seq.block_table)  # what Scheduler._preempt does
        seq.block_table, seq.num_cached = [], 0
        seq.num_preemptions += 1
        held = alloc.allocate(len(old))  # so the recompute gets other blocks
        runner.prefill([seq], [4])
        runner.decode([seq])
        assert seq.block_table != old and len(seq.block_table) == len(old)
        assert runner.decode_in.host_np("block_tables")[0, :len(old)].tolist() == seq.block_table
        alloc.free(held)
        runner.free(seq)


def test_warm_up_samples_each_kind_of_row_alone_at_each_triton_row_count(monkeypatch):
    """Triton compiles an integer argument equal to 1, one divisible by 16 and any other apart: the warm-up samples
    batches of 1, 3 and 16 rows of one kind each (greedy, sampled, penalized greedy (fp32 logits into the argmax),
    sampled with top-k (its own kernels), penalized with top-k), so a first burst compiles none of them. (A biased
    row's fp32 logits take the penalized rows' launches.)"""
    from tpgraph.engine.sampler import Sampler

    seen = set()
    original = Sampler.sample_async

    def kind(p):
        penalized = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) != (1.0, 0.0, 0.0)
        return p.greedy, penalized, p.top_k > 0

    def spy(self, logits, rows, ids_out=None):
        kinds = {kind(r.params) for r in rows}
        if len(kinds) == 1:
            seen.add((kinds.pop(), len(rows)))
        return original(self, logits, rows, ids_out)

    monkeypatch.setattr(Sampler, "sample_async", spy)
    with engine(max_num_seqs=16, num_kv_blocks=128, max_num_batched_tokens=256) as e:  # 16 prompts in one step
        e.warm_up()
    kinds = [(True, False, False), (False, False, False), (True, True, False), (False, False, True),
             (False, True, True)]
    assert {(k, n) for k in kinds for n in (1, 3, 16)} <= seen


def test_the_engine_thread_runs_on_the_engines_device(monkeypatch):
    """A new thread starts on CUDA device 0; the loop's thread must switch to the device the model is on (Triton
    launches on the current device), here a pretend cuda:1."""
    from types import SimpleNamespace

    import torch

    from tpgraph.engine.service import EngineService

    switched = []
    monkeypatch.setattr(torch.cuda, "set_device", switched.append)
    core = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda", 1)))
    service = EngineService(core, control=None)  # type: ignore[arg-type]
    monkeypatch.setattr(service, "turn", lambda: False)
    service.start()
    service._thread.join(5)
    assert switched == [torch.device("cuda", 1)] and service.error is None


def test_a_samples_first_update_says_how_long_it_queued():
    """One sequence at a time: the second request waits in the queue while the first generates, and its first update
    says so (queue_s, vLLM's queue time: from the engine's taking it to its first admission); later updates say
    nothing."""
    with engine(max_num_seqs=1) as e:
        core = e.core
        core.add_request("a", e.encode("first"), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        core.add_request("b", e.encode("second"), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        updates = []
        while core.has_work:
            updates += [u for u in core.step() if u.token_id is not None]
    first = {u.request_id: u for u in reversed(updates)}
    assert 0 <= first["a"].queue_s < first["b"].queue_s
    assert all(u.queue_s is None for u in updates if u is not first[u.request_id])


def test_generate_and_chat_take_sampling_params_by_vllms_keyword(reference):
    """vLLM's LLM.generate(prompts, sampling_params=...) and LLM.chat(messages, sampling_params=...): the keyword a
    vLLM user writes was a TypeError here (the parameter was named `params`)."""
    with engine() as e:
        assert tokens(e.generate(PROMPTS, sampling_params=GREEDY)) == reference
        hi = [{"role": "user", "content": "hi"}]
        assert tokens(e.chat(hi, sampling_params=GREEDY)) == tokens(e.generate(hi, GREEDY))


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_sample(reference):
    """vLLM's CompletionOutput.stop_reason: the stop string or stop_token_ids entry that ended the sample; None for an
    EOS, a length or no stop. The output had no such field: which of several stops ended it was lost."""
    first = reference[0][0]
    with engine() as e:
        by_string = e.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop=["zz", "aaa"]))
        by_token = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, stop_token_ids=[first]))
        by_eos = e.generate(PROMPTS[0], SamplingParams(allowed_token_ids=e.core.eos_ids[:1]))
        # an EOS listed in stop_token_ids too is an EOS (vLLM checks it first)
        listed_eos = e.generate(PROMPTS[0], SamplingParams(allowed_token_ids=e.core.eos_ids[:1],
                                                           stop_token_ids=e.core.eos_ids[:1]))
        by_length = e.generate(PROMPTS[0], GREEDY)
    outs = by_string + by_token + by_eos + listed_eos + by_length
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs] \
        == [("stop", "aaa"), ("stop", first), ("stop", None), ("stop", None), ("length", None)]


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs():
    """vLLM's CompletionOutput.cumulative_logprob (what a user ranks n samples by): the sum of the sampled tokens'
    log-probabilities where logprobs are asked, None where not. The output had no such field."""
    with engine() as e:
        (asked,) = e.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6, logprobs=0))
        (plain,) = e.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=5, max_tokens=6))
    for c in asked.outputs:
        assert len(c.logprobs) == 6
        sampled = [e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert c.cumulative_logprob == pytest.approx(sum(sampled))
        assert c.cumulative_logprob < 0
    assert plain.outputs[0].cumulative_logprob is None


def test_offline_logprobs_are_vllms_logprob_dicts_with_ranks_and_texts():
    """vLLM's CompletionOutput.logprobs: per token {id: Logprob(logprob, rank, decoded_token)}, the sampled token first
    (its rank the ids at least as likely), then the k most likely ranked 1..k. A sampled token's entry equals the one
    the same tokens give read back as a prompt (prompt_logprobs); detokenize=False leaves the texts None. They were
    bare floats, and the alternatives a list of pairs beside them."""
    from tpgraph import Logprob

    hot = SamplingParams(temperature=2.0, seed=1, max_tokens=8, logprobs=2)
    with engine() as e:
        (sampled,) = e.generate(PROMPTS[0], hot)
        (greedy,) = e.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))
        (bare,) = e.generate(PROMPTS[0], dataclasses.replace(hot, detokenize=False))
        ids = sampled.prompt_token_ids + sampled.outputs[0].token_ids
        (read,) = e.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
        text = e.prompts.token_text
    c = sampled.outputs[0]
    assert all(isinstance(v, Logprob) for entry in c.logprobs for v in entry.values())
    for j, (entry, t) in enumerate(zip(c.logprobs, c.token_ids, strict=True)):
        assert next(iter(entry)) == t and len(entry) in (2, 3)
        top = sorted((v.rank, i) for i, v in entry.items() if i != t or v.rank <= 2)
        assert [r for r, _ in top] == [1, 2] and all(v.decoded_token == text(i) for i, v in entry.items())
        again = read.prompt_logprobs[len(sampled.prompt_token_ids) + j][t]
        assert entry[t].logprob == pytest.approx(again.logprob, abs=1e-4)
        assert entry[t].rank == again.rank or t in [i for _, i in top]  # (a top token takes its place's rank)
    assert max(entry[t].rank for entry, t in zip(c.logprobs, c.token_ids, strict=True)) > 2  # (3.0 strays)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids,
                                                                                  strict=True)))
    for entry, t in zip(greedy.outputs[0].logprobs, greedy.outputs[0].token_ids, strict=True):
        assert entry[t].rank == 1 and sorted(v.rank for v in entry.values()) == [1, 2, 3]
        assert entry[t].logprob == max(v.logprob for v in entry.values())
    assert bare.outputs[0].token_ids == c.token_ids and bare.outputs[0].text == ""
    assert all(v.decoded_token is None for entry in bare.outputs[0].logprobs for v in entry.values())
    assert [{i: v.logprob for i, v in entry.items()} for entry in bare.outputs[0].logprobs] == \
        [{i: v.logprob for i, v in entry.items()} for entry in c.logprobs]


def test_seed_minus_one_is_no_seed_as_in_vllm():
    """vLLM's SamplingParams reads seed=-1 as no seed (its LLM and its server alike); here it was the fixed seed -1,
    so a vLLM user's "random" requests repeated the same draws call after call."""
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=8, ignore_eos=True)
    assert params.seed is None
    with engine() as e:
        assert tokens(e.generate(PROMPTS[:2], params)) != tokens(e.generate(PROMPTS[:2], params))


def test_detokenize_false_gives_the_token_ids_alone(reference):
    """vLLM's SamplingParams(detokenize=False) (token ids wanted, the text's cost not): it was a TypeError here. The
    same tokens come, the text is "", and stop strings (found in the text) are refused with it, as vLLM does."""
    with engine() as e:
        out = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, detokenize=False))
        assert tokens(out) == reference and all(o.outputs[0].text == "" for o in out)
    with pytest.raises(RequestError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["a"], detokenize=False)
    with pytest.raises(RequestError, match="detokenize must be true or false"):
        SamplingParams(detokenize="no")


def test_the_spmd_check_tells_apart_long_token_id_arrays_that_differ(monkeypatch):
    """generate takes token ids as a numpy array or a torch tensor, alone, in a list or in vLLM's TokensPrompt. The
    check digested their repr, which elides all but the ends of an array past 1000 items: ranks calling with prompts
    that differ in the middle agreed, and stepped apart with no word (the wrong tokens the check is there to stop)."""
    import types

    import numpy as np
    import torch

    from tpgraph.engine import tp_engine

    seen = []
    monkeypatch.setattr(tp_engine, "gather_objects", lambda state, digest: seen.append(digest) or [digest])
    rank = types.SimpleNamespace(service=None, state=types.SimpleNamespace(world_size=2))

    def digest(prompts) -> str:
        seen.clear()
        tp_engine.TPEngine._agreed_call(rank, "generate", lambda: tp_engine._prompt_list(prompts), None)
        return seen[0]

    ids = np.arange(2000) % 250
    other = ids.copy()
    other[1000] = 7
    for form in (np.asarray, torch.tensor):
        assert digest(form(ids)) != digest(form(other))
        assert digest([form(ids), form(ids)]) != digest([form(ids), form(other)])
        assert digest({"prompt_token_ids": form(ids)}) != digest({"prompt_token_ids": form(other)})
        assert digest(form(ids)) == digest(ids.tolist())  # (the ids they hold, as they encode)


def test_the_spmd_check_reads_a_set_of_stop_strings_alike_in_every_process():
    """Under torchrun each rank is a process of its own, whose str hashes are seeded apart. SamplingParams takes stop
    strings and bad_words as any iterable, and a set became a tuple in its process's own order: the generate check's
    digest of the parameters then differed between ranks, refusing a call every rank made alike."""
    from tpgtest.spmd import digests_across_hash_seeds

    params = "SamplingParams(stop={'END', 'STOP', '###', 'Q:'}, bad_words={'foo', 'bar', 'baz'})"
    digests = digests_across_hash_seeds(params, seeds=(1, 3, 4))  # (seeds whose set orders differ)
    assert len(digests) == 1


def test_a_samples_first_update_says_how_long_it_took_from_admission_to_that_token():
    """prefill_s, vLLM's prefill time: from a sample's first admission to its first token read back. Admission comes
    after its queue time, and the token before the step that returns it ends; later updates say nothing."""
    import time

    with engine(max_num_seqs=1) as e:
        core = e.core
        added = time.perf_counter()
        core.add_request("a", e.encode("first"), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        core.add_request("b", e.encode("second"), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        seen = {}
        updates = []
        while core.has_work:
            for u in core.step():
                if u.token_id is not None:
                    updates.append(u)
                    seen.setdefault(u.request_id, time.perf_counter())
    first = {u.request_id: u for u in reversed(updates)}
    for rid, u in first.items():
        assert 0 < u.prefill_s and u.queue_s + u.prefill_s <= seen[rid] - added
    assert all(u.prefill_s is None for u in updates if u is not first[u.request_id])


def test_a_steps_tokens_are_counted_as_vllm_counts_an_iterations():
    """StepTiming.tokens (vllm:iteration_tokens_total): the tokens a step's updates carry, each one read back and,
    with a sequence's first, its prompt. Over all steps: every prompt once per sample, and every token generated,
    whatever chunks the prompts were computed in."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=5, ignore_eos=True, n=2)
    with engine(max_num_batched_tokens=8) as e:  # (chunked: a prompt's chunks are counted with its first token)
        core = e.core
        prompts = [e.encode(p) for p in PROMPTS]
        for i, ids in enumerate(prompts):
            core.add_request(str(i), ids, params)
        counted, generated = [], 0
        while core.has_work:
            updates = core.step()
            generated += sum(u.token_id is not None for u in updates)
            counted.append(core.timing.tokens if updates else 0)
    assert generated == 5 * 2 * len(PROMPTS)
    assert sum(counted) == 2 * sum(map(len, prompts)) + generated


def test_a_stop_string_completed_by_the_text_flushed_at_the_end_is_the_finish_reason():
    """Bytes that never complete a character (0xFD here) are decoded when the sample ends, and a stop string in that
    text cuts it: the sample then ended by that string, as vLLM's output processor turns a finish into "stop" with the
    string as stop_reason wherever its detokenizer finds one. The reason stayed "length" (or the EOS's, with no
    stop_reason). At exactly min_tokens tokens no stop string is looked for (vLLM's num_output_tokens() >
    min_tokens), and the text is kept whole."""
    stop = ["\ufffd"]
    with engine() as e:
        eos = e.core.eos_ids[0]
        by_length = e.generate("hi", SamplingParams(temperature=0.0, max_tokens=1, logit_bias={0xFD: 100}, stop=stop))
        by_eos = e.generate("hi", SamplingParams(temperature=0.0, min_tokens=1, allowed_token_ids=[0xFD, eos],
                                                 logit_bias={eos: 100}, stop=stop))
        at_min = e.generate("hi", SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2,
                                                 logit_bias={0xFD: 100}, stop=stop))
    outs = [o.outputs[0] for o in by_length + by_eos + at_min]
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs] == [
        ([0xFD], "", "stop", "\ufffd"), ([0xFD, eos], "", "stop", "\ufffd"),
        ([0xFD, 0xFD], "\ufffd\ufffd", "length", None)]


def _outgrow_the_cache(e, params):
    """The updates of a request run by a core whose scheduler lets a sequence grow past the whole KV cache (64
    tokens, max_model_len 128), which ends it there."""
    from tpgraph.engine.core import EngineCore

    cfg = dataclasses.replace(e.core.scheduler.cfg, max_model_len=128)
    core = EngineCore(e.runner, cfg, eos_ids=e.core.eos_ids, tokenizer=e.core.tokenizer)
    core.add_request("r", e.encode("hi"), params)
    updates = []
    while core.has_work:
        updates += core.step()
    return updates


def test_a_sequence_that_outgrows_the_cache_ends_with_its_text_whole_and_its_stop_string_named():
    """A sequence the KV cache cannot hold ends, min_tokens or not (vLLM's min_tokens holds back stop strings and
    stop ids alone), and its held-back text is flushed: a stop string only past min_tokens cuts it, as on every
    other end. The flush looked for stop strings whatever min_tokens said (before it, the bytes' U+FFFD text was
    cut away), and a string it found past min_tokens cut the text but left the finish "length", the string unnamed."""
    bias = {0xFD: 100}  # (bytes that never complete a character: decoded only when the sample ends)
    with engine(num_kv_blocks=17) as e:
        held = _outgrow_the_cache(e, SamplingParams(temperature=0.0, max_tokens=100, min_tokens=90,
                                                    logit_bias=bias, stop=["\ufffd"]))
        past = _outgrow_the_cache(e, SamplingParams(temperature=0.0, max_tokens=100, logit_bias=bias,
                                                    stop=["\ufffd"]))
    generated = sum(u.token_id is not None for u in held)
    assert 0 < generated < 90  # (ended by the cache, under min_tokens)
    assert ("".join(u.text for u in held), held[-1].finish_reason, held[-1].stop_reason) == (
        "\ufffd" * generated, "length", None)
    assert ("".join(u.text for u in past), past[-1].finish_reason, past[-1].stop_reason) == ("", "stop", "\ufffd")


def test_a_sample_ended_for_a_banned_token_before_min_tokens_keeps_its_text_whole():
    """A banned token ends its sample ("abort"), min_tokens or not; the text of the tokens before it is flushed,
    and a stop string cuts it only past min_tokens, as on every other end. The flush looked for stop strings
    whatever min_tokens said: "a" and a byte 0xFD whose U+FFFD completes "a\ufffd" lost their text. Past min_tokens
    that string ends the sample, as a stop string the flush completes ends any other, and is named."""
    with engine() as e:
        (a,), (b,) = (e.tokenizer.encode(c, add_special_tokens=False).ids for c in "ab")
        ends = []
        for min_tokens in (4, 0):
            params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=min_tokens, stop=["a\ufffd"],
                                    allowed_token_ids=(a, 0xFD))
            core = e.core
            core.add_request("r", e.encode("hi"), params)
            state = core.requests.pop("r")
            seq = state.seqs[0]
            ends.append([core._accept(seq, state, seq.add_pending(), t) for t in (a, 0xFD, b)])  # (b: not allowed)
    held, past = ends
    assert ("".join(u.text for u in held), held[-1].finish_reason, held[-1].stop_reason) == (
        "a\ufffd", "abort", None)
    assert ("".join(u.text for u in past), past[-1].finish_reason, past[-1].stop_reason) == ("", "stop", "a\ufffd")


def test_sample_i_of_a_seeded_request_draws_as_one_sample_with_seed_plus_i_as_in_vllm():
    """vLLM gives sample i of a seeded request with n > 1 the seed `seed + i` (vllm/v1/engine/parallel_sampling.py):
    sample i is what a one-sample request with seed + i draws. Here sample i drew from (seed, i): its own stream,
    another than seed + i's. (The random numbers are tpgraph's own; the relation is vLLM's.)"""
    with engine() as e:
        (many,) = e.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=20, n=3, max_tokens=6))
        alone = [e.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=20 + i, max_tokens=6))[0].outputs[0]
                 for i in range(3)]
    assert [o.token_ids for o in many.outputs] == [o.token_ids for o in alone]


def test_a_sequences_sample_row_is_kept_until_min_tokens_is_passed_and_never_where_its_bans_read_the_output():
    """A row is built once and reused while nothing in it changes (it holds the sequence's own lists); past
    min_tokens the held stop ids leave it, and a row whose bad words read the output is made each step."""
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    with engine() as e:
        seq = Sequence(0, [5, 6, 7], 8, params=params, held_bans=(9,), bad_words=((3,),))
        first = e.core._sample_row(seq)
        assert first.fixed_banned == ((3,), (9,)) and first.output_ids is seq.output_ids
        seq.output_ids.append(11)
        assert e.core._sample_row(seq) is first
        seq.output_ids.append(12)  # min_tokens reached: the stop id may come
        past = e.core._sample_row(seq)
        assert past.fixed_banned == ((3,),) and e.core._sample_row(seq) is past
        words = Sequence(1, [5, 6, 7], 8, params=dataclasses.replace(params, min_tokens=0),
                         bad_words=((11, 12),), output_ids=[11])
        row = e.core._sample_row(words)
        assert row.banned_ids == (12,) and e.core._sample_row(words) is not row
        words.output_ids.append(4)
        assert e.core._sample_row(words).banned_ids == ()
