import json
import re

import pytest
import torch

from tpgraph.config import BUILTIN_MODEL, ModelConfig, RopeConfig, torch_dtype_name
from tpgraph.errors import CheckpointError, ConfigError
from tpgraph.model.loader import parse_dtype

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "rms_norm_eps": 1e-5,
    "rope_scaling": None, "max_position_embeddings": 4096, "eos_token_id": 2,
}

# the fields config.json must have; every other one takes its default
MINIMAL = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2}


def test_llama31_config_transformers4_layout():
    cfg = ModelConfig.from_hf_dict(LLAMA31_8B)
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 128
    assert cfg.rope == RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert cfg.eos_token_id == (128001, 128008, 128009)


def test_transformers5_rope_parameters_layout():
    d = dict(LLAMA31_8B)
    d.pop("rope_theta")
    d["rope_parameters"] = {**d.pop("rope_scaling"), "rope_theta": 500000.0}
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_hf_dict(LLAMA31_8B)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    """A config.json with both (a transformers 5 config whose rope_scaling was edited, say, to extend the context):
    transformers reads rope_scaling (with the top-level rope_theta), so the model must too."""
    import copy

    from transformers import LlamaConfig

    d = {**MINIMAL, "rope_theta": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    hf = LlamaConfig.from_dict(copy.deepcopy(d)).rope_parameters
    assert (hf["rope_type"], hf["factor"], hf["rope_theta"]) == ("linear", 4.0, 20000.0)
    assert ModelConfig.from_hf_dict(d).rope == RopeConfig(theta=20000.0, type="linear", factor=4.0,
                                                          original_max_position_embeddings=2048)


def test_llama2_defaults():
    cfg = ModelConfig.from_hf_dict(LLAMA2_7B)
    assert cfg.num_key_value_heads == 32 and cfg.rope.type == "default" and cfg.rope.theta == 10000.0
    assert cfg.eos_token_id == (2,)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_sizes_that_work(tp):
    ModelConfig.from_hf_dict(LLAMA31_8B).check_tp(tp)


def test_heads_not_divisible_by_tp():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(32\) is not divisible by the tensor-parallel "
                                          r"size \(3\)"):
        ModelConfig.from_hf_dict(LLAMA31_8B).check_tp(3)


def test_kv_heads_and_tp_must_divide():
    d = {**LLAMA31_8B, "num_attention_heads": 24, "num_key_value_heads": 6, "intermediate_size": 14400}
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_hf_dict(d).check_tp(4)


def test_unsupported_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture.*Qwen3MoeForCausalLM"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(ConfigError, match="unsupported architecture.*model_type='gemma'"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "model_type": "gemma"})


@pytest.mark.parametrize("archs,model_type", [(["Qwen2ForCausalLM"], "llama"), (["LlamaForCausalLM"], "qwen2"),
                                              (["Qwen2ForCausalLM"], None), (["MistralForCausalLM"], "qwen2")])
def test_an_architecture_and_model_type_that_do_not_go_together_are_refused(archs, model_type):
    """transformers builds a model_type's own model: Qwen2's q, k and v carry biases a Llama's do not, so a config
    naming one with the other's model_type would run neither as trained."""
    doc = {**LLAMA2_7B, "architectures": archs}
    doc = doc if model_type is None else {**doc, "model_type": model_type}
    with pytest.raises(ConfigError, match=r"names architecture .* with model_type .*: the two do not go together"):
        ModelConfig.from_hf_dict(doc)


def test_an_architecture_without_a_model_type_is_refused_saying_the_config_names_none():
    """A Qwen2ForCausalLM config that leaves model_type out was refused as one naming model_type 'llama', which it
    does not: the message says it names none."""
    with pytest.raises(ConfigError, match=r"names architecture \['Qwen2ForCausalLM'\] with model_type 'llama' \(its "
                                          r"default: config.json names none\)"):
        ModelConfig.from_hf_dict({**MINIMAL, "architectures": ["Qwen2ForCausalLM"]})


QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct's config.json, as the hub holds it
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}


def test_a_qwen2_config_reads_as_transformers_reads_it():
    """Qwen2ForCausalLM: biases on q, k and v (none on o or the MLP); the window its configs name is unused unless
    use_sliding_window (transformers' Qwen2Config drops it), so it neither caps the context nor is refused."""
    cfg = ModelConfig.from_hf_dict(QWEN25_7B)
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias) == (True, False, False)
    assert (cfg.sliding_window, cfg.max_context, cfg.head_dim, cfg.rope.theta) == (None, 32768, 128, 1e6)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.rms_norm_eps) == (151643, (151645,), 1e-6)
    # absent fields take Qwen2Config's defaults (no bos or eos, a 32768 context), not LlamaConfig's
    bare = {k: v for k, v in QWEN25_7B.items() if k not in ("bos_token_id", "eos_token_id", "max_position_embeddings",
                                                            "architectures")}
    cfg = ModelConfig.from_hf_dict(bare)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings, cfg.qkv_bias) == (None, (), 32768, True)
    with pytest.raises(ConfigError, match="config.json sets sliding_window=131072, which tpgraph does not implement"):
        ModelConfig.from_hf_dict({**QWEN25_7B, "use_sliding_window": True, "max_window_layers": 21})
    capped = ModelConfig.from_hf_dict({**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096,
                                       "max_window_layers": 21}, disable_sliding_window=True)
    assert capped.max_context == 4096


QWEN3_8B = {  # Qwen/Qwen3-8B's config.json, as the hub holds it
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_a_qwen3_config_reads_as_transformers_reads_it():
    """Qwen3ForCausalLM: a norm over each head of q and k; attention_bias on q, k, v and o (none on the MLP, whatever
    mlp_bias says); absent fields take Qwen3Config's defaults (a head_dim of 128, not hidden / heads)."""
    cfg = ModelConfig.from_hf_dict(QWEN3_8B)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias) == (True, False, False, False)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.max_context, cfg.eos_token_id) == (128, 8, 40960, (151645,))
    cfg = ModelConfig.from_hf_dict({**QWEN3_8B, "attention_bias": True, "mlp_bias": True})
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias) == (True, True, False)
    bare = {k: v for k, v in QWEN3_8B.items() if k not in ("head_dim", "hidden_size", "sliding_window")}
    assert ModelConfig.from_hf_dict({**bare, "hidden_size": 2048}).head_dim == 128  # (2048 / 32 would be 64)
    assert not ModelConfig.from_hf_dict(LLAMA2_7B).qk_norm
    with pytest.raises(ConfigError, match="names architecture .*Qwen3ForCausalLM.* with model_type 'qwen2'"):
        ModelConfig.from_hf_dict({**QWEN3_8B, "model_type": "qwen2"})


@pytest.mark.parametrize("fields,slides", [
    ({"use_sliding_window": True, "max_window_layers": 28}, False),  # every layer below max_window_layers
    ({"use_sliding_window": True, "max_window_layers": 40}, False),
    ({"use_sliding_window": True, "max_window_layers": 20}, True),
    ({"use_sliding_window": True, "sliding_window": None}, False),
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 28}, False),
    ({"use_sliding_window": True, "max_window_layers": 40, "layer_types": ["sliding_attention"] * 28}, True),
    ({"use_sliding_window": False, "layer_types": ["sliding_attention"] * 28}, False),  # no window to slide with
])
def test_a_qwen_window_counts_only_where_a_layer_uses_it(fields, slides):
    """As Qwen2Config and Qwen3Config decide it: a window applies to the layers from max_window_layers on (or those
    layer_types names sliding), and only with use_sliding_window; a config whose layers all attend in full runs as one
    without a window (it was refused), and one with a sliding layer is refused, naming the window and the flag."""
    for base in (QWEN25_7B, {**QWEN3_8B, "num_hidden_layers": 28}):
        doc = {**base, "sliding_window": 4096, **fields}
        if slides:
            with pytest.raises(ConfigError, match="sliding_window=4096, .*--disable-sliding-window"):
                ModelConfig.from_hf_dict(doc)
            assert ModelConfig.from_hf_dict(doc, disable_sliding_window=True).max_context == 4096
        else:
            cfg = ModelConfig.from_hf_dict(doc)
            assert cfg.sliding_window is None and cfg.max_context == base["max_position_embeddings"]


def test_layer_types_other_than_full_attention_are_refused():
    """transformers 5 writes layer_types; a sliding layer among them ran as a full one, unsaid."""
    assert ModelConfig.from_hf_dict({**LLAMA2_7B, "layer_types": ["full_attention"] * 32}).vocab_size == 32000
    with pytest.raises(ConfigError, match=r"layer_types with \['sliding_attention'\]: only full attention"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "layer_types": ["full_attention", "sliding_attention"] * 16})


def test_a_mistral_config_takes_mistral_defaults_and_its_sliding_window_is_refused():
    """Absent fields of a model_type mistral config.json take MistralConfig's defaults, not LlamaConfig's: 8 KV heads,
    a 131072 context, and a sliding window of 4096, which is refused (as it is where config.json sets it)."""
    mistral = {**MINIMAL, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_attention_heads": 16,
               "hidden_size": 64}
    with pytest.raises(ConfigError, match="config.json leaves out sliding_window, so model_type 'mistral' "
                                          "takes its default of 4096, which tpgraph does not implement"):
        ModelConfig.from_hf_dict(mistral)
    with pytest.raises(ConfigError, match="config.json sets sliding_window=4096"):
        ModelConfig.from_hf_dict({**mistral, "sliding_window": 4096})
    cfg = ModelConfig.from_hf_dict({**mistral, "sliding_window": None})
    assert (cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.head_dim) == (8, 131072, 4)
    # (a null one is the head count, as transformers 4's MistralConfig reads it)
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None, "num_key_value_heads": None,
                                     "max_position_embeddings": 4096}).num_key_value_heads == 16


def test_a_sliding_window_is_taken_as_a_context_cap_under_disable_sliding_window():
    """vLLM's disable_sliding_window caps the context at the window (full attention within it is the window's), and
    a window wider than the context changes nothing."""
    mistral = {**MINIMAL, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_key_value_heads": 2,
               "max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf_dict(mistral, disable_sliding_window=True)
    assert (cfg.sliding_window, cfg.max_context) == (4096, 4096)
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": 65536}, disable_sliding_window=True).max_context == \
        32768
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None}, disable_sliding_window=True).sliding_window \
        is None
    with pytest.raises(ConfigError, match="config field sliding_window must be >= 1, got 0"):
        ModelConfig.from_hf_dict({**mistral, "sliding_window": 0}, disable_sliding_window=True)


def test_a_qwen2_config_without_num_key_value_heads_takes_qwen2configs_32():
    """Qwen2Config's default is 32 KV heads, not LlamaConfig's one per attention head: a 64-head config that leaves the
    field out is GQA over 32 heads in transformers (k and v of 32 heads' rows), which ran as 64 and was refused at the
    load as a checkpoint of other shapes. An explicit null is still one per attention head, as transformers reads it."""
    bare = {k: v for k, v in QWEN25_7B.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf_dict({**bare, "num_attention_heads": 64, "hidden_size": 8192}).num_key_value_heads == 32
    assert ModelConfig.from_hf_dict({**bare, "num_key_value_heads": None}).num_key_value_heads == 28


def test_a_qwen2_window_switched_on_without_its_size_takes_qwen2configs_4096():
    """use_sliding_window with no sliding_window field is Qwen2Config's 4096 window (transformers and vLLM read it so):
    disable_sliding_window caps the context at it, as it does a window the config names (it ran uncapped, over a 32k
    context, its sliding layers attending past their window); without the flag the refusal says where the window came
    from."""
    bare = {k: v for k, v in QWEN25_7B.items() if k not in ("sliding_window", "max_window_layers")}
    on = {**bare, "use_sliding_window": True, "num_hidden_layers": 32}  # (layers 28-31 past max_window_layers)
    assert ModelConfig.from_hf_dict(on, disable_sliding_window=True).max_context == 4096
    with pytest.raises(ConfigError, match="leaves out sliding_window, so model_type 'qwen2' takes its default of 4096"):
        ModelConfig.from_hf_dict(on)
    assert ModelConfig.from_hf_dict(bare).max_context == 32768  # (switched off: no window, whatever its default)


def test_sliding_layers_in_layer_types_are_taken_under_disable_sliding_window_and_refused_with_its_hint():
    """A window transformers 5 writes out as layer_types (a Qwen2 with use_sliding_window, max_window_layers below
    the depth) is the window disable_sliding_window runs as full attention, as vLLM's flag does (it ran before
    layer_types were read); without the flag the refusal names the window and the flag, not layer_types alone."""
    qwen = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 14,
            "layer_types": ["full_attention"] * 14 + ["sliding_attention"] * 14}
    assert ModelConfig.from_hf_dict(qwen, disable_sliding_window=True).max_context == 4096
    mistral = {**MINIMAL, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_key_value_heads": 2,
               "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]}
    assert ModelConfig.from_hf_dict(mistral, disable_sliding_window=True).max_context == 4096
    with pytest.raises(ConfigError, match="sets sliding_window=4096.*--disable-sliding-window"):
        ModelConfig.from_hf_dict(qwen)
    with pytest.raises(ConfigError, match=r"layer_types with \['chunked_attention'\]"):
        ModelConfig.from_hf_dict({**qwen, "layer_types": ["chunked_attention"] * 28}, disable_sliding_window=True)


def test_a_llamas_biases_follow_attention_bias_and_mlp_bias():
    """As transformers' LlamaForCausalLM builds them: attention_bias on q, k, v and o, mlp_bias on gate, up and down
    (they were refused); Mistral's code builds none whatever its config says; a field not true or false is refused."""
    def biases(**fields):
        cfg = ModelConfig.from_hf_dict({**LLAMA2_7B, **fields})
        return cfg.qkv_bias, cfg.o_proj_bias, cfg.mlp_bias

    assert biases() == biases(attention_bias=False, mlp_bias=None) == (False, False, False)
    assert biases(attention_bias=True) == (True, True, False)
    assert biases(mlp_bias=True) == (False, False, True)
    assert biases(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None,
                  attention_bias=True) == (False, False, False)
    with pytest.raises(ConfigError, match="attention_bias must be true or false, got 'yes'"):
        biases(attention_bias="yes")


def test_unsupported_rope_type():
    with pytest.raises(ConfigError, match="rope_scaling type 'dynamic' is not supported; tpgraph supports default, "
                                          "linear, llama3, yarn"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    # (a transformers 5 config.json holds rope_parameters: the refusal named rope_scaling, which it does not have)
    with pytest.raises(ConfigError, match="config.json rope_parameters type 'dynamic' is not supported"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ConfigError, match="config.json rope_parameters of type 'linear' needs factor"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}})


@pytest.mark.parametrize("rope,missing", [({"rope_type": "linear"}, "factor"), ({"rope_type": "yarn"}, "factor"),
                                          ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
                                           "low_freq_factor")])
def test_a_scaled_rope_without_its_factors_is_refused_by_name(rope, missing):
    """transformers refuses these too; the defaults would silently make another rope."""
    with pytest.raises(ConfigError, match=f"rope_scaling of type {rope['rope_type']!r} needs {missing}"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "rope_scaling": rope})


def test_a_rope_over_part_of_each_head_is_refused():
    for cfg in ({**LLAMA2_7B, "partial_rotary_factor": 0.5},
                {**LLAMA2_7B, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}):
        with pytest.raises(ConfigError, match="partial_rotary_factor"):
            ModelConfig.from_hf_dict(cfg)
    ModelConfig.from_hf_dict({**LLAMA2_7B, "partial_rotary_factor": 1.0})


def test_missing_field():
    d = dict(LLAMA2_7B)
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size'"):
        ModelConfig.from_hf_dict(d)


def test_from_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist$"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert ModelConfig.from_dir(tmp_path).vocab_size == 32000


def test_a_hugging_face_id_for_a_model_says_nothing_is_downloaded():
    """vLLM's LLM(model="meta-llama/Llama-3.2-1B-Instruct") downloads the checkpoint; here it said only that no such
    directory exists."""
    with pytest.raises(CheckpointError, match=r"'meta-llama/Llama-3.2-1B-Instruct' does not exist \(a Hugging Face "
                                              r"hub id\? tpgraph loads a local checkpoint and downloads nothing: `hf "
                                              r"download meta-llama/Llama-3.2-1B-Instruct --local-dir DIR`"):
        ModelConfig.from_dir("meta-llama/Llama-3.2-1B-Instruct")


def test_builtin_model_splits_over_common_tp_sizes():
    for tp in (1, 2, 4):
        BUILTIN_MODEL.check_tp(tp)


def test_parse_dtype():
    with pytest.raises(ConfigError, match="unknown dtype"):
        parse_dtype("int4")
    assert parse_dtype("float") is parse_dtype("float32") and parse_dtype("half") is torch.float16  # (vLLM's names)
    # (the names checked without torch, as the command line and EngineConfig check them)
    assert torch_dtype_name("bf16") == "bfloat16" and torch_dtype_name(torch.half) == "float16"


@pytest.mark.parametrize("field,value", [("sliding_window", 4096), ("use_sliding_window", True),
                                         ("attn_logit_softcapping", 50.0),
                                         ("quantization_config", {"quant_method": "fp8"})])
def test_unimplemented_fields_are_refused_by_name(field, value):
    base = MINIMAL
    with pytest.raises(ConfigError, match=f"config.json sets {field}="):
        ModelConfig.from_hf_dict({**base, field: value})
    assert ModelConfig.from_hf_dict({**base, "sliding_window": None, "pretraining_tp": 1}).vocab_size == 10


def test_pretraining_tp_is_read_as_transformers_reads_it():
    """pretraining_tp (a Llama 2 field) only split transformers' matmuls into slices whose results it joined: the same
    model at any value (transformers 5 does not read it). It was refused as if it changed the results."""
    transformers = pytest.importorskip("transformers")
    import torch

    logits = []
    for tp in (1, 2):
        torch.manual_seed(0)
        hf_cfg = transformers.LlamaConfig(**{**MINIMAL, "vocab_size": 32, "hidden_size": 16, "num_attention_heads": 4,
                                             "intermediate_size": 32, "pretraining_tp": tp})
        with torch.no_grad():
            logits.append(transformers.LlamaForCausalLM(hf_cfg).eval()(torch.tensor([[1, 5, 7]])).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert ModelConfig.from_hf_dict({**MINIMAL, "pretraining_tp": 2}) == ModelConfig.from_hf_dict(MINIMAL)


def test_absent_fields_take_transformers_llama_defaults():
    """A hand-written config.json without these fields means what LlamaConfig says they default to."""
    base = MINIMAL
    cfg = ModelConfig.from_hf_dict(base)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_id) == (1e-6, 2048, 1, (2,))
    assert ModelConfig.from_hf_dict({**base, "eos_token_id": None}).eos_token_id == ()


@pytest.mark.parametrize("bad", [{"num_attention_heads": None}, {"num_attention_heads": "4x"},
                                 {"num_attention_heads": 0}, {"eos_token_id": ["two"]}, {"eos_token_id": True},
                                 {"bos_token_id": "x"}])
def test_a_field_of_the_wrong_type_is_a_config_error(bad):
    base = MINIMAL
    with pytest.raises(ConfigError, match="wrong type or value"):
        ModelConfig.from_hf_dict({**base, **bad})


@pytest.mark.parametrize("field", ["num_key_value_heads", "head_dim"])
def test_a_zero_head_count_or_width_is_refused_by_name(field):
    """0 (transformers fails on it) was read through `or` as absent: the model ran as MHA / hidden // heads."""
    with pytest.raises(ConfigError, match=f"config field {field} must be >= 1, got 0"):
        ModelConfig.from_hf_dict({**MINIMAL, field: 0})
    assert ModelConfig.from_hf_dict({**MINIMAL, field: None}) == ModelConfig.from_hf_dict(MINIMAL)


@pytest.mark.parametrize("value", ["false", 0, "true"])
def test_tie_word_embeddings_must_be_a_json_bool(value):
    """bool("false") is True: a tied model ran for a config that says untied (transformers refuses a string)."""
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false"):
        ModelConfig.from_hf_dict({**MINIMAL, "tie_word_embeddings": value})
    assert ModelConfig.from_hf_dict({**MINIMAL, "tie_word_embeddings": None}).tie_word_embeddings is False


@pytest.mark.parametrize("bad", [{"vocab_size": 100.7}, {"hidden_size": 8.5}, {"num_attention_heads": True},
                                 {"intermediate_size": "16"}, {"num_key_value_heads": 1.9}])
def test_a_count_that_is_not_an_integer_is_refused(bad):
    """int() cut 100.7 to 100 and read true as 1 head: another model than config.json says (transformers refuses)."""
    with pytest.raises(ConfigError, match=f"{next(iter(bad))} must be an integer"):
        ModelConfig.from_hf_dict({**MINIMAL, **bad})


def test_a_config_that_is_not_an_object_or_not_text_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_a_clear_config_error_keeps_its_own_words():
    with pytest.raises(ConfigError, match="^config.json rope_scaling type 'dynamic' is not supported"):
        ModelConfig.from_hf_dict({**LLAMA2_7B, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})


def test_swish_is_silu_and_other_activations_are_refused():
    """transformers' ACT2FN maps "swish" to SiLU, as "silu": both run; any other activation is refused by name."""
    assert ModelConfig.from_hf_dict({**MINIMAL, "hidden_act": "swish"}) == ModelConfig.from_hf_dict(MINIMAL)
    with pytest.raises(ConfigError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_hf_dict({**MINIMAL, "hidden_act": "gelu"})


@pytest.mark.parametrize("value", [0, -4])
def test_a_context_of_no_positions_is_refused_by_name(value):
    """max_position_embeddings sizes the rope tables and the default context: 0 failed while the engine was built as
    "buffer 'block_tables': row_shape must hold positive integers", and -4 as a torch.arange traceback."""
    with pytest.raises(ConfigError, match=f"config field max_position_embeddings must be >= 1, got {value}"):
        ModelConfig.from_hf_dict({**MINIMAL, "max_position_embeddings": value})


@pytest.mark.parametrize("shape", [{"head_dim": 33}, {"hidden_size": 66, "num_attention_heads": 2}])
def test_an_odd_head_dim_is_refused_by_name(shape):
    """Rotary embeddings rotate channel pairs (transformers refuses an odd head_dim): one of 33 was accepted, and the
    engine failed on its first forward with "The size of tensor a (33) must match the size of tensor b (34)"."""
    with pytest.raises(ConfigError, match="head_dim must be even"):
        ModelConfig.from_hf_dict({**MINIMAL, **shape})


@pytest.mark.parametrize("rope", [{"rope_theta": 0}, {"rope_theta": -1.0}, {"rope_theta": True},
                                  {"rope_scaling": {"rope_type": "linear", "factor": 0}},
                                  {"rope_scaling": {"rope_type": "linear", "factor": "2"}},
                                  {"rope_scaling": {"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0}}])
def test_a_rope_scale_of_zero_or_less_is_refused_by_name(rope):
    """A linear factor of 0 made every frequency inf (a theta of 0 or less, NaN), and the model ran on them and gave
    garbage; true read as a theta of 1 and "2" as a factor of 2 (transformers fails on a string)."""
    name = "rope_theta" if "rope_theta" in rope else "factor"
    with pytest.raises(ConfigError, match=f"config.json rope {name} must be a number > 0"):
        ModelConfig.from_hf_dict({**MINIMAL, **rope})
    # a default rope ignores its factor, as transformers does
    assert ModelConfig.from_hf_dict({**MINIMAL, "rope_scaling": {"rope_type": "default", "factor": 0}})


@pytest.mark.parametrize("low, high", [(0, 4.0), (-1.0, 4.0), (1.0, 0), (1.0, True), (None, 4.0)])
def test_a_llama3_rope_frequency_factor_of_zero_or_less_is_refused_by_name(low, high):
    """A llama3 low_freq_factor of 0 was taken and failed as a ZeroDivisionError traceback on every rank while the
    model was built; one below 0 (or a bool read as 1) made another rope, unsaid. Refused as the factor is."""
    name = "low_freq_factor" if low is None or not (isinstance(low, float) and low > 0) else "high_freq_factor"
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low, "high_freq_factor": high}
    match = f"needs {name}" if low is None else f"config.json rope {name} must be a number > 0"
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({**MINIMAL, "rope_scaling": rope})


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.float8_e4m3fn])
def test_a_torch_dtype_the_model_does_not_run_in_is_refused_before_the_weights_load(dtype):
    """TPEngine(dtype=torch.int8) (vLLM takes a torch.dtype too) loaded the weights as int8 and failed in the first
    matmul ("expected scalar type Float but found Char"); a float64 or float8 model ran where its kernels do not."""
    from tpgraph.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=rf"dtype {dtype} is not one tpgraph runs in; choose torch.bfloat16, "
                                          rf"torch.float16 or torch.float32"):
        EngineConfig(dtype=dtype)
    for taken in (torch.bfloat16, torch.float16, torch.float32):
        assert EngineConfig(dtype=taken).dtype is taken and parse_dtype(taken) is taken


@pytest.mark.parametrize("dtype", [["bf16"], {"name": "bf16"}])
def test_a_dtype_that_is_no_name_is_refused_by_name_not_as_a_type_error(dtype):
    """TPEngine(dtype=["bf16"]) (a list, a dict) ended in a bare TypeError (unhashable type) from EngineConfig."""
    from tpgraph.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=r"unknown dtype .*; choose one of"):
        EngineConfig(dtype=dtype)


@pytest.mark.parametrize("value,length", [("1", 40), ("true", 48), ("True", 56), (" 1 ", 64)])
def test_a_max_model_len_past_the_context_is_allowed_by_vllms_variable(monkeypatch, caplog, value, length):
    """vLLM refuses a max_model_len past the model's context unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set ("1" or
    "true"), and then warns (once). It was refused whatever the variable said, and the message did not name it."""
    import tpgraph.config

    # (said once a process: another test's engine at the same length, in this worker, must not have said it already)
    tpgraph.config._warn_once.cache_clear()
    cfg = ModelConfig.from_hf_dict({**MINIMAL, "max_position_embeddings": 32})
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ConfigError, match=rf"max_model_len {length} exceeds the model's max_position_embeddings "
                                          rf"\(32\); to allow it, set the environment variable "
                                          rf"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        cfg.check_max_model_len(length)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", value)
    with caplog.at_level("WARNING", logger="tpgraph.config"):
        cfg.check_max_model_len(length)
        cfg.check_max_model_len(length)  # (the engine checks it twice: said once)
    assert caplog.text.count(f"max_model_len {length} exceeds the model's max_position_embeddings (32)") == 1
    cfg.check_max_model_len(32)  # (within the context: nothing to allow)


@pytest.mark.parametrize("value", ["0", "false", "", "yes"])
def test_vllms_long_max_model_len_variable_off_keeps_the_refusal(monkeypatch, value):
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", value)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        ModelConfig.from_hf_dict({**MINIMAL, "max_position_embeddings": 32}).check_max_model_len(33)


def test_the_checkpoints_dtype_is_read_under_transformers_name_before_the_legacy_one():
    """transformers (4.56 on) writes "dtype" and reads it over a legacy "torch_dtype" where a config has both (one
    edited, the other left over), and vLLM's dtype "auto" takes what transformers reads. The legacy one won here."""
    from transformers import LlamaConfig

    both = {**MINIMAL, "torch_dtype": "float32", "dtype": "float16"}
    assert LlamaConfig.from_dict(dict(both)).dtype is torch.float16
    assert ModelConfig.from_hf_dict(both).torch_dtype == "float16"
    assert ModelConfig.from_hf_dict({**MINIMAL, "torch_dtype": "float16"}).torch_dtype == "float16"
    assert ModelConfig.from_hf_dict({**MINIMAL, "dtype": "float16"}).torch_dtype == "float16"


def test_a_directory_of_metas_or_mistrals_own_format_is_named_as_such(tmp_path):
    """A Hugging Face repo's original/ folder (Meta's consolidated.00.pth and params.json), or Mistral's own format,
    was refused as "no config.json in ...: is this a Hugging Face checkpoint?", which it is not, beside the one
    that is."""
    original = tmp_path / "original"
    original.mkdir()
    (original / "params.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds params.json, not config.json: a checkpoint in Meta's or "
                                              r"Mistral's own format .*not read here") as refused:
        ModelConfig.from_dir(original)
    assert "parent" not in str(refused.value)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    parent = re.escape(repr(str(tmp_path)))
    with pytest.raises(CheckpointError, match=rf"the Hugging Face checkpoint beside it is its parent, {parent}$"):
        ModelConfig.from_dir(original)
    (original / "params.json").unlink()
    with pytest.raises(CheckpointError, match=rf"no config.json in .*; its parent, {parent}, has one$"):
        ModelConfig.from_dir(original)
