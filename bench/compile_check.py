"""Compile the HiSparse placement kernels (kernels/lru_place.py), the sampler's Gumbel draw
(kernels/gumbel.py) and its penalties (kernels/penalties.py), the router's one launch and the grouped down projection (kernels/moe.py)
and MLA's per-head GEMV with its split merge (kernels/gemv.py) for an sm_90 GPU on a machine without one: Triton's own front end, optimiser and ptxas run, so a kernel the CPU interpreter accepts but
the compiler rejects (types that differ between the branches of an `if`, an op with no lowering)
fails here instead of in a device session. Every variant the wrapper launches: the full kernel
with and without the parallel passes or the step's candidates, the passes' three phases, with and
without the all-hit pass and the row masks, and the candidates kernel. Needs TRITON_INTERPRET unset
(tests run it in a subprocess).

    python -m bench.compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# argument name -> Triton pointer type (the rest: int64 strides, int32 scalars, constexprs)
_PTR = {
    "pos_ptr": "*i64", "vb_ptr": "*i1", "lim_ptr": "*i64", "p2s_ptr": "*i32", "s2p_ptr": "*i64",
    "st_ptr": "*i64", "now_ptr": "*i64", "pat_ptr": "*i64", "sat_ptr": "*i64", "base_ptr": "*i64",
    "nf_ptr": "*i64", "table_ptr": "*i32", "acc_ptr": "*i64", "u_ptr": "*i64", "src_ptr": "*i64",
    "dst_ptr": "*i64", "copy_ptr": "*i1", "ovf_ptr": "*i1", "csrc_ptr": "*i64", "cdst_ptr": "*i64",
    "cnt_ptr": "*i64", "scr_ptr": "*i64", "slow_ptr": "*i32", "ws_ptr": "*i32", "pc_ptr": "*i32",
    "cum_ptr": "*i32", "hscr_ptr": "*i64", "cand_ptr": "*i64", "out_ptr": "*i64", "ks_ptr": "*i64",
    "kk_ptr": "*i64", "km_ptr": "*i64", "rb_ptr": "*i64",
    # the sampler's Gumbel-max draw (kernels/gumbel.py)
    "x_ptr": "*fp32", "keys_ptr": "*i64", "ids_ptr": "*i64", "bs_ptr": "*fp32", "bh_ptr": "*i64", "bc_ptr": "*i64",
    "t_ptr": "*fp32", "bl_ptr": "*i32",
    # the sampler's penalties (kernels/penalties.py)
    "lx_ptr": "*fp32", "po_ptr": "*fp32", "pslot_ptr": "*i32", "pcnt_ptr": "*i32", "pmask_ptr": "*u8",
    "rep_ptr": "*fp32", "freq_ptr": "*fp32", "pres_ptr": "*fp32",
}  # fmt: skip
# the trained model's decode shape: top-256 into 13,107 slots (7 blocks of 2,048), 11-bit digits
_CONST = {
    "PAGE": 64, "FORCE": False, "IB": 14, "BLOCK_M": 256, "BLOCK_N": 2048, "NB": 2048, "SPLIT": False,
    "PAR": True, "WS": 8 + 2 * 2048, "HAS_VALID": True, "HAS_BELOW": True, "DB": 11, "BLOCK_C": 8,
    "PHASE": 0, "CH": 256, "CAND": False, "FIXED": False, "KEEP": False, "NFW": 256, "BYTES": True,
    "HAS_IDS": False, "HAS_T": False, "BLOCK": 1024, "BLOCK_S": 512,
}  # fmt: skip


def compile_kernel(kernel, arch: int, **over: object) -> int:  # type: ignore[no-untyped-def]
    """Compile one variant (`num_warps` in `over`: its launch's, else 8); returns its shared memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig: dict[str, str] = {}
    cons: dict[str, object] = {}
    # this variant's argument types, and constexprs outside _CONST
    sig_over = cast("dict[str, str]", over.get("sig", {}))
    const_over = cast("dict[str, object]", over.get("const", {}))
    for name in inspect.signature(kernel.fn).parameters:
        if name in sig_over:
            sig[name] = sig_over[name]
        elif name in const_over:
            sig[name] = "constexpr"
            cons[name] = const_over[name]
        elif name in _PTR:
            sig[name] = str(over.get(name, _PTR[name]))
        elif name in _CONST:
            sig[name] = "constexpr"
            cons[name] = over.get(name, _CONST[name])
        else:
            sig[name] = "i64" if name.startswith("stride") else "i32"
    if kernel.fn.__name__ in ("_lru_place_kernel", "_lru_candidates_kernel"):
        cons["NB"] = 256  # the one-program select's own 8-bit digits
    src = ASTSource(fn=kernel, signature=sig, constexprs=cons)
    return int(
        triton.compile(
            src,
            target=GPUTarget("cuda", arch, 32),
            options={
                "num_warps": over.get("num_warps", 8),
                "enable_fp_fusion": over.get("enable_fp_fusion", True),
            },
        ).metadata.shared
    )


def variants() -> list[tuple[str, dict]]:
    from longctx.kernels import lru_place

    out: list[tuple[str, dict]] = []
    for split in (False, True):
        masks = {"SPLIT": split, "HAS_VALID": not split, "HAS_BELOW": not split}
        out += [("_lru_place_kernel", {**masks, "PAR": par}) for par in (False, True)]
        out += [("_par_pass_kernel", {**masks, "PHASE": ph}) for ph in (0, 1, 2)]
        # a decode placement from the step's candidates (256 of them: the top-k), and their kernel
        out.append(("_lru_place_kernel", {**masks, "PAR": False, "CAND": True, "BLOCK_C": 256}))
    # the step's newest tokens (forced, row masks) from the same candidates (top-k + recent: 320)
    out.append(
        ("_lru_place_kernel", {"PAR": False, "CAND": True, "FORCE": True, "BLOCK_M": 64, "BLOCK_C": 512})
    )
    # the candidates (320 of them): one program's select, or the parallel passes without positions
    out += [("_lru_candidates_kernel", {"BLOCK_C": 512, "PAR": par}) for par in (False, True)]
    # kept from step to step (4 x 512 of them), as the decode step launches it below the parallel passes
    out.append(("_lru_candidates_kernel", {"BLOCK_C": 2048, "PAR": False, "KEEP": True}))
    # wider slot steps (place_bench --block-n), with the warps the wrappers launch them with
    out += [
        (
            k,
            {
                "BLOCK_N": bn,
                "num_warps": lru_place._select_warps(bn),
                **({"BLOCK_C": 512} if "cand" in k else {}),
            },
        )
        for k in ("_lru_candidates_kernel", "_lru_place_kernel")
        for bn in (4096, 8192)
    ]
    out += [("_par_pass_kernel", {"PHASE": ph, "FIXED": True, "BLOCK_M": 512}) for ph in (0, 1, 2)]
    out.append(("_place_hits_kernel", {"BLOCK_M": 2048}))
    # the sampler's draw: over token ids or a sorted prefix's ids, a GLM vocabulary's blocks and a top-k's
    out += [
        ("_gumbel_argmax_kernel", {"HAS_IDS": ids, "BLOCK": b, "num_warps": 4})
        for ids in (False, True)
        for b in (64, 1024)
    ]
    # scaling the raw logits itself (a temperature-only draw over the vocabulary; fp32 or bf16 logits)
    out += [
        ("_gumbel_argmax_kernel", {"HAS_T": True, "BLOCK": 1024, "num_warps": 4, "x_ptr": x})
        for x in ("*fp32", "*bf16")
    ]
    # the draw's second stage: each row's winner over its programs' bests (up to 2 x 132 SMs of them)
    out += [("_gumbel_pick_kernel", {"HAS_T": t, "BLOCK_S": 512, "num_warps": 1}) for t in (False, True)]
    # the penalties over a GLM vocabulary's blocks, fp32 or bf16 logits
    out += [
        ("_penalise_kernel", {"BLOCK": 2048, "num_warps": 4, "lx_ptr": x, "enable_fp_fusion": False})
        for x in ("*fp32", "*bf16")
    ]
    # the router's one launch (kernels/moe.py): GLM-5's routing (256 experts in 8 groups) and small-1m's
    router = {
        "h_ptr": "*bf16",
        "w_ptr": "*fp32",
        "logits_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "valid_ptr": "*u8",
        "ids_ptr": "*i64",
        "wt_ptr": "*fp32",
        "done_ptr": "*i32",
        "scaling": "fp32",
    }
    for e, g, tg, k, bh in ((256, 8, 4, 8, 256), (16, 1, 1, 4, 2048)):
        const = {
            "BT": 1,
            "BE": 2 if e == 256 else 1,
            "BH": bh,
            "EG": e // g,
            "G": g,
            "GP": g,
            "EGP": e // g,
            "TOPK_GROUP": tg,
            "K": k,
            "KP": k,
            "NORM": True,
            "HAS_VALID": True,
            "PDL": True,
        }
        out.append(("_router_fused_kernel", {"sig": router, "const": const, "num_warps": 4}))
    # MLA's absorbed W_UK / W_UV at decode (kernels/gemv.py's head_gemv: a batch stride)
    gemv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "o_ptr": "*bf16", "K": "i32"}
    const = {"FP8": False, "X16": False, "DOT": True, "F32": False, "BM": 16, "BN": 64, "BK": 64}
    out.append(("_gemv_kernel", {"sig": gemv, "const": const, "num_warps": 4}))
    # batch-1 decode's split attention merged into W_UV's GEMV (32 splits)
    merge = {"p_ptr": "*fp32", "l_ptr": "*fp32", "w_ptr": "*bf16", "o_ptr": "*bf16", "K": "i32"}
    const = {"F32": False, "BS": 32, "BN": 64, "BK": 64, "PDL": True}
    out.append(("_merge_gemv_kernel", {"sig": merge, "const": const, "num_warps": 4}))
    # the grouped MoE down projection at small-1m's decode tiles (bf16)
    down = {
        "h_ptr": "*bf16",
        "w_ptr": "*bf16",
        "ws_ptr": "*bf16",
        "pairs_ptr": "*i32",
        "bexp_ptr": "*i32",
        "tw_ptr": "*fp32",
        "o_ptr": "*bf16",
    }
    const = {"FP8": False, "X16": False, "F32": False, "BM": 16, "BN": 64, "BK": 128, "PDL": True}
    out.append(("_down_kernel", {"sig": down, "const": const, "num_warps": 4}))
    return out  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: H100/H200)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter replaces the kernels' compiler)")
        return 2
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except ImportError:
        print("compile_check: needs triton")
        return 2
    if "nvidia" not in backends:
        print("compile_check: this triton has no nvidia backend")
        return 2
    from longctx.kernels import gemv, gumbel, lru_place, moe, penalties

    modules = {
        "_gumbel_argmax_kernel": gumbel, "_gumbel_pick_kernel": gumbel, "_penalise_kernel": penalties,
        "_router_fused_kernel": moe, "_gemv_kernel": gemv, "_merge_gemv_kernel": gemv, "_down_kernel": moe,
    }  # fmt: skip

    failed = 0
    for name, over in variants():
        try:
            smem = compile_kernel(getattr(modules.get(name, lru_place), name), args.arch, **over)
            print(f"ok   {name} {over} ({smem} B shared)")
        except Exception as e:  # noqa: BLE001  (report every variant, then fail)
            failed += 1
            print(f"FAIL {name} {over}: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
