"""The small kernels as programmatic dependents (TPGRAPH_TRITON_PDL=1), compiled ahead of time for sm_90 without a
GPU: the wait comes first, before any load of what the kernel before wrote, and the next kernel is let in right
after it; without PDL neither instruction is there. (The interpreter never launches them as dependents: use_pdl is
off under TRITON_INTERPRET, so the CPU tests' bits cover both variants' arithmetic.)"""

import pytest
from tpgtest.ptx import sm90_ptx

ROPE = ("tpgraph.kernels.rope_store", "_rope_store_kernel",
        {"qkv_ptr": "*bf16", "pos_ptr": "*i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i32",
         "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "q_out_ptr": "*bf16", "k_out_ptr": "*bf16",
         "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps": "fp32", "mean_scale": "fp32"},
        ["num_tokens", "stride_qkv", "stride_cos", "stride_sin", "stride_cb", "stride_ct", "stride_ch", "stride_qo",
         "stride_ko"],
        {"NUM_HEADS": 16, "NUM_KV_HEADS": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "HALF_PAD": 64, "DIM_PAD": 128,
         "BLOCK_T": 1, "SOFT_BF16": False, "HEAD_NORM": False, "MEAN_BY_DIV": False})
# prefill sizes (and decode from 256 rows): 16 tokens a program; with Qwen3's head norms
ROPE_BLOCKS = (*ROPE[:4], {**ROPE[4], "BLOCK_T": 16, "HEAD_NORM": True})
SPLIT_SUM = ("tpgraph.kernels.gemv", "_split_sum_kernel", {"ws_ptr": "*fp32", "y_ptr": "*bf16"},
             ["numel", "SPLITS"], {"BLOCK": 512, "SOFT_BF16": False})
NORM = ("tpgraph.kernels.norm", "_rms_norm_kernel",
        {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
         "hidden": "i32", "eps": "fp32", "mean_scale": "fp32"},
        ["stride_x", "stride_r", "stride_o", "stride_ro"],
        {"HAS_RESIDUAL": True, "MEAN_BY_DIV": False, "SOFT_BF16": False, "BLOCK": 4096})
COMBINE = ("tpgraph.kernels.decode_attention", "_decode_combine_kernel",
           {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16",
            "seq_lens_ptr": "*i32"},
           ["stride_pb", "stride_ph", "stride_ps", "stride_ob", "stride_oh"],
           {"HEAD_DIM": 128, "DIM_PAD": 128, "NUM_SPLITS": 8, "SPLITS_PAD": 8, "BLOCK_N": 64, "SPLIT_TILES": 1,
            "INTERPRETED": False, "LONG_TILES": 8, "MERGE": 16})


@pytest.mark.parametrize("kernel", [ROPE, ROPE_BLOCKS, SPLIT_SUM, COMBINE, NORM],
                         ids=["rope_store", "rope_store_blocks", "split_sum", "combine", "norm"])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_wait_comes_first_and_the_next_kernel_is_let_in_after_it(kernel, pdl):
    module, name, typed, scalars, constexprs = kernel
    ptx = sm90_ptx(module, name, typed, scalars, {**constexprs, "PDL": pdl}, num_warps=1 if kernel is ROPE else 4)
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert wait < trigger < ptx.index("ld.global")
    assert ptx.count("griddepcontrol.wait") == 1


@pytest.mark.parametrize("residual", [True, False])
def test_the_norm_loads_its_weight_with_its_input(residual):
    """Every load of the add + RMSNorm kernel is issued before the row sum's barrier: the weight comes in with x and
    the residual, not after the sum (a second round trip on a kernel that runs at every layer boundary)."""
    module, name, typed, scalars, constexprs = NORM
    ptx = sm90_ptx(module, name, typed, scalars, {**constexprs, "HAS_RESIDUAL": residual, "PDL": True}, num_warps=8)
    barrier = ptx.index("bar.sync")
    assert ptx[barrier:].count("ld.global") == 0
    assert ptx[:barrier].count("ld.global") >= (3 if residual else 2)
