"""CPU engines with prefix caching on or off, and what their prefill forwards computed: the prefix-caching tests
compare the two."""

from tpgraph import TPEngine

BS = 4


def engine(caching, **kw):
    base = dict(device="cpu", max_num_seqs=4, max_model_len=96, num_kv_blocks=64, block_size=BS,
                enable_prefix_caching=caching)
    return TPEngine(**{**base, **kw})


def prefill_tokens(e):
    """Prompt tokens the engine's prefill forwards ran (unpadded)."""
    return sum(unpadded * count for phase, _, unpadded, _, count in e.runner.stats.frequency_table()
               if phase == "prefill")
