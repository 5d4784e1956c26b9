"""A vLLM user's offline script, ported with its import line changed (`from tpgraph import TPEngine as LLM,
SamplingParams`): vLLM's LLM keywords, methods and output fields on TPEngine, on CPU with the built-in model. Where
tpgraph differs on purpose, the refusal says what to use instead."""

import re

import numpy as np
import pytest
import torch

from tpgraph import ConfigError, RequestError, SamplingParams, TPEngine
from tpgraph.engine.structured import StructuredOutput, StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def chat_engine(ckpt) -> TPEngine:
    """The chat test checkpoint's engine (random weights: its tokenizer, template and configs are what count)."""
    return TPEngine(str(ckpt), device="cpu", load_format="dummy", max_num_seqs=2, max_model_len=128, num_kv_blocks=40)


def engine(**kw):
    base = dict(device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=64, block_size=4)
    return TPEngine(**{**base, **kw})


def test_vllms_engine_keywords_are_read_as_tpgraphs():
    """LLM(model, tensor_parallel_size=..., enforce_eager=..., num_gpu_blocks_override=...) were TypeErrors here
    (EngineConfig has no such fields): they are tp_size, GraphConfig.enforce_eager and num_kv_blocks."""
    with TPEngine(device="cpu", max_num_seqs=4, max_model_len=64, block_size=4, tensor_parallel_size=1,
                  enforce_eager=True, num_gpu_blocks_override=32) as e:
        assert e.config.tp_size == 1 and e.config.graphs.enforce_eager and e.config.num_kv_blocks == 32
        assert (e.runner.modes.decode, e.runner.modes.prefill, e.runner.modes.downgrades) == ("none", "none", ())
        assert e.generate("Hi", GREEDY)[0].outputs[0].finish_reason == "length"


def test_tensor_parallel_size_is_the_tp_size_checked_before_any_rank_starts(monkeypatch):
    from tpgraph.engine import followers

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(followers, "start_followers", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(ConfigError, match=r"num_attention_heads \(8\) is not divisible by the tensor-parallel size"):
        TPEngine(tensor_parallel_size=3, device="cpu")
    with pytest.raises(ConfigError, match=r"tp_size=2 and tensor_parallel_size=4 differ"):
        TPEngine(tp_size=2, tensor_parallel_size=4, device="cpu")


@pytest.mark.parametrize("name, value, hint", [
    ("quantization", "fp8", "give an unquantized checkpoint"),
    ("cpu_offload_gb", 4, "the weights stay on the device"),
    ("hf_token", "hf_x", "nothing is downloaded: a hub id is read from the hub cache"),
])
def test_a_vllm_keyword_with_no_setting_here_is_refused_saying_what_to_do(name, value, hint):
    """Such a keyword was a bare TypeError ("unexpected keyword argument"); taking it and changing nothing would run
    another engine than the script meant."""
    with pytest.raises(ConfigError, match=rf"{name} \(vLLM's\) is not taken: .*{hint}"):
        TPEngine(device="cpu", **{name: value})


def test_vllm_keywords_that_change_nothing_here_are_taken_at_those_values_alone():
    """As the server's flags take them: trust_remote_code (no checkpoint code runs), swap_space (preemption
    recomputes), disable_log_stats (nothing is logged periodically), kv_cache_dtype "auto", tokenizer_mode
    "auto"/"hf" and max_num_partial_prefills 1 (a flag here, but a TypeError as a keyword); a value that would mean
    something else is refused by name."""
    with engine(trust_remote_code=True, swap_space=4, disable_log_stats=True, kv_cache_dtype="auto",
                tokenizer_mode="hf", max_num_partial_prefills=1) as e:
        assert e.generate("Hi", GREEDY)[0].outputs[0].finish_reason == "length"
    for name, value, meaning in [("tokenizer_mode", "mistral", "'auto' or 'hf'"),
                                 ("max_num_partial_prefills", 4, "1 alone"),
                                 ("trust_remote_code", "yes", "True or False"), ("swap_space", -1, "GiB >= 0")]:
        with pytest.raises(ConfigError, match=rf"{name}={value!r} \(vLLM's\) is not taken: {name} takes {meaning}"):
            TPEngine(device="cpu", **{name: value})


def test_vllm_keywords_rl_frameworks_pass_at_their_defaults_are_taken_there_alone():
    """RL frameworks build vLLM's LLM with skip_tokenizer_init=False, enable_lora=False and enable_sleep_mode=False
    (their defaults, from config): each was a bare TypeError ("unexpected keyword argument"). Taken at those values;
    the others ask for what tpgraph does not do, refused saying so. (disable_custom_all_reduce, which they pass too,
    is a setting here: the next test.)"""
    from tpgraph.engine.config import vllm_keywords

    defaults = {"skip_tokenizer_init": False, "enable_lora": False, "enable_sleep_mode": False}
    assert vllm_keywords(None, 1, defaults) == (None, 1, {})
    for name, meaning in [("skip_tokenizer_init", "False alone .*detokenizes"),
                          ("enable_lora", "False alone .*merge_and_unload"),
                          ("enable_sleep_mode", "False alone .*no sleep mode")]:
        with pytest.raises(ConfigError, match=rf"{name}=True \(vLLM's\) is not taken: {name} takes {meaning}"):
            vllm_keywords(None, 1, {name: True})


def test_disable_custom_all_reduce_is_taken_and_the_communicator_is_built_without_it(monkeypatch):
    """LLM(..., disable_custom_all_reduce=True), which RL frameworks and vLLM users pass to run every all-reduce
    through NCCL, was refused ("takes False alone"), though the communicator can run without the custom all-reduce.
    Taken: the communicator is built without it (the default still tries it: on CPU, "not on CUDA")."""
    from tpgraph.engine import tp_engine
    from tpgraph.engine.config import vllm_keywords

    assert vllm_keywords(None, 1, {"disable_custom_all_reduce": True}) == (None, 1, {"disable_custom_all_reduce": True})
    built = []
    real = tp_engine.TPCommunicator
    monkeypatch.setattr(tp_engine, "TPCommunicator", lambda state, **kw: built.append(kw) or real(state, **kw))
    with engine(disable_custom_all_reduce=True) as e:
        assert e.config.disable_custom_all_reduce is True and built[-1]["use_custom_allreduce"] is False
        assert e.comm.custom is None and e.comm.custom_reason == "disabled by --disable-custom-all-reduce"
        assert e.generate("Hi", GREEDY)[0].outputs[0].finish_reason == "length"
    with engine(disable_custom_all_reduce=False) as e:
        assert built[-1]["use_custom_allreduce"] is True and e.comm.custom_reason == "not on CUDA"
    with pytest.raises(ConfigError, match=r"disable_custom_all_reduce must be True or False, got 'yes'"):
        TPEngine(device="cpu", disable_custom_all_reduce="yes")


def test_vllm_keywords_at_vllms_own_defaults_are_taken_as_left_out():
    """Scripts pass vLLM's keywords through from their configs at vLLM's defaults: quantization=None, cpu_offload_gb=0
    and hf_token=None ask for nothing, and max_num_seqs, block_size, enable_prefix_caching and enable_chunked_prefill
    None leave the choice to the engine (vLLM's EngineArgs). Each was refused ("quantization (vLLM's) is not taken",
    "max_num_seqs must be a positive integer, got None"); each is now this engine's default."""
    from tpgraph.engine.config import EngineConfig, vllm_keywords

    defaults = {"quantization": None, "cpu_offload_gb": 0, "hf_token": None, "max_num_seqs": None,
                "block_size": None, "enable_prefix_caching": None, "enable_chunked_prefill": None}
    model, tp_size, kwargs = vllm_keywords(None, 1, defaults)
    assert (model, tp_size, kwargs) == (None, 1, {})
    assert EngineConfig(**kwargs) == EngineConfig()
    # (a value other than vLLM's default still asks for something: refused, or taken as that setting)
    with pytest.raises(ConfigError, match=r"cpu_offload_gb \(vLLM's\) is not taken"):
        vllm_keywords(None, 1, {"cpu_offload_gb": 2})
    assert vllm_keywords(None, 1, {"max_num_seqs": 4}) == (None, 1, {"max_num_seqs": 4})


def test_vllms_compilation_config_sets_the_cuda_graphs(caplog):
    """vLLM's LLM(compilation_config=...) was refused whatever it held, its default None too (scripts pass it through
    from their configs), where the server takes --cudagraph-capture-sizes and --max-cudagraph-capture-size: its
    capture sizes are the decode ladder, its cudagraph_mode the graph modes, None sets nothing."""
    from tpgraph.engine.config import vllm_keywords
    from tpgraph.graphs.config import GraphConfig

    assert vllm_keywords(None, 1, {"compilation_config": None}) == (None, 1, {})
    graphs = lambda config, **kw: vllm_keywords(None, 1, {"compilation_config": config, **kw})[2]["graphs"]
    assert graphs({"cudagraph_capture_sizes": [8, 1, 2, 4]}) == GraphConfig(ladder=(1, 2, 4, 8))
    assert graphs({"max_cudagraph_capture_size": 32}).ladder == (1, 2, 4, 8, 16, 24, 32)
    assert graphs({"cudagraph_capture_sizes": [1, 4], "max_cudagraph_capture_size": 4}).ladder == (1, 4)
    assert graphs({"cudagraph_mode": "FULL_DECODE_ONLY"}) == GraphConfig(decode_mode="full", prefill_mode="none")
    assert graphs({"cudagraph_mode": "piecewise"}) == GraphConfig(decode_mode="piecewise")
    assert graphs({"cudagraph_mode": "NONE", "cudagraph_capture_sizes": None}).decode_mode == "none"
    eager = graphs({"cudagraph_capture_sizes": [1, 2]}, enforce_eager=True)
    assert eager.enforce_eager and eager.ladder == (1, 2)
    # vLLM's compilation mode (its older level; an int compilation_config is one) 3, VLLM_COMPILE, is its default:
    # scripts give it beside the capture sizes, asking for nothing more. 0 (no torch.compile) captures no graphs in
    # vLLM but full decode ones where cudagraph_mode FULL_DECODE_ONLY asks
    assert graphs({"level": 3, "cudagraph_capture_sizes": [1, 2, 4, 8]}) == GraphConfig(ladder=(1, 2, 4, 8))
    assert graphs({"mode": "VLLM_COMPILE"}) == graphs(3) == graphs({"mode": 3, "level": None}) == GraphConfig()
    assert graphs({"mode": 0}) == graphs(0) == GraphConfig(decode_mode="none", prefill_mode="none")
    assert graphs({"level": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}) == GraphConfig(decode_mode="full",
                                                                                    prefill_mode="none")
    assert graphs({"mode": 0, "cudagraph_mode": "FULL_AND_PIECEWISE"}).decode_mode == "none"
    # vLLM's FULL (mixed batches in full graphs too), as vLLM reads it with an attention backend that has none: full
    # decode graphs and piecewise ones for the rest, or (compilation off) full decode graphs only; said in the log
    with caplog.at_level("WARNING", logger="tpgraph.graphs.config"):
        assert graphs({"cudagraph_mode": "FULL"}) == GraphConfig(decode_mode="full", prefill_mode="piecewise")
    assert "cudagraph_mode FULL: mixed prefill-decode batches are not captured whole here; setting " \
           "cudagraph_mode=FULL_AND_PIECEWISE" in caplog.text
    assert graphs({"mode": 0, "cudagraph_mode": "full"}) == GraphConfig(decode_mode="full", prefill_mode="none")
    for config, message in [
        ("3", r"compilation_config='3' \(vLLM's\) is not taken: give a dict"),
        ({"level": 1}, r"compilation_config's level 1 \(vLLM's torch.compile mode\) is not taken"),
        ({"mode": "STOCK_TORCH_COMPILE"}, r"compilation_config's mode 'STOCK_TORCH_COMPILE' \(vLLM's torch.compile"),
        (True, r"compilation_config=True \(vLLM's\) is not taken"),
        ({"splitting_ops": []}, r"compilation_config's splitting_ops \(vLLM's\) is not taken"),
        ({"cudagraph_mode": "FULL_PIECEWISE"}, r"cudagraph_mode 'FULL_PIECEWISE' is not taken: give one of NONE, "),
        ({"cudagraph_capture_sizes": [1, 0]}, r"cudagraph_capture_sizes entry 0 is not positive"),
        ({"cudagraph_capture_sizes": [1, 4], "max_cudagraph_capture_size": 8}, "must be the largest"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size must be a positive integer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            vllm_keywords(None, 1, {"compilation_config": config})
    with pytest.raises(ConfigError, match="both set the CUDA graphs"):
        vllm_keywords(None, 1, {"compilation_config": {"cudagraph_mode": "NONE"}, "graphs": GraphConfig()})


def test_vllms_compilation_config_capture_sizes_are_read_as_vllm_reads_them():
    """vLLM drops a repeated capture size (its config de-duplicates them), where this refused the whole config; and it
    takes sizes below max_num_seqs (its larger batches run eagerly), which this refused."""
    from tpgraph.engine.config import vllm_keywords
    from tpgraph.graphs.config import GraphConfig

    kwargs = vllm_keywords(None, 1, {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 2, 4, 8, 1]}})[2]
    assert kwargs["graphs"] == GraphConfig(ladder=(1, 2, 4, 8))
    kwargs = vllm_keywords(None, 1, {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}, "device": "cuda"})[2]
    assert kwargs["graphs"].decode_sizes(kwargs.get("max_num_seqs", 8)) == (1, 2, 4)
    kwargs = vllm_keywords(None, 1, {"compilation_config": {"max_cudagraph_capture_size": 4}, "device": "cuda",
                                     "max_num_seqs": 6})[2]
    assert kwargs["graphs"].decode_sizes(kwargs["max_num_seqs"]) == (1, 2, 4)


def test_vllms_seed_none_is_refused_saying_why():
    with pytest.raises(ConfigError, match=r"got None \(vLLM's None, no fixed seed, is not taken: every rank draws"):
        TPEngine(device="cpu", seed=None)


def test_outputs_say_they_are_finished_as_vllms_do():
    """vLLM's RequestOutput.finished and CompletionOutput.finished(), which scripts check before reading a result:
    AttributeErrors here."""
    with engine() as e:
        (out,) = e.generate("Hi", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4))
    assert out.finished is True and [c.finished() for c in out.outputs] == [True, True]
    out.outputs[1].finish_reason = None  # (a sample still running, as vLLM's streamed outputs have)
    assert out.finished is False and [c.finished() for c in out.outputs] == [True, False]


def test_get_tokenizer_answers_as_the_checkpoints_transformers_tokenizer_does(tmp_path):
    """vLLM's LLM.get_tokenizer() (the checkpoint's transformers tokenizer: scripts render prompts with its
    apply_chat_template and read its eos_token_id) was an AttributeError here. The view answers as AutoTokenizer does
    for the same checkpoint (transformers 4's list for a tokenized chat, 5's dict with return_dict)."""
    transformers = pytest.importorskip("transformers")
    from tpgtest.chat_fixtures import make_chat_checkpoint

    ckpt = make_chat_checkpoint(tmp_path / "chat")
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    with chat_engine(ckpt) as e:
        tok = e.get_tokenizer()
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) \
            == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) \
            == e.chat(chat, GREEDY)[0].prompt
        assert tok.apply_chat_template(chat) == hf.apply_chat_template(chat, return_dict=False)
        assert tok.apply_chat_template(chat, return_dict=True) == dict(hf.apply_chat_template(chat, return_dict=True))
        assert tok.encode("héllo") == hf.encode("héllo") == e.generate("héllo", GREEDY)[0].prompt_token_ids
        assert tok.encode("hi", add_special_tokens=False) == hf.encode("hi", add_special_tokens=False)
        ids = tok.encode("a b") + [tok.eos_token_id]
        assert tok.decode(ids) == hf.decode(ids) and tok.batch_decode([ids], True) == hf.batch_decode([ids], True)
        assert (tok.eos_token_id, tok.bos_token_id, tok.eos_token, tok.bos_token, len(tok), tok.vocab_size) \
            == (hf.eos_token_id, hf.bos_token_id, hf.eos_token, hf.bos_token, len(hf), hf.vocab_size)
        assert tok.convert_tokens_to_ids([hf.bos_token, "a"]) == hf.convert_tokens_to_ids([hf.bos_token, "a"])
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids) and tok.get_vocab() == hf.get_vocab()
        assert tok.chat_template == hf.chat_template and tok.backend_tokenizer is e.tokenizer
        with pytest.raises(RequestError, match="apply_chat_template here takes no max_length, padding"):
            tok.apply_chat_template(chat, padding=True, max_length=8)


def test_get_tokenizer_decodes_one_token_id_as_transformers_does(tmp_path):
    """A script reading a generation token by token calls tokenizer.decode(token_id) with one id, as transformers
    takes it: the view raised a TypeError ('int' object is not iterable)."""
    transformers = pytest.importorskip("transformers")
    from tpgtest.chat_fixtures import EOT_ID, make_chat_checkpoint

    ckpt = make_chat_checkpoint(tmp_path / "chat")
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    with chat_engine(ckpt) as e:
        tok = e.get_tokenizer()
    for token_id in (104, 233, EOT_ID):  # ("h", a byte of a character, a special token)
        assert tok.decode(token_id) == hf.decode(token_id)
        assert tok.decode(token_id, skip_special_tokens=True) == hf.decode(token_id, skip_special_tokens=True)
    # clean_up_tokenization_spaces, which decoding scripts pass (False mostly), was a TypeError (an unexpected keyword):
    # taken, and True changes nothing for this BPE tokenizer, as transformers 5 reads it (4 stripped the spaces)
    spaced = tok.encode("Hello , world . Is n't it ?", add_special_tokens=False)
    for clean in (False, None):
        assert tok.decode(spaced, skip_special_tokens=True, clean_up_tokenization_spaces=clean) == hf.decode(
            spaced, skip_special_tokens=True, clean_up_tokenization_spaces=clean)
        assert tok.batch_decode([spaced], clean_up_tokenization_spaces=clean) == hf.batch_decode(
            [spaced], clean_up_tokenization_spaces=clean)
    assert tok.decode(spaced, clean_up_tokenization_spaces=True) == "Hello , world . Is n't it ?"
    # a token read off a tensor or an array (sampled ids, output[0, -1]) is one id too: list() of it was a TypeError
    for token_id in (torch.tensor(104), np.array(104), np.int64(EOT_ID), torch.tensor([104, 105]), np.array([104])):
        assert tok.decode(token_id) == hf.decode(token_id)


def hf_tokenizers(tmp_path):
    """(engine keywords, transformers' tokenizer for the same files): the chat checkpoint's AutoTokenizer, and the
    built-in model's byte tokenizer with its BOS and EOS, saved and read back as transformers reads a checkpoint's."""
    transformers = pytest.importorskip("transformers")
    from tpgtest.chat_fixtures import make_chat_checkpoint

    from tpgraph.tokenizer import BOS, EOS, builtin_tokenizer

    ckpt = make_chat_checkpoint(tmp_path / "chat")
    builtin = transformers.PreTrainedTokenizerFast(tokenizer_object=builtin_tokenizer(), bos_token=BOS, eos_token=EOS)
    builtin.save_pretrained(str(tmp_path / "builtin"))
    return [(dict(model=str(ckpt), load_format="dummy"), transformers.AutoTokenizer.from_pretrained(str(ckpt))),
            ({}, transformers.AutoTokenizer.from_pretrained(str(tmp_path / "builtin")))]


def test_get_tokenizer_called_on_text_and_tokenize_answer_as_transformers_do(tmp_path):
    """tokenizer(text).input_ids, tokenizer([texts]) and tokenizer.tokenize(text), which scripts use to count and
    inspect prompt tokens: a TypeError ('EngineTokenizer' object is not callable) and an AttributeError here."""
    for kw, hf in hf_tokenizers(tmp_path):
        with TPEngine(device="cpu", max_num_seqs=2, max_model_len=128, num_kv_blocks=40, **kw) as e:
            tok = e.get_tokenizer()
        for text in ("héllo world", ["a", "b c", ""]):
            for special in (True, False):
                got, want = tok(text, add_special_tokens=special), hf(text, add_special_tokens=special)
                assert got == dict(want) and got.input_ids == want.input_ids
                assert got.attention_mask == want.attention_mask
        assert tok("hi").input_ids == tok.encode("hi") == e.encode("hi")
        assert tok.tokenize("héllo world") == hf.tokenize("héllo world")
        assert tok.tokenize("a", add_special_tokens=True) == hf.tokenize("a", add_special_tokens=True)
        with pytest.raises(RequestError, match="takes text and add_special_tokens alone, not padding, return_tensors"):
            tok(["a", "bc"], padding=True, return_tensors="pt")
        for wrong in (5, None, b"hi"):  # (an AttributeError, 'int' object has no attribute 'encode', or a TypeError)
            for call in (tok.encode, tok.tokenize):
                with pytest.raises(RequestError, match=f"must be a string, got {type(wrong).__name__}"):
                    call(wrong)
                with pytest.raises(ValueError):  # (as transformers' encode and tokenize refuse it)
                    getattr(hf, call.__name__)(wrong)


def test_get_tokenizer_names_its_special_tokens_as_transformers_does(tmp_path):
    """pad_token(_id), unk_token(_id), special_tokens_map and all_special_ids/tokens (scripts set a padding id, or
    strip special ids from outputs, with them) were AttributeErrors here. A fine-tune's config naming a pad token
    (Llama 3's <|end_of_text|>, as many set it) gives it, as transformers does."""
    import json
    import shutil

    pairs = hf_tokenizers(tmp_path)
    padded = shutil.copytree(tmp_path / "chat", tmp_path / "padded")
    config = padded / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pad_token": "<|end_of_text|>"}))
    pairs.append(({**pairs[0][0], "model": str(padded)}, type(pairs[0][1]).from_pretrained(str(padded))))

    def names(t):
        return (t.pad_token, t.pad_token_id, t.unk_token, t.unk_token_id, t.special_tokens_map,
                t.all_special_tokens, t.all_special_ids)

    for kw, hf in pairs:
        with TPEngine(device="cpu", max_num_seqs=2, max_model_len=128, num_kv_blocks=40, **kw) as e:
            assert names(e.get_tokenizer()) == names(hf)
    assert pairs[-1][1].pad_token_id == 257 and pairs[0][1].pad_token is None  # (both cases were compared)



def test_get_tokenizers_special_tokens_are_set_as_transformers_sets_them(tmp_path):
    """`if tok.pad_token is None: tok.pad_token = tok.eos_token` (and tok.pad_token_id = id), which scripts run on
    vLLM's get_tokenizer() before padding a batch, raised an AttributeError (a property with no setter). They are set
    on that tokenizer, as transformers sets them, and the engine's own tokens are left as they were."""
    def names(t):
        return (t.pad_token, t.pad_token_id, t.eos_token, t.special_tokens_map, t.all_special_ids)

    for kw, hf in hf_tokenizers(tmp_path):
        with TPEngine(device="cpu", max_num_seqs=2, max_model_len=128, num_kv_blocks=40, **kw) as e:
            tok = e.get_tokenizer()
            for t in (tok, hf):
                t.pad_token = t.eos_token
            assert names(tok) == names(hf) and tok.pad_token_id == tok.eos_token_id
            for t in (tok, hf):
                t.pad_token_id = 65
            assert names(tok) == names(hf) and tok.pad_token == "A"
            for t in (tok, hf):
                t.pad_token = None
            assert names(tok) == names(hf)
            with pytest.raises(RequestError, match="cannot set a non-string value as the pad_token, got 5"):
                tok.pad_token = 5
            tok.pad_token = tok.eos_token  # (get_tokenizer gives the engine's one tokenizer, as vLLM's: it stays set)
            assert e.get_tokenizer() is tok and e.get_tokenizer().pad_token == tok.eos_token
            assert e.prompts.special_tokens.get("pad_token") is None  # (the engine's own tokens as they were)

def test_get_tokenizer_has_no_eos_token_where_the_tokenizer_config_names_none(tmp_path):
    """transformers reads eos_token from the tokenizer config alone: without one it is None (the ids that end a
    generation are the model's and generation_config's, which it does not read). The view gave the text of the first
    such id, a token the checkpoint's tokenizer does not call its EOS."""
    import json

    transformers = pytest.importorskip("transformers")
    from tpgtest.chat_fixtures import make_chat_checkpoint

    ckpt = make_chat_checkpoint(tmp_path / "chat")
    config = ckpt / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "eos_token"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    with chat_engine(ckpt) as e:
        tok = e.get_tokenizer()
        assert (tok.eos_token, tok.eos_token_id, tok.all_special_ids) == (hf.eos_token, hf.eos_token_id,
                                                                          hf.all_special_ids) == (None, None, [256])
        assert e.prompts.eos_ids == (257, 260)  # (generations still end at the model's and generation_config's)


def test_get_tokenizer_renders_a_batch_of_conversations_as_transformers_does(tmp_path):
    """apply_chat_template over a list of conversations (scripts render a data set's chats in one call) refused the
    first conversation as a chat message with no role: a list of texts, of id lists, or a dict of lists, as
    transformers gives them. The built-in model's template is compared through its transformers tokenizer too."""
    from tpgraph.chat import BUILTIN_TEMPLATE

    chats = [[{"role": "user", "content": "héllo"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
              {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]]
    for kw, hf in hf_tokenizers(tmp_path):
        hf.chat_template = hf.chat_template or BUILTIN_TEMPLATE
        with TPEngine(device="cpu", max_num_seqs=2, max_model_len=128, num_kv_blocks=40, **kw) as e:
            tok = e.get_tokenizer()
            texts = tok.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
            assert texts == hf.apply_chat_template(chats, tokenize=False, add_generation_prompt=True) \
                == [e.render_chat(c) for c in chats]
        assert tok.apply_chat_template(chats) == hf.apply_chat_template(chats, return_dict=False)
        got, want = tok.apply_chat_template(chats, return_dict=True), hf.apply_chat_template(chats, return_dict=True)
        assert got == dict(want) and got.input_ids == want.input_ids and len(got.input_ids) == 2
        assert tok.apply_chat_template(chats[:1], tokenize=False) == [tok.apply_chat_template(chats[0], tokenize=False)]


def test_get_default_sampling_params_is_default_params(tmp_path):
    """vLLM's LLM.get_default_sampling_params() (the generation_config defaults, what generate uses where given
    none): an AttributeError here, where the method is default_params()."""
    from tpgtest.chat_fixtures import make_chat_checkpoint

    ckpt = make_chat_checkpoint(tmp_path / "chat")  # (its generation_config.json: temperature 0.6, top_p 0.9)
    with chat_engine(ckpt) as e:
        assert e.get_default_sampling_params() == e.default_params() == SamplingParams(temperature=0.6, top_p=0.9)


def test_default_sampling_params_take_the_generation_configs_max_new_tokens_as_vllms_do():
    """vLLM's get_default_sampling_params() (what its generate and chat use where given none) take generation_config's
    max_new_tokens (or --override-generation-config's) as max_tokens: here they dropped it, 16 tokens. A prompt that
    leaves less room is given what is left (as the server cuts that default), not refused for a limit never asked."""
    with engine(override_generation_config={"max_new_tokens": 20, "temperature": 0.0}) as e:
        assert e.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=20)
        assert e.default_params(max_tokens=3).max_tokens == 3
        short, long = e.generate(["Hi", [256, *range(97, 97 + 54)]])  # (55 tokens: 9 left of max_model_len 64)
        assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in (short, long)] \
            == [(20, "length"), (9, "length")]
        assert len(e.chat([{"role": "user", "content": "Hi"}])[0].outputs[0].token_ids) == 20


def test_the_default_16_tokens_are_cut_to_what_a_long_prompt_leaves():
    """Without generation_config's max_new_tokens, generate's default is SamplingParams' 16 tokens: a prompt leaving
    fewer was refused ("asks for 16 to generate") for a limit the caller never set. vLLM's generate runs it to
    max_model_len; here it is cut as the max_new_tokens default is."""
    with engine() as e:
        out = e.generate([[256, *range(97, 97 + 59)]])  # (60 tokens: 4 left of max_model_len 64)
        assert (len(out[0].outputs[0].token_ids), out[0].outputs[0].finish_reason) == (4, "length")
        assert len(e.generate(["Hi"])[0].outputs[0].token_ids) == 16  # (room left: the default as it is)


def test_a_field_set_on_sampling_params_is_checked_and_changes_later_requests_alone():
    """vLLM's generate example sets fields on the defaults (sampling_params.max_tokens = 8): taken, checked with the
    others as a new one's would be (a refused value leaves them as they were) and read as made. A request runs on
    its own copy (vLLM's clone), so a field set while it runs, from another thread, cannot change it midway. Setting
    one was refused (the params were frozen)."""
    import pickle

    with engine() as e:
        params = e.get_default_sampling_params()
        params.max_tokens, params.temperature = 3, 0.0
        params.stop = "zzz"  # (a lone string, read as one stop string)
        taken = []
        check = e.core.check_request
        e.core.check_request = lambda ids, p: taken.append(p) or check(ids, p)
        (first,) = e.generate(["Hi"], params)
        assert taken[0] == params and taken[0] is not params
        params.max_tokens = 5
        (second,) = e.generate(["Hi"], params)
    assert params.stop == ("zzz",) and len(first.outputs[0].token_ids) == 3 and len(second.outputs[0].token_ids) == 5
    assert second.outputs[0].token_ids[:3] == first.outputs[0].token_ids
    with pytest.raises(RequestError, match=r"min_tokens must be at most max_tokens \(5\), got 6"):
        params.min_tokens = 6
    with pytest.raises(RequestError, match=r"top_p must be in \(0.0, 1.0\], got 2"):
        params.top_p = 2
    with pytest.raises(AttributeError, match="SamplingParams has no field 'max_new_tokens'"):
        params.max_new_tokens = 8  # (a typo would have been kept and read by nothing)
    assert (params.min_tokens, params.top_p, params.max_tokens) == (0, 1.0, 5)
    params.top_k = -1
    assert params.top_k == 0  # (vLLM's "off", read as made)
    assert pickle.loads(pickle.dumps(params)) == params  # (rank 0 sends them to the ranks it started)
    with pytest.raises(TypeError, match="unhashable"):
        hash(params)  # (as vLLM's: a hash would change with its fields)


def test_sampling_params_clone_is_a_copy_of_its_own_as_vllms():
    """vLLM's SamplingParams.clone(), which scripts call to vary params made once per request (a seed each): an
    AttributeError here."""
    params = SamplingParams(temperature=0.7, max_tokens=5, stop=["x"])
    copied = params.clone()
    copied.seed = 3
    assert copied is not params and copied == SamplingParams(temperature=0.7, max_tokens=5, stop=["x"], seed=3)
    assert params.seed is None


def test_vllms_structured_outputs_and_guided_decoding_params_hold_the_output():
    """vLLM's structured outputs example: SamplingParams(structured_outputs=StructuredOutputsParams(choice=...)), its
    older guided_decoding=GuidedDecodingParams(regex=...), a JSON schema from a pydantic model. Each keyword was a
    TypeError here (the field is `structured`, a StructuredOutput), and the Params names did not exist."""
    pytest.importorskip("xgrammar")
    import json
    import re
    from typing import Literal

    import pydantic

    from tpgraph.engine.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    class Car(pydantic.BaseModel):  # (values the random model cannot run on with past max_tokens)
        brand: Literal["vw", "bmw"]
        doors: Literal[2, 4]

    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]), max_tokens=12)
    regex = SamplingParams(guided_decoding=GuidedDecodingParams(regex=r"[a-z]{3}@x\.com"), max_tokens=12)
    schema = SamplingParams(structured_outputs=StructuredOutputsParams(json=Car), temperature=0.0, max_tokens=40)
    assert choice.structured == StructuredOutput.choice(["Positive", "Negative"])
    assert schema.structured == StructuredOutput.json_schema(Car.model_json_schema())
    with engine() as e:
        outs = e.generate(["Classify: great!", "Mail:", "A car:"], [choice, regex, schema])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("Positive", "Negative") and re.fullmatch(r"[a-z]{3}@x\.com", texts[1])
    assert Car.model_validate(json.loads(texts[2]))


@pytest.mark.parametrize("kwargs, refusal", [
    (dict(structured_outputs=StructuredOutputsParams(regex="a"), guided_decoding=StructuredOutputsParams(regex="b")),
     "give one of structured_outputs, guided_decoding"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "give one of json, regex, choice, grammar and "
                                                               "json_object=True, got regex, choice"),
    (dict(structured_outputs={"json": {}, "whitespace_pattern": " "}), "whitespace_pattern is not taken"),
    (dict(guided_decoding={"json": {}, "backend": "outlines"}), "backend='outlines' is not taken"),
    (dict(structured_outputs={"json": {}, "disable_additional_properties": True}),
     "disable_additional_properties=True is not taken"),
    (dict(guided_decoding={"regex": "a", "backend": "guidance"}), "backend='guidance' is not taken"),
    (dict(structured_outputs="json"), "structured_outputs must be a StructuredOutput"),
    # a lone string (or a mapping) as the choice: it was iterated, a choice of "y", "e" and "s"
    (dict(structured_outputs={"choice": "yes"}), "a choice is a list of strings, got 'yes'"),
    (dict(guided_decoding={"choice": {"yes": 1}}), "a choice is a list of strings, got {'yes': 1}"),
    (dict(n=2, best_of=4), r"best_of=4 is not taken \(vLLM's V1 engine dropped it too\): ask n=4 samples with "
                           r"logprobs=0 and keep the 2 with the highest cumulative_logprob"),
])
def test_vllms_structured_outputs_options_and_best_of_are_refused_saying_why(kwargs, refusal):
    with pytest.raises(RequestError, match=refusal):
        SamplingParams(**kwargs)


def test_a_choice_given_as_a_set_is_read_alike_in_every_process():
    """Under torchrun each rank is a process of its own, whose str hashes are seeded apart. StructuredOutputsParams'
    choice was made a list in its process's own set order, so the generate check's digest of the parameters differed
    between ranks, refusing a call every rank made alike (as stop strings given as a set once did)."""
    from tpgtest.spmd import digests_across_hash_seeds

    params = ("[SamplingParams(structured_outputs=StructuredOutputsParams(choice={'Positive', 'Negative', "
              "'Neutral'})), SamplingParams(guided_decoding={'choice': frozenset({'yes', 'no', 'maybe'})})]")
    digests = digests_across_hash_seeds(params, seeds=(1, 2, 3, 4))  # (seeds whose set orders differ)
    assert len(digests) == 1


def test_vllms_names_leave_sampling_params_as_the_field_would():
    """They are read when made (not fields): equal to `structured` given alike, in repr (the SPMD check's digest),
    equality, pickling and dataclasses.replace; best_of equal to n is n's meaning in vLLM."""
    import dataclasses
    import pickle

    spec = StructuredOutput("regex", "[0-9]+")
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"}, n=2, best_of=2)
    assert params == SamplingParams(structured=spec, n=2) and repr(params) == repr(SamplingParams(structured=spec, n=2))
    assert pickle.loads(pickle.dumps(params)) == params
    assert dataclasses.replace(params, n=3).structured == spec and dataclasses.replace(params, structured=None) \
        == SamplingParams(n=2)


def test_vllms_structured_outputs_is_read_and_set_on_made_params_as_vllms():
    """Scripts written for vLLM set the output's form on params made earlier (`params.structured_outputs =
    StructuredOutputsParams(json=schema)`) and read it back (`if params.structured_outputs is None`): setting it was an
    AttributeError ("no field"), and reading it gave None whatever the params held. Both are `structured`, checked
    with the others as any field set is."""
    spec = StructuredOutputsParams(regex="[0-9]+")
    params = SamplingParams(max_tokens=4)
    assert params.structured_outputs is None and params.guided_decoding is None
    params.structured_outputs = spec
    assert params.structured == params.structured_outputs == params.guided_decoding == spec
    assert SamplingParams(structured_outputs=spec).structured_outputs == spec
    params.guided_decoding = {"choice": ["yes", "no"]}  # (vLLM's older name; a mapping of its fields, as when made)
    assert params.structured == StructuredOutput.choice(["yes", "no"])
    with pytest.raises(RequestError, match="structured_outputs must be a StructuredOutput"):
        params.structured_outputs = "json"
    params.min_tokens = 0
    with pytest.raises(RequestError, match="cannot be combined with ignore_eos or min_tokens"):
        SamplingParams(min_tokens=2).structured_outputs = spec
    assert params.structured == StructuredOutput.choice(["yes", "no"])  # (a refused value leaves it as it was)
    params.structured_outputs = None
    assert params.structured is None and params == SamplingParams(max_tokens=4)


def test_chat_takes_a_template_for_the_call_as_vllms_does():
    """vLLM's chat example passes chat_template=<the template's text> to LLM.chat: a TypeError here."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    chat = [{"role": "user", "content": "hi"}]
    with engine() as e:
        (out,) = e.chat(chat, GREEDY, chat_template=template)
        assert out.prompt == "<|begin_of_text|>[user] hi\n"
        assert out.prompt_token_ids == e.encode([256, *e.get_tokenizer().encode("[user] hi\n", False)])
        assert e.chat(chat, GREEDY)[0].prompt != out.prompt  # (the engine's own template is left as it was)
        with pytest.raises(RequestError, match="chat_template is a Jinja template's text, got int"):
            e.chat(chat, GREEDY, chat_template=3)



def test_chat_template_given_as_a_files_path_is_read_and_a_mistyped_one_refused(tmp_path):
    """chat(chat_template="templates/llama.jinja") rendered the path's text itself as the prompt of every conversation
    (no messages in it) and completed that: a file holding the template is read, as --chat-template reads it, and a
    text that is neither a file nor a template is refused, naming it."""
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    chat = [{"role": "user", "content": "hi"}]
    with engine() as e:
        assert e.chat(chat, GREEDY, chat_template=str(tmp_path / "t.jinja"))[0].prompt == "<|begin_of_text|>[user] hi\n"
        for mistyped in (str(tmp_path / "missing.jinja"), "tool_use"):
            with pytest.raises(RequestError, match=f"chat_template: the chat template '{re.escape(mistyped)}' is "
                                                   f"neither a file nor a template"):
                e.chat(chat, GREEDY, chat_template=mistyped)


def test_vllms_prompt_dicts_are_the_text_or_ids_they_hold():
    """vLLM's TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids}, alone or in a list (mixed with
    texts too), were refused here ("given here as the text or the token ids themselves"). Each output's prompt is the
    text, or None for ids, as vLLM's. A list of chat messages is still one conversation."""
    chat = [{"role": "user", "content": "hi"}]
    with engine() as e:
        ids = e.encode("hi")
        plain = e.generate(["hi", ids, chat], GREEDY)
        for prompts in ({"prompt": "hi"}, [{"prompt": "hi"}, {"prompt_token_ids": ids}, chat],
                        ("hi", {"prompt_token_ids": tuple(ids)}, chat)):
            out = e.generate(prompts, GREEDY)
            n = len(out)
            assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in out] \
                == [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in plain[:n]]
        for prompt, refusal in [({"prompt": "hi", "multi_modal_data": {}}, r"holds 'prompt' \(text\), "
                                 r"'prompt_token_ids' or both .*, got the keys \['multi_modal_data', 'prompt'\]"),
                                ({"prompt": "hi", "cache_salt": ""}, "cache_salt must be a non-empty string"),
                                ([{"prompt_token_ids": "hi"}], "prompt_token_ids must be a list of token ids, got str"),
                                ({"role": "user", "content": "hi"}, r"got dict \(chat messages are given as a list"),
                                ([{"role": "user", "content": "a"}, {"prompt": "b"}], "given to generate alone or in a "
                                 "list of prompts, not among chat messages")]:
            with pytest.raises(RequestError, match=refusal):
                e.generate(prompt, GREEDY)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_vllms_logprobs_of_every_token_are_refused_saying_the_limit(name):
    """vLLM's logprobs=-1 (every token's log-probability) was refused as any number out of range."""
    with pytest.raises(RequestError, match=rf"{name} must be between 0 and 20, got -1 \(vLLM's -1, every token's, is "
                                           r"not taken: at most 20 alternatives"):
        SamplingParams(**{name: -1})


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_vllms_logprobs_true_asks_for_one_alternative_as_vllms(name):
    """vLLM's SamplingParams reads logprobs=True (and prompt_logprobs=True) as 1: refused here as no integer."""
    assert getattr(SamplingParams(**{name: True}), name) == 1
    with pytest.raises(RequestError, match=rf"{name} must be an integer, got False"):
        SamplingParams(**{name: False})  # (no count: None asks for none)


def test_a_hub_id_is_its_cached_snapshot_as_the_servers_model_flag_reads_it(tmp_path, monkeypatch):
    """LLM("org/name", revision=..., download_dir=...): the snapshot in the hub's cache, as `--model` reads it
    (hub.py); one that is not on disk is refused naming the keyword and the command that fetches it."""
    from tpgraph.engine.config import vllm_keywords

    commits = {"main": "a" * 40, "v1": "b" * 40}
    cached = tmp_path / "hub" / "models--org--tiny"
    for ref, commit in commits.items():
        (cached / "snapshots" / commit).mkdir(parents=True)
        (cached / "refs").mkdir(exist_ok=True)
        (cached / "refs" / ref).write_text(commit)
    at = {ref: str(cached / "snapshots" / commit) for ref, commit in commits.items()}
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert vllm_keywords("org/tiny", 1, {}) == (at["main"], 1, {})
    assert vllm_keywords("org/tiny", 1, {"revision": "v1", "tokenizer_revision": "v1"}) == (
        at["v1"], 1, {"tokenizer": at["v1"]})
    monkeypatch.delenv("HF_HUB_CACHE")
    assert vllm_keywords("org/tiny", 1, {"download_dir": str(tmp_path / "hub")})[0] == at["main"]
    with pytest.raises(ConfigError, match=r"^model 'org/tiny' is not a directory, and the hub cache .* holds no "
                                          r"snapshot of it at revision 'v2'; tpgraph downloads nothing"):
        TPEngine("org/tiny", device="cpu", revision="v2", download_dir=str(tmp_path / "hub"))


def test_get_tokenizer_called_on_a_text_pair_refuses_it_as_it_refuses_text_pair_by_name():
    """transformers' tokenizer(text, text_pair) encodes the pair: the second text given by position here was taken as
    add_special_tokens, a TypeError from the tokenizers binding ("'str' object is not an instance of 'bool'") where
    text_pair=... is refused by name."""
    with engine() as e:
        tok = e.get_tokenizer()
    with pytest.raises(RequestError, match="text_pair"):
        tok("question", "answer")
    with pytest.raises(RequestError, match="text_pair"):
        tok("question", text_pair="answer")
    assert tok("question", add_special_tokens=False).input_ids == e.encode("question")[1:]


def test_chat_content_given_as_parts_or_none_is_its_text_as_vllms():
    """vLLM's LLM.chat reads a message's OpenAI content parts as their text, joined by newlines, and a null content
    as none (for a template that renders content as a string, as the server here reads them too). Offline, the parts'
    Python repr ("[{'type': 'text', ...}]") and the word "None" were rendered into the prompt, unsaid."""
    parts = [{"role": "system", "content": None},
             {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}]}]
    plain = [{"role": "system", "content": ""}, {"role": "user", "content": "a\nb\nc"}]
    with engine(max_model_len=128) as e:
        want = e.chat(plain, GREEDY)[0]
        for got in (e.chat(parts, GREEDY)[0], e.chat([parts], GREEDY)[0]):
            assert (got.prompt, got.prompt_token_ids) == (want.prompt, want.prompt_token_ids)
        assert e.generate(parts, GREEDY)[0].prompt_token_ids == want.prompt_token_ids
        assert parts[1]["content"][0] == {"type": "text", "text": "a"} and parts[0]["content"] is None  # (untouched)
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        with pytest.raises(RequestError, match=r"message content of type 'image_url' is not supported \(text only\)"):
            e.chat(image, GREEDY)


def test_chat_takes_its_conversations_by_vllms_name_and_use_tqdm_third():
    """vLLM's LLM.chat(messages, sampling_params, use_tqdm, ...): chat(messages=...) and chat(conv, params, False)
    were TypeErrors here (the argument was named conversations, use_tqdm given by name alone)."""
    chat = [{"role": "user", "content": "hi"}]
    with engine() as e:
        want = e.chat(chat, GREEDY)[0].outputs[0].token_ids
        assert e.chat(messages=chat, sampling_params=GREEDY)[0].outputs[0].token_ids == want
        assert e.chat(chat, GREEDY, False)[0].outputs[0].token_ids == want


def test_a_tokens_prompt_with_its_text_runs_the_ids_and_gives_the_text_as_vllms():
    """vLLM's TokensPrompt may hold the text its ids stand for ({"prompt_token_ids": ids, "prompt": text}): the ids
    are run and the output's prompt is that text. It was refused here as a dict of unknown keys."""
    with engine() as e:
        ids = e.encode("hi")
        want = e.generate({"prompt_token_ids": ids}, GREEDY)[0]
        for prompts in ({"prompt_token_ids": ids, "prompt": "hi"}, [{"prompt": "hi", "prompt_token_ids": ids}]):
            (out,) = e.generate(prompts, GREEDY)
            assert (out.prompt, out.prompt_token_ids, out.outputs[0].token_ids) \
                == ("hi", ids, want.outputs[0].token_ids)
        (other,) = e.generate({"prompt_token_ids": ids, "prompt": "not what the ids say"}, GREEDY)  # (as vLLM:
        assert (other.prompt, other.prompt_token_ids) == ("not what the ids say", ids)  # the ids are run)
        with pytest.raises(RequestError, match="prompt must be text, got int"):
            e.generate({"prompt_token_ids": ids, "prompt": 3}, GREEDY)


def test_use_tqdm_given_a_callable_makes_the_progress_bar_with_it_as_vllms():
    """vLLM's use_tqdm takes a callable (functools.partial(tqdm, leave=False), a notebook's tqdm) that makes the bar:
    here it was taken as True and the default bar drawn, the caller's ignored."""
    from tqdm import tqdm

    made = []

    def bar(*args, **kwargs):
        made.append(kwargs)
        return tqdm(*args, **{**kwargs, "disable": True})

    with engine() as e:
        e.generate(["a", "b"], GREEDY, use_tqdm=bar)
        e.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=bar)
    assert [m["total"] for m in made] == [2, 1]


def test_generate_and_chat_draw_a_progress_bar_unless_told_not_to_as_vllms(capsys):
    """vLLM's LLM.generate and LLM.chat default to use_tqdm=True (a bar on stderr); here the default was False, so a
    vLLM script's long run showed no progress."""
    with engine() as e:
        capsys.readouterr()
        e.generate(["a", "b"], GREEDY)
        e.chat([{"role": "user", "content": "hi"}], GREEDY)
        assert capsys.readouterr().err.count("2/2") >= 1
        e.generate(["a", "b"], GREEDY, use_tqdm=False)
        assert "2/2" not in capsys.readouterr().err


def test_lora_request_none_is_taken_and_an_adapter_refused_saying_what_to_do():
    """vLLM scripts pass lora_request=None to generate and chat: a TypeError here; an adapter is refused, named."""
    with engine() as e:
        (out,) = e.generate("Hi", GREEDY, lora_request=None)
        assert out.outputs[0].token_ids
        e.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=None)
        for call in (lambda: e.generate("Hi", GREEDY, lora_request=object()),
                     lambda: e.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=object())):
            with pytest.raises(RequestError, match="merge_and_unload"):
                call()


def test_a_lora_request_is_refused_where_every_rank_meets(monkeypatch):
    """Under torchrun a refusal must come at the call's one gather (TPEngine._agreed_call), where every rank meets:
    lora_request was refused before it, so a rank given one alone left the others waiting there until a timeout."""
    import types

    from tpgraph.engine import tp_engine

    seen = []
    monkeypatch.setattr(tp_engine, "gather_objects", lambda state, digest: seen.append(digest) or [digest, digest])
    with engine() as e:
        state, e.state = e.state, types.SimpleNamespace(world_size=2, is_driver=True)  # (as rank 0 of two)
        try:
            for call in (lambda: e.generate("Hi", GREEDY, lora_request=object()),
                         lambda: e.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=object())):
                seen.clear()
                with pytest.raises(RequestError, match="merge_and_unload"):
                    call()
                assert len(seen) == 1  # (the ranks met, then refused alike)
        finally:
            e.state = state


def test_reset_prefix_cache_is_checked_where_every_rank_meets(monkeypatch):
    """Under torchrun every rank forgets its own cached prefixes: a rank that reset alone (a script's `if rank == 0`)
    would then compute a prompt the others read from their caches, and the ranks step apart (other chunks, other
    collectives) with no word. The call meets the others at the one gather generate's check uses; where another rank
    made another call there, it is refused and nothing is forgotten."""
    import types

    from tpgraph.engine import tp_engine

    seen = []
    with engine() as e:
        e.generate("Hi, a prompt of a few blocks", GREEDY)
        cached = e.core.scheduler.allocator.num_cached_blocks
        state, e.state = e.state, types.SimpleNamespace(world_size=2, is_driver=True)  # (as rank 0 of two)
        try:
            monkeypatch.setattr(tp_engine, "gather_objects",
                                lambda state, digest: seen.append(digest) or [digest, "another call"])
            with pytest.raises(RequestError,
                               match=r"rank\(s\) \[1\] made another call than rank 0's reset_prefix_cache"):
                e.reset_prefix_cache()
            assert len(seen) == 1 and e.core.scheduler.allocator.num_cached_blocks == cached > 0
            monkeypatch.setattr(tp_engine, "gather_objects", lambda state, digest: [digest, digest])
            assert e.reset_prefix_cache() and e.core.scheduler.allocator.num_cached_blocks == 0
        finally:
            e.state = state


def test_a_max_tokens_past_max_model_len_runs_to_it_and_finishes_length_as_vllms_generate():
    """vLLM's generate runs a request whose max_tokens passes what its prompt leaves of max_model_len up to
    max_model_len (finish_reason "length"); it was refused, and with it the whole batch's results."""
    with engine() as e:  # (max_model_len 64)
        long_ask = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        short, cut = e.generate([[5, 6, 7], [5, 6, 7, 8, 9]], [GREEDY, long_ask])
        assert len(short.outputs[0].token_ids) == GREEDY.max_tokens
        assert len(cut.outputs[0].token_ids) == 64 - 5 and cut.outputs[0].finish_reason == "length"
        with pytest.raises(RequestError, match="min_tokens"):  # (a minimum that cannot be met is still refused)
            e.generate([[5, 6, 7]], SamplingParams(max_tokens=100, min_tokens=70))


def test_request_ids_count_from_0_across_calls_as_vllms():
    """vLLM's LLM.generate names its requests "0", "1", ... across calls (RequestOutput.request_id); they were
    "gen-0", ..."""
    with engine() as e:
        first = e.generate(["a", "b"], SamplingParams(max_tokens=1))
        (then,) = e.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))
    assert [o.request_id for o in [*first, then]] == ["0", "1", "2"]


def test_truncate_prompt_tokens_keeps_a_prompts_last_tokens_offline_as_the_server_does():
    """vLLM's SamplingParams.truncate_prompt_tokens offline: the prompt's last k tokens run, its text stays the output's
    prompt; a prompt too long for the context runs cut instead of being refused. It was refused here ("no
    truncate_prompt_tokens"), though the server took it."""
    long_text = "ab " * 60  # (well past max_model_len 64 in tokens)
    with engine() as e:
        ids = e.encode(long_text)
        assert len(ids) > 64
        with pytest.raises(RequestError, match="max_model_len"):
            e.generate([long_text], SamplingParams(max_tokens=2))
        (cut,) = e.generate([long_text], SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=10))
        (same,) = e.generate([ids[-10:]], SamplingParams(max_tokens=2, temperature=0.0))
        (chat,) = e.chat([{"role": "user", "content": long_text}],
                         SamplingParams(max_tokens=1, truncate_prompt_tokens=5))
        with pytest.raises(RequestError, match=r"truncate_prompt_tokens must be between 1 and 64 \(max_model_len\)"):
            e.generate(["hi"], SamplingParams(truncate_prompt_tokens=65))
    assert cut.prompt == long_text and cut.prompt_token_ids == ids[-10:]
    assert cut.outputs[0].token_ids == same.outputs[0].token_ids
    assert len(chat.prompt_token_ids) == 5
    for bad in (0, -2, 1.5, True):
        with pytest.raises(RequestError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_truncate_prompt_tokens_minus_one_offline_is_max_model_len_as_vllms_llm_reads_it():
    """vLLM's LLM (entrypoints/llm.py, _get_cmpl_tok_params) asks TokenizeParams for no room for output: -1 keeps
    max_model_len tokens whatever max_tokens, and a prompt cut to that is refused (v1 input_processor's
    _validate_prompt_len: no room for one token). It kept what left room for max_tokens; a prompt shorter than
    max_model_len runs as it is, cut to what it leaves."""
    with engine() as e:
        ids = e.encode("ab " * 60)
        assert len(ids) > 64
        with pytest.raises(RequestError, match="leaves no room to generate"):
            e.generate([ids], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))
        (short,) = e.generate([ids[:60]], SamplingParams(max_tokens=10, truncate_prompt_tokens=-1))
        (room,) = e.generate([ids], SamplingParams(max_tokens=4, truncate_prompt_tokens=60))
    assert short.prompt_token_ids == ids[:60] and len(short.outputs[0].token_ids) == 4
    assert room.prompt_token_ids == ids[-60:]


def test_vllms_top_level_names_are_importable_from_tpgraph():
    """A script importing vLLM's other top-level names (`from vllm import LLM, SamplingParams, TokensPrompt,
    RequestOutput`) ports by its import line alone: an ImportError here. TextPrompt and TokensPrompt make vLLM's prompt
    dicts; RequestOutput and CompletionOutput are the outputs' classes."""
    import tpgraph
    from tpgraph import CompletionOutput, RequestOutput, TextPrompt, TokensPrompt

    assert {"CompletionOutput", "RequestOutput", "TextPrompt", "TokensPrompt"} <= set(tpgraph.__all__)
    assert TokensPrompt(prompt_token_ids=[256, 104]) == {"prompt_token_ids": [256, 104]}
    with engine() as e:
        outs = e.generate([TextPrompt(prompt="hi"), TokensPrompt(prompt_token_ids=e.encode("hi"))], GREEDY)
    assert all(isinstance(o, RequestOutput) and isinstance(o.outputs[0], CompletionOutput) for o in outs)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids and [o.prompt for o in outs] == ["hi", None]


def test_vllms_torchrun_example_keywords_are_taken_where_they_mean_what_tpgraph_does(monkeypatch):
    """vLLM's torchrun example builds LLM(..., tensor_parallel_size=2, distributed_executor_backend=
    "external_launcher") on every rank (pipeline_parallel_size=1 beside it in later versions): tpgraph's own SPMD
    mode under torchrun, yet both were refused ("not taken: leave it out"). A backend or a size meaning something
    else (ray, a second pipeline stage, ranks launched outside a plain process) is still refused, saying what fits."""
    from tpgraph.engine.config import vllm_keywords

    spmd = {"tensor_parallel_size": 2, "distributed_executor_backend": "external_launcher", "pipeline_parallel_size": 1,
            "data_parallel_size": 1}
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert vllm_keywords(None, 1, dict(spmd)) == (None, 2, {})
    with pytest.raises(ConfigError, match=r"distributed_executor_backend='mp' \(vLLM's\) is not taken: .*under "
                                          r"torchrun .*'external_launcher'"):
        vllm_keywords(None, 2, {"distributed_executor_backend": "mp"})
    monkeypatch.delenv("WORLD_SIZE")
    assert vllm_keywords(None, 2, {"distributed_executor_backend": "mp"}) == (None, 2, {})
    assert vllm_keywords(None, 1, {"distributed_executor_backend": "uni"}) == (None, 1, {})
    for value in ("external_launcher", "ray"):
        with pytest.raises(ConfigError, match=rf"distributed_executor_backend={value!r} \(vLLM's\) is not taken: .*"
                                              r"'mp'"):
            vllm_keywords(None, 2, {"distributed_executor_backend": value})
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ConfigError, match=rf"{name}=2 \(vLLM's\) is not taken: {name} takes 1 alone \(tpgraph "
                                              r"shards by tensor parallelism alone"):
            vllm_keywords(None, 1, {name: 2})


def test_vllms_other_output_fields_and_chat_content_format_are_read_as_vllms_defaults():
    """A script reading vLLM's RequestOutput.metrics, lora_request, encoder_prompt(_token_ids) or kv_transfer_params,
    or CompletionOutput.lora_request, got an AttributeError: each is None, as vLLM's offline outputs hold them by
    default. chat's chat_template_content_format was a TypeError: "string" joins a message's text parts, "openai"
    lists them, "auto" lists them for a template that loops over them, as vLLM detects it."""
    template = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
                "{% for part in m.content %}P:{{ part.text }}{% endfor %}{% endif %}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    with engine() as e:
        (out,) = e.generate(["hi"], GREEDY)
        prompts = {form: e.chat(parts, GREEDY, chat_template=template, chat_template_content_format=form)[0].prompt
                   for form in ("string", "openai", "auto")}
        with pytest.raises(RequestError, match="chat_template_content_format must be one of auto, string, openai"):
            e.chat(parts, GREEDY, chat_template_content_format="parts")
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids,
            out.kv_transfer_params, out.outputs[0].lora_request) == (None,) * 6
    assert prompts == {"string": "S:a\nb", "openai": "P:aP:b", "auto": "P:aP:b"}


def test_a_pass_at_k_request_of_200_samples_runs_and_vllms_variable_caps_n(monkeypatch):
    """pass@k evaluations ask n = 200 samples of one prompt: refused past 128 here. vLLM takes up to its
    VLLM_MAX_N_SEQUENCES (16384 by default, which a public server lowers): read the same way here."""
    from tpgraph.errors import ConfigError

    with engine() as e:
        (out,) = e.generate(["def f():"], SamplingParams(n=200, temperature=1.0, seed=7, max_tokens=2,
                                                         ignore_eos=True))  # (two tokens each)
    assert len(out.outputs) == 200 and [c.index for c in out.outputs] == list(range(200))
    assert all(len(c.token_ids) == 2 for c in out.outputs) and len({tuple(c.token_ids) for c in out.outputs}) > 20
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "8")
    with pytest.raises(RequestError, match=r"n must be between 1 and 8, got 9 \(VLLM_MAX_N_SEQUENCES sets the most\)"):
        SamplingParams(n=9)
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "many")
    with pytest.raises(ConfigError, match="VLLM_MAX_N_SEQUENCES must be a positive integer"):
        SamplingParams(n=2)


def test_max_n_follows_the_variable_as_it_changes_and_refuses_a_bad_value_every_time(monkeypatch):
    """max_n parses each value of VLLM_MAX_N_SEQUENCES once (cached by the value): a new value is read as it is set,
    and a bad one, which nothing keeps, is refused on every call."""
    from tpgraph.engine.sampling_params import MAX_N_DEFAULT, max_n
    from tpgraph.errors import ConfigError

    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES", raising=False)
    assert max_n() == MAX_N_DEFAULT
    for value, most in (("8", 8), (" 3 ", 3), ("8", 8), ("", MAX_N_DEFAULT)):
        monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", value)
        assert max_n() == most
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "-1")
    for _ in range(2):
        with pytest.raises(ConfigError, match="VLLM_MAX_N_SEQUENCES must be a positive integer"):
            max_n()


def test_the_spmd_check_of_chat_tells_apart_the_content_formats(monkeypatch):
    """Under torchrun every rank renders its own chat prompt: chat_template_content_format picks whether a message's
    parts reach the template as a list or joined, so ranks calling with other formats render other prompts (other
    tokens, other lengths), and stepped apart with no word. The call's check compared every argument but it."""
    import types

    from tpgraph.engine import tp_engine

    seen = []
    monkeypatch.setattr(tp_engine, "gather_objects", lambda state, digest: seen.append(digest) or [digest, digest])
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    with engine() as e:
        state, e.state = e.state, types.SimpleNamespace(world_size=2, is_driver=True)  # (as rank 0 of two)
        try:
            for form in ("string", "openai"):
                e.chat(parts, GREEDY, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                       chat_template_content_format=form)
        finally:
            e.state = state
    assert len(seen) == 2 and seen[0] != seen[1]


def test_offline_chat_hands_earlier_tool_calls_to_the_template_as_the_server_and_vllm_do():
    """vLLM's LLM.chat prepares messages as its server does: an earlier call's arguments parsed from their JSON text
    (templates write them with tojson), an empty tool_calls list dropped. TPEngine.chat passed them as given: a
    template wrote the arguments as a quoted string, and took `tool_calls: []` for a turn of calls."""
    template = ("{% for m in messages %}{{ m.role }}:{% if 'tool_calls' in m %}CALLS{% for c in m.tool_calls %}"
                "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
                "{% endif %}|{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}

    def chat(calls):
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": calls}]

    with engine() as e:
        prompts = [e.chat(chat(calls), GREEDY, chat_template=template)[0].prompt
                   for calls in ([call], [{**call, "function": {"name": "f", "arguments": {"x": 1}}}], [],
                                 [{**call, "function": {"name": "f", "arguments": "{x"}}])]
    # (arguments that do not parse are {}, with a warning, as newest vLLM's _postprocess_messages coerces them)
    assert prompts == ['user:hi|assistant:CALLSf{"x": 1}|', 'user:hi|assistant:CALLSf{"x": 1}|',
                       "user:hi|assistant:ok|", "user:hi|assistant:CALLSf{}|"]


def test_tokenization_kwargs_are_read_as_vllms_generate_and_chat_read_them():
    """vLLM's generate and chat take tokenization_kwargs, overrides for the prompts' tokenization (TokenizeParams):
    add_special_tokens (False: a text prompt without its BOS; True: the chat's rendered text with one) and
    truncate_prompt_tokens (the prompt's last k tokens; a SamplingParams' own wins, as vLLM merges them). Each was a
    TypeError here ("unexpected keyword argument"); a key tpgraph does not read is refused, named."""
    chat = [{"role": "user", "content": "hi"}]
    cut_own = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=3)
    with engine() as e:
        ids = e.encode("hello there")
        assert e.generate("hello there", GREEDY, tokenization_kwargs=None)[0].prompt_token_ids == ids
        (bare,) = e.generate(["hello there"], GREEDY, tokenization_kwargs={"add_special_tokens": False})
        (cut,) = e.generate("hello there", GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 4})
        (own,) = e.generate("hello there", cut_own, tokenization_kwargs={"truncate_prompt_tokens": 4})
        want = e.chat(chat, GREEDY)[0].prompt_token_ids
        (chat_cut,) = e.chat(chat, GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 2})
        (chat_bos,) = e.chat(chat, GREEDY, tokenization_kwargs={"add_special_tokens": True})
        for kwargs, refusal in [({"padding": "max_length"}, r"tokenization_kwargs here take add_special_tokens and "
                                 r"truncate_prompt_tokens alone, got \['padding'\]"),
                                ({"add_special_tokens": 1}, "add_special_tokens must be True or False, got 1"),
                                ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
                                ([("add_special_tokens", False)],
                                 "tokenization_kwargs must be a dict or None, got list")]:
            with pytest.raises(RequestError, match=refusal):
                e.generate("hi", GREEDY, tokenization_kwargs=kwargs)
    assert (bare.prompt, bare.prompt_token_ids) == ("hello there", ids[1:])
    assert cut.prompt_token_ids == ids[-4:] and own.prompt_token_ids == ids[-3:]
    assert chat_cut.prompt_token_ids == want[-2:] and chat_bos.prompt_token_ids == [ids[0], *want]


def test_a_list_of_lora_requests_none_is_taken_as_vllms_generate_takes_it():
    """vLLM's generate takes lora_request as one or a list, one for each prompt (_validate_and_add_requests), so a
    script that picks each prompt's adapter passes [None, None] where it uses none: refused here as an adapter ("serves
    no LoRA adapters"). A list holding an adapter is still refused; one of another length is refused as vLLM's is."""
    with engine() as e:
        want = [o.outputs[0].token_ids for o in e.generate(["a", "b"], GREEDY)]
        assert [o.outputs[0].token_ids for o in e.generate(["a", "b"], GREEDY, lora_request=[None, None])] == want
        (chat,) = e.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request=(None,))
        assert chat.outputs[0].token_ids
        with pytest.raises(RequestError, match="merge_and_unload"):
            e.generate(["a", "b"], GREEDY, lora_request=[None, object()])
        with pytest.raises(RequestError, match=r"The lengths of prompts \(2\) and lora_request \(1\) must be the same"):
            e.generate(["a", "b"], GREEDY, lora_request=[None])


def test_reset_prefix_cache_takes_vllms_arguments():
    """vLLM's LLM.reset_prefix_cache(reset_running_requests=False, reset_connector=False): a TypeError here for
    either. Offline nothing runs while it acts (it waits for a generate call to end) and there is no KV connector, so
    either value forgets the cached prefixes alike; a value that is not True or False is refused, named."""
    with engine() as e:
        for kwargs in ({"reset_running_requests": True}, {"reset_connector": True}, {"reset_running_requests": False}):
            e.generate("Hi, a prompt of a few blocks", GREEDY)
            assert e.core.scheduler.allocator.num_cached_blocks > 0
            assert e.reset_prefix_cache(**kwargs) and e.core.scheduler.allocator.num_cached_blocks == 0
        e.generate("Hi, a prompt of a few blocks", GREEDY)
        assert e.reset_prefix_cache(True, False) and e.core.scheduler.allocator.num_cached_blocks == 0
        with pytest.raises(RequestError, match="reset_running_requests must be True or False, got 'yes'"):
            e.reset_prefix_cache(reset_running_requests="yes")


def test_vllms_async_scheduling_is_overlap_scheduling_and_an_unknown_keyword_is_refused_by_name():
    """LLM(async_scheduling=...) (vLLM's EngineArgs; the server's --async-scheduling) and any keyword EngineConfig
    has no field for were a bare TypeError from EngineConfig."""
    from tpgraph.engine.config import vllm_keywords

    assert vllm_keywords(None, 1, {"async_scheduling": False}) == (None, 1, {"overlap_scheduling": False})
    assert vllm_keywords(None, 1, {"async_scheduling": None}) == (None, 1, {})
    with pytest.raises(ConfigError, match=r"overlap_scheduling=True and async_scheduling=False differ"):
        vllm_keywords(None, 1, {"async_scheduling": False, "overlap_scheduling": True})
    with pytest.raises(ConfigError, match=r"async_scheduling must be True, False or None, got 'yes'"):
        vllm_keywords(None, 1, {"async_scheduling": "yes"})
    with pytest.raises(ConfigError, match=r"max_num_seq \(an unknown keyword\) is not taken: TPEngine takes "
                                          r".*max_num_seqs"):
        TPEngine(device="cpu", max_num_seq=4)


@pytest.mark.parametrize("name, value", [("tensor_parallel_size", "2"), ("tensor_parallel_size", 0),
                                         ("num_gpu_blocks_override", [1]), ("num_gpu_blocks_override", 0)])
def test_a_bad_value_under_vllms_name_is_refused_under_that_name(name, value):
    """LLM(tensor_parallel_size="2") was refused as "tp_size must be a positive integer", and
    num_gpu_blocks_override=0 as num_kv_blocks: names the script never wrote."""
    import re

    from tpgraph.engine.config import vllm_keywords

    with pytest.raises(ConfigError, match="^" + re.escape(f"{name} must be a positive integer, got {value!r}")):
        vllm_keywords(None, 1, {name: value})


def test_num_gpu_blocks_override_too_few_to_serve_is_refused_under_that_name():
    """LLM(num_gpu_blocks_override=1), or too few blocks for one sequence of max_model_len, was refused before the
    weights load, but as num_kv_blocks: a name the script never wrote."""
    from tpgraph.engine.config import vllm_keywords

    with pytest.raises(ConfigError, match=r"^num_gpu_blocks_override 1 leaves no block to use .* give "
                                          r"num_gpu_blocks_override 2 or more"):
        vllm_keywords(None, 1, {"num_gpu_blocks_override": 1})
    with pytest.raises(ConfigError, match=r"^max_model_len 64 needs .* only 48 fit .*raise num_gpu_blocks_override to "
                                          r"17 "):
        vllm_keywords(None, 1, {"num_gpu_blocks_override": 13, "max_model_len": 64, "block_size": 4})
    assert vllm_keywords(None, 1, {"num_gpu_blocks_override": 17, "max_model_len": 64, "block_size": 4})[2] == \
        {"num_kv_blocks": 17, "max_model_len": 64, "block_size": 4}
    # (a block_size or max_model_len of no count is EngineConfig's to refuse, under its own name)
    with pytest.raises(ConfigError, match=r"block_size must be a power of two"):
        TPEngine(device="cpu", num_gpu_blocks_override=13, block_size=3)


def test_a_kv_cache_dtype_naming_the_models_dtype_is_taken_and_another_refused():
    """vLLM takes kv_cache_dtype "bfloat16" (and "float16"): the cache in that dtype. Here it was refused even where it
    is the model's own dtype, which is what the cache holds; that name is now taken, and another refused before the
    weights load, naming the model's (the built-in model runs float32 on CPU)."""
    with engine(kv_cache_dtype="float32") as e:
        assert e.config.kv_cache_dtype == "float32" and e.runner.dtype is torch.float32
    with pytest.raises(ConfigError, match=r"^kv_cache_dtype='bfloat16' is not the model's dtype \(float32\)"):
        engine(kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8' .*no fp8 cache"):
        engine(kv_cache_dtype="fp8")
