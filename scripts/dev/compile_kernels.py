"""Compile Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton ships ptxas, so a
kernel's whole GPU build (TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs here. CPU tests run the kernels
through the interpreter, which accepts some code the GPU build rejects (and the reverse); this catches the
build errors before a device is lent. Covered: the kernels imported below with the variants the served
paths use, among them the split-K GEMMs and their sums, the talker's decode attention (whose PTX must have
16-byte loads where its rows are aligned), the weight-only FP8 GEMM (whose tiles must stream in 16-byte
asynchronous copies), the fp16x3 GEMM, the activations' split and the split output of the codec's conv +
norm, at the full model's shapes. Run without TRITON_INTERPRET (tests/test_compile_kernels.py runs it in a
subprocess).

    python scripts/dev/compile_kernels.py
"""
import os
import re
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels it compiles")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ops.argmax_top2 import _chunk_kernel, _merge_kernel  # noqa: E402
from ops.argmin_residual import _argmin_residual_kernel  # noqa: E402
from ops.bounded_attention import _bounded_attention_kernel  # noqa: E402
from ops.codebook_sum import _codebook_sum_kernel  # noqa: E402
from ops.decode_attention import _decode_attention_group_kernel, _decode_attention_vector_kernel  # noqa: E402
from ops.dwconv_layernorm import _dwconv_layer_norm_kernel  # noqa: E402
from ops.fp8_linear import _quantize_rows_kernel  # noqa: E402
from ops.fp8_weight_linear import SKINNY_TILES, WIDE_TILES, _fp8_weight_linear_kernel  # noqa: E402
from ops.fp8_weight_linear import _sum_splits_kernel as _fp8_weight_sum_kernel  # noqa: E402
from ops.fp16x3_linear import _fp16x3_kernel, _split_rows_kernel  # noqa: E402
from ops.fp16x3_linear import _split_k_sum_kernel as _fp16x3_split_k_sum_kernel  # noqa: E402
from ops.fp32_linear import _fp32_linear_kernel, _split_k_sum_kernel  # noqa: E402
from ops.istft_step import _istft_step_kernel  # noqa: E402
from ops.layernorm import _add_layer_norm_kernel  # noqa: E402
from ops.mog_latent import _mog_latent_kernel  # noqa: E402
from ops.rmsnorm import _rms_norm_rope_kernel  # noqa: E402
from ops.rnnt_commit import _rnnt_commit_kernel  # noqa: E402
from ops.top_p_sample import _top_p_gumbel_argmax_kernel  # noqa: E402
from scripts.dev.ptx_loads import load_widths  # noqa: E402

target = GPUTarget("cuda", 90, 32)


def compile_(kernel, sig, constexprs, divisible=(), **options):
    names = kernel.arg_names
    full = {n: sig.get(n, "i32") if n not in constexprs else "constexpr" for n in names}
    # every pointer 16-byte aligned, as Triton specialises a launch on torch's (aligned) allocations, and the
    # integers in `divisible` multiples of 16, as it specialises a launch on such values
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in full.items()
               if t.startswith("*") or n in divisible}
    src = ASTSource(fn=kernel, signature=full, constexprs=constexprs, attrs=aligned)
    k = triton.compile(src, target=target, options=options)
    print(f"{kernel.__name__:34s} ok ({len(k.asm['ptx'])} ptx chars)", flush=True)
    return k.asm["ptx"]


f32, bf16 = "*fp32", "*bf16"
compile_(_argmin_residual_kernel, {"dist_ptr": f32, "res_ptr": f32, "book_ptr": f32, "idx_ptr": "*i64", "out_ptr": f32},
         {"BLOCK_C": 1024, "BLOCK_D": 512}, num_warps=4)
for store in (False, True):
    compile_(_bounded_attention_kernel, {n: bf16 for n in ("q_ptr", "k_new_ptr", "v_new_ptr", "keys_ptr", "values_ptr",
                                                            "pos_ptr", "u_ptr", "vb_ptr", "out_ptr")}
             | {"slots_ptr": "*i64", "t_ptr": "*i64", "scale": "fp32"},
             {"WINDOW": 70, "HEAD_DIM": 128, "BLOCK_W": 128, "BLOCK_D": 128, "STORE": store}, num_warps=8)
for t in (f32, bf16):  # the codec's codebooks; the talker's code table
    compile_(_codebook_sum_kernel, {"codes_ptr": "*i64", "tables_ptr": t, "out_ptr": t},
             {"Q": 31, "BLOCK_D": 512, "BF16": t == bf16}, num_warps=4)
for c in (384, 768, 1536):
    bc = triton.next_power_of_2(c)
    compile_(_dwconv_layer_norm_kernel, {"x_ptr": f32, "hist_ptr": f32, "slots_ptr": "*i64", "w_ptr": f32, "b_ptr": f32,
                                         "nw_ptr": f32, "nb_ptr": f32, "y_ptr": f32, "eps": "fp32"},
             {"C": c, "KSIZE": 7, "BLOCK_L": max(1, 4096 // bc), "BLOCK_C": bc}, num_warps=4)
for split_k in (1, 3):  # split-K (partial products to scratch, then the sum kernel's epilogue)
    compile_(_fp32_linear_kernel, {"x_ptr": f32, "w_ptr": f32, "wl_ptr": f32, "b_ptr": f32, "r_ptr": f32, "y_ptr": f32,
                                   "part_ptr": f32},
             {"K": 1536, "HAS_BIAS": True, "GELU": False, "HAS_RESIDUAL": True, "PRECISION": "tf32", "PRESPLIT": True,
              "SPLIT_K": split_k, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=3)
compile_(_split_k_sum_kernel, {"part_ptr": f32, "b_ptr": f32, "r_ptr": f32, "y_ptr": f32},
         {"SPLIT_K": 3, "HAS_BIAS": True, "GELU": True, "HAS_RESIDUAL": False, "BLOCK_M": 32, "BLOCK_N": 128},
         num_warps=4)
# The codec's fp16x3 GEMM (split-K, and the epilogue that writes its output split), its split-K sum
# and the activations' split.
f16 = "*fp16"
fp16x3_ptrs = {"xh_ptr": f16, "xl_ptr": f16, "xinv_ptr": f32, "wh_ptr": f16, "wl_ptr": f16, "winv_ptr": f32,
               "b_ptr": f32, "r_ptr": f32, "y_ptr": f32, "yh_ptr": f16, "yl_ptr": f16, "yinv_ptr": f32, "part_ptr": f32}
for split_k, split_out in ((1, True), (3, False)):
    compile_(_fp16x3_kernel, fp16x3_ptrs,
             {"K": 1536, "HAS_BIAS": True, "GELU": split_out, "HAS_RESIDUAL": not split_out, "SPLIT_OUT": split_out,
              "SPLIT_K": split_k, "BLOCK_M": 128, "BLOCK_N": 128, "SCALE": 64, "GROUP_M": 8}, num_warps=8, num_stages=3)
compile_(_fp16x3_split_k_sum_kernel, {n: t for n, t in fp16x3_ptrs.items() if n[0] not in "xw"},
         {"SPLIT_K": 3, "HAS_BIAS": True, "GELU": True, "HAS_RESIDUAL": False, "SPLIT_OUT": True, "BLOCK_M": 32,
          "BLOCK_N": 128, "SCALE": 64}, num_warps=4)
compile_(_split_rows_kernel, {"x_ptr": f32, "hi_ptr": f16, "lo_ptr": f16, "inv_ptr": f32}, {"BLOCK_M": 32, "SCALE": 64},
         num_warps=4)
# The talker's decode attention with its rows known 16-byte aligned must load 16 bytes at a time (without
# ROWS_ALIGNED its 72-element key stride gives 2-byte loads; docs/performance.md), unpaged and paged (the
# served pools: pages of 64). Strides as runtime ints, as served.
attention_ptrs = {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "out_ptr": bf16, "slots_ptr": "*i64",
                  "seq_lens_ptr": "*i64", "part_acc_ptr": f32, "part_ml_ptr": f32, "pages_ptr": "*i32", "qk_scale": "fp32"}
for aligned, paged in ((False, False), (True, False), (True, True)):
    ptx = compile_(_decode_attention_vector_kernel, attention_ptrs,
                   {"NUM_HEADS": 16, "HEAD_DIM": 72, "NUM_SPLITS": 2, "HAS_WINDOW": False, "HAS_TAIL": True,
                    "ROWS_ALIGNED": aligned, "PIPELINED": True, "PAGED": paged, "PAGE_LEN": 64 if paged else 1,
                    "BLOCK_N": 16, "BLOCK_DA": 64, "BLOCK_DB": 8},
                   num_warps=1)
    wide = load_widths(ptx).get(16, 0)
    if aligned and wide < 8:
        raise SystemExit(f"decode attention with ROWS_ALIGNED: {wide} 16-byte loads in the PTX, want >= 8")
    print(f"  16-byte loads: {wide}", flush=True)
# ... over float8 pools (`model.dtype.talker_kv: fp8`): its 72-byte rows allow 8-byte loads
fp8 = "*fp8e4nv"
ptx = compile_(_decode_attention_vector_kernel, attention_ptrs | {"k_ptr": fp8, "v_ptr": fp8},
               {"NUM_HEADS": 16, "HEAD_DIM": 72, "NUM_SPLITS": 2, "HAS_WINDOW": False, "HAS_TAIL": True,
                "ROWS_ALIGNED": True, "PIPELINED": True, "PAGED": True, "PAGE_LEN": 64, "BLOCK_N": 16, "BLOCK_DA": 64,
                "BLOCK_DB": 8}, num_warps=1)
print(f"  8-byte loads: {load_widths(ptx).get(8, 0)}", flush=True)
# The LLM's (GQA: 5 query heads per kv head, head dim 128), paged: its tl.dot blocks of 64 keys in pages of 64
compile_(_decode_attention_group_kernel, attention_ptrs,
         {"NUM_HEADS": 40, "GROUP": 5, "HEAD_DIM": 128, "NUM_SPLITS": 2, "HAS_WINDOW": False, "DOT_PRECISION": "tf32",
          "PIPELINED": True, "PAGED": True, "PAGE_LEN": 64, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128}, num_warps=4)
# the talker's k/v store, into pages as served, and into float8 pages
for store, paged, pool in ((False, False, bf16), (True, False, bf16), (True, True, bf16), (True, True, fp8)):
    compile_(_rms_norm_rope_kernel, {"x_ptr": bf16, "w_ptr": bf16, "cos_ptr": bf16, "sin_ptr": bf16, "out_ptr": pool,
                                     "eps": "fp32", "offset": "fp32", "v_ptr": bf16, "v_out_ptr": pool,
                                     "rows_ptr": "*i64", "pos_ptr": "*i64", "pages_ptr": "*i32", "q_ptr": bf16,
                                     "qw_ptr": bf16, "q_out_ptr": bf16},
             {"D": 72, "HEADS": 16, "BLOCK_R": 16, "BLOCK_D": 128, "BF16": True, "STORE": store, "PAGED": paged,
              "PAGE_LEN": 64 if paged else 1, "FP8": pool == fp8}, num_warps=4)
# the FP8 projections' row quantiser (`model.dtype.llm_weights: fp8`)
compile_(_quantize_rows_kernel, {"x_ptr": bf16, "q_ptr": fp8, "scale_ptr": f32}, {"BLOCK_K": 1024}, num_warps=4)
# the weight-only FP8 projections (`model.dtype.llm_weights: fp8_weight_only`): 32 rows with split-K (the
# LLM's out_proj), 128 rows in one pass; then the split sums
fp8w_ptrs = {"x_ptr": bf16, "w_ptr": fp8, "scale_ptr": f32, "y_ptr": bf16, "part_ptr": f32}
for (block_m, block_n, block_k, warps, stages), k, split_k in (((32, *SKINNY_TILES), 10240, 4), (WIDE_TILES, 4480, 1)):
    # the row strides are K (multiples of 16 in every projection): the x and weight tiles must then stream in
    # 16-byte asynchronous copies, never a byte or two at a time
    ptx = compile_(_fp8_weight_linear_kernel, fp8w_ptrs,
                   {"K": k, "K_PER_SPLIT": k // split_k, "SPLIT_K": split_k, "UPCAST": False, "BF16": True,
                    "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
                   divisible=("stride_xm", "stride_wn", "stride_ym"), num_warps=warps, num_stages=stages)
    copies = re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)
    narrow = sum(n for width, n in load_widths(ptx).items() if width <= 2)
    if not copies or set(copies) != {"0x10"} or narrow:
        raise SystemExit(f"fp8 weight-only tiles: copies {sorted(set(copies))}, {narrow} narrow loads; want 16 bytes")
    print(f"  16-byte async copies: {len(copies)}", flush=True)
compile_(_fp8_weight_sum_kernel, {"part_ptr": f32, "scale_ptr": f32, "y_ptr": bf16},
         {"SPLIT_K": 4, "BF16": True, "BLOCK_M": 16, "BLOCK_N": 128}, num_warps=4)
compile_(_rnnt_commit_kernel, {"logits_ptr": bf16, "active_ptr": "*i1", "hn_ptr": bf16, "h_ptr": bf16, "cn_ptr": bf16,
                               "c_ptr": bf16, "last_ptr": "*i64", "tokens_ptr": "*i64"},
         {"LAYERS": 2, "BLOCK_V": 2048, "BLOCK_H": 1024}, num_warps=4)
for t in (f32, bf16):  # bf16: the talker's stacked heads output, read as it is
    compile_(_top_p_gumbel_argmax_kernel, {"logits_ptr": t, "noise_ptr": f32, "out_ptr": "*i64", "drop_mass": "fp32"},
             {"BLOCK": 1024}, num_warps=4)
for nxt in (False, True):  # the encoder's joints; NEXT: norm_out then the next layer's first norm
    compile_(_add_layer_norm_kernel, {n: bf16 for n in ("x_ptr", "delta_ptr", "w_ptr", "b_ptr", "s_ptr", "y_ptr",
                                                        "w2_ptr", "b2_ptr")} | {"alpha": "fp32", "eps": "fp32", "eps2": "fp32"},
             {"D": 1024, "HAS_DELTA": True, "NEXT": nxt, "BLOCK_D": 1024, "BF16": True}, num_warps=4)
compile_(_mog_latent_kernel, {n: bf16 for n in ("x_ptr", "wmus_ptr", "low_ptr", "wlogs_ptr", "else_ptr", "normal_ptr")}
         | {"comp_ptr": "*i64", "z_ptr": f32, "min_log_std": "fp32", "noise_scale": "fp32"},
         {"BLOCK_H": 128, "BLOCK_R": 64, "BLOCK_L": 128, "DTYPE": tl.bfloat16, "BF16": True}, num_warps=4)
# The codec's streaming iSTFT tail (ops/istft_step.py) at the full codec's sizes, the GPU's block split
compile_(_istft_step_kernel, {n: f32 for n in ("head_ptr", "basis_ptr", "window_ptr", "inner_ptr", "env_ptr", "ola_ptr",
                                               "env_tail_ptr", "wav_ptr")}
         | {"step_head_ptr": "*i1", "done_ptr": "*i64", "slots_ptr": "*i64"},
         {"N_FFT": 16, "HOP": 4, "BLOCK_T": 32, "BLOCK_F": 32, "BLOCK_HOP": 16, "BLOCK_TAIL": 16}, num_warps=4)
# The text logits' argmax with their top two values (per chunk, then the merge).
compile_(_chunk_kernel, {"x_ptr": bf16, "best_ptr": f32, "index_ptr": "*i32", "second_ptr": f32}, {"BLOCK": 4096},
         num_warps=8)
compile_(_merge_kernel, {"best_ptr": f32, "index_ptr": "*i32", "second_ptr": f32, "argmax_ptr": "*i64", "top2_ptr": f32},
         {"BLOCK_CHUNKS": 32}, num_warps=1)
