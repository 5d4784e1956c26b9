"""A small checkpoint as users have them: config.json, a real tokenizer.json with special tokens, a Llama-3-style
chat template in tokenizer_config.json and a generation_config.json. Built here; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from tpgraph.tokenizer import _byte_to_unicode

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS_ID, EOS_ID, EOT_ID = 256, 257, 260
THINK_ID, END_THINK_ID = 261, 262  # (think_tokens)
TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system = messages[0]['content'] %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = 'You are a helpful assistant.' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('only user and assistant messages may follow the system message') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def make_chat_checkpoint(path: Path, think_tokens: bool = False) -> Path:
    """think_tokens: <think> and </think> as added (not special) tokens, as DeepSeek-R1's Llama distillations have
    them (ids THINK_ID and END_THINK_ID)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if think_tokens:
        tok.add_tokens(["<think>", "</think>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}))
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "do_sample": True, "temperature": 0.6,
        "top_p": 0.9}))
    return path
