"""Lightning-indexer logits (DSA) over the paged indexer key pool.

    logits[i, t] = sum_h w[i, h] * relu(q[i, h, :] . k_t)        for t valid for query i
                 = -inf                                            otherwise

Key t of query i is valid iff t < seq_lens[q_seq[i]] and t <= q_pos[i] (causal). Key t of request b
lives in slot page_table[b, t // 64] * 64 + t % 64 of `index_pool` (layouts: `kv_layout`). One call
serves a prefill chunk (many queries of one request), a decode batch (one query per request), or
a mix: queries are grouped by request only through `q_seq`.

What the caller passes (nothing is scaled in here):
- `q` [Tq, H, D]: the indexer queries with rope already applied, in the pool's dtype for dense
  pools (bf16 / fp16 / fp32), any of those for fp8 pools.
- `w` [Tq, H]: the per-head weights `weights_proj(x)`, any float dtype (fp32 for the fused
  prefill kernel in `indexer_topk`), and `w_scale`, a scalar every weight is multiplied by in fp32
  before use (`float(w) * w_scale`; 1.0 when w already has it folded in). For DeepSeek-V3.2 /
  GLM-5 that is `H**-0.5 * softmax_scale` with softmax_scale = D**-0.5 (the reference folds both
  into the weights after the relu; since relu(c * s) = c * relu(s) for c > 0 it does not matter
  on which side positive scalars go). Passing the raw projection and its scale saves the decode
  step a cast and a multiply kernel; rows of w may be strided (a slice of a wider projection).
For the fp8 layout the per-key scale is applied after the head reduction (scale > 0, same
identity), so fp8 logits equal `sum_h w * relu(q . (e4m3 * scale))` up to fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from .common import (
    check,
    jit,
    knobs_spec,
    next_pow2,
    num_sms,
    parse_knobs,
    pdl,
    pdl_wait,
    tl,
    triton_interpret,
    use_triton,
)
from .kv_layout import PAGE_SIZE, index_fp8_offsets, index_row_bytes, is_fp8, read_index_k_ref

try:  # host-side TMA descriptors (triton >= 3.4); the TMA decode variant needs them
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - installs without triton never launch a kernel
    _TensorDescriptor = None

_REF_CHUNK_ELEMS = 1 << 24  # bounds the reference's [queries, heads, keys] intermediate (64 MiB fp32)


@dataclass(frozen=True)
class DecodeKnobs:
    """How the decode kernel launches (never what it computes); 0 means the path's default. The
    defaults are the H200 sweep's winner (`python -m bench.idx_sweep`, bench/results/idx-sweep-h200.md:
    TMA pages, 64 keys x 4 stages, as many programs per SM as fit: 47 us at 32 heads x 1M keys, 0.72 of
    HBM, 1.31x the launch before the knobs, `OLD_LAUNCH`; 1.4-2.2x at batch 8 and 64 heads).

    `tma=1` streams whole 64-key pages with TMA instead of per-thread cp.async gathers: the
    page-major fp8 layout makes a page's keys one contiguous [64, D] box, so one descriptor load per
    page replaces ~64 * D / 16 address computations and 16-byte copies, holds no registers for
    addresses, and can keep `stages` pages in flight per program (shared memory, not the register
    file, bounds the bytes in flight); its scales (the next 4 * 64 bytes) are loaded a tile ahead. Only for fp8 pools
    with D a power of two in [16, 256] on sm_90+ (and the interpreter); elsewhere the gather kernel
    runs. With tma, `block_n` (a multiple of the page) is pages per loop iteration x 64."""

    tma: int = 1  # 1: page-granular TMA loads where they apply (see above); 0: always the gather kernel
    sc_ahead: int = 0  # gather kernel, fp8: 1 loads each tile's scales a tile ahead (TMA ones are pipelined)
    block_n: int = 0  # keys per loop iteration, a power of two >= 16; 0: 64 with TMA, 128 gathered
    warps: int = 4
    stages: int = 0  # software-pipeline depth: stages - 1 tiles in flight per program; 0: 4 TMA, 3 gathered
    per_sm: int = 0  # programs per SM in a wave; 0: as many as fit (compiled kernel's registers, smem)
    waves: int = 0  # waves of programs; 0: 1 for one query, 2 for a batch (measured best)
    splits: int = 0  # programs per query; 0: waves * per_sm * SMs // Tq

    def __post_init__(self) -> None:
        check(
            self.tma in (0, 1) and self.sc_ahead in (0, 1),
            f"indexer decode knobs tma, sc_ahead: 0 or 1 ({self})",
        )
        check(
            self.block_n == 0 or (self.block_n >= 16 and self.block_n & (self.block_n - 1) == 0),
            f"indexer decode knob block_n: 0 or a power of two >= 16 ({self})",
        )
        check(self.warps in (1, 2, 4, 8, 16) and self.stages >= 0, f"bad indexer decode knobs ({self})")
        check(self.per_sm >= 0 and self.waves >= 0 and self.splits >= 0, f"bad indexer decode knobs ({self})")

    def spec(self) -> str:
        """The LONGCTX_INDEXER_DECODE string of these knobs."""
        return knobs_spec(self)

    @classmethod
    def parse(cls, spec: str, base: DecodeKnobs | None = None) -> DecodeKnobs:
        """`base` (default: the defaults) with the fields named in "name=int,..." replaced."""
        return parse_knobs(cls, spec, base, "indexer decode knob")  # type: ignore[no-any-return]


# LONGCTX_INDEXER_DECODE ("tma=0,stages=4", any subset) overrides the decode defaults for a process.
DECODE_KNOBS = DecodeKnobs.parse(os.environ.get("LONGCTX_INDEXER_DECODE", ""))
# The launch before the knobs existed (gather kernel, 128-key tiles, 3 stages, 3 programs an SM): the
# sweep's baseline.
OLD_LAUNCH = DecodeKnobs(tma=0, block_n=128, stages=3, per_sm=3)


_LAST_DECODE: dict[str, Any] = {}  # the compiled kernel of the last decode launch (bench statistics)


def decode_launch_stats() -> dict[str, Any]:
    """The last decode launch: its grid, and its compiled kernel's registers / thread, spilled bytes,
    shared memory bytes and how many of its programs fit an SM (`_fit`); grid only under the
    interpreter. bench/idx_sweep.py reports them to explain occupancy and waves."""
    k = _LAST_DECODE.get("kernel")
    md = getattr(k, "metadata", None)
    out: dict[str, Any] = {"grid": _LAST_DECODE.get("grid")}
    if k is None or md is None or not hasattr(k, "n_regs"):
        return out
    out.update(regs=int(k.n_regs), spills=int(k.n_spills), shared=int(md.shared), warps=int(md.num_warps))
    out["fit"] = _fit(out["regs"], out["shared"], out["warps"], _LAST_DECODE["device"])
    return out


def _fit(regs: int, shared: int, warps: int, device: torch.device) -> int:
    """Programs of a kernel with these resources that fit one SM (registers: 64K, allocated per warp in
    units of 256; shared memory: what the SM has, 1 KiB reserved a program; threads)."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * warps
    return max(
        1,
        min(
            65536 // (-(-regs // 8) * 8 * threads),
            props.shared_memory_per_multiprocessor // (shared + 1024),
            props.max_threads_per_multi_processor // threads,
            32,
        ),
    )


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _tma_ok(kind: str, d: int, device: torch.device) -> bool:
    """Whether the TMA decode kernel can serve this pool: fp8, D a power of two in [16, 256] (so the
    scales are whole D-byte rows of the page), on sm_90+ or the interpreter."""
    if _TensorDescriptor is None or not is_fp8(kind) or not 16 <= d <= 256 or d & (d - 1):
        return False
    if device.type != "cuda":
        return triton_interpret()
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def _check_inputs(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    w_any_float: bool = False,
) -> None:
    check(
        q.dim() == 3 and q.dtype in (torch.float32, torch.bfloat16, torch.float16),
        "q must be [Tq, H, D] float",
    )
    check(q.stride(2) == 1, "q must have unit stride on D")
    tq, h, d = q.shape
    w_dtypes = (torch.float32, torch.bfloat16, torch.float16) if w_any_float else (torch.float32,)
    check(
        w.shape == (tq, h) and w.dtype in w_dtypes and (h <= 1 or w.stride(1) == 1),
        f"w must be [Tq, H] of {w_dtypes} with unit stride on H",
    )
    check(
        page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1,
        "page_table must be int32 [B, P]",
    )
    b = page_table.shape[0]
    check(seq_lens.shape == (b,) and seq_lens.dtype in (torch.int32, torch.int64), "seq_lens must be int [B]")
    check(q_seq.shape == (tq,) and q_seq.dtype in (torch.int32, torch.int64), "q_seq must be int [Tq]")
    check(q_pos.shape == (tq,) and q_pos.dtype in (torch.int32, torch.int64), "q_pos must be int [Tq]")
    check(
        index_pool.dim() == 2 and index_pool.stride(1) == 1 and index_pool.stride(0) == index_pool.shape[1],
        "index_pool must be contiguous [num_slots, row]",
    )
    if is_fp8(kind):
        check(
            index_pool.dtype == torch.uint8
            and index_pool.shape[1] == index_row_bytes(d, kind)
            and index_pool.shape[0] % PAGE_SIZE == 0,
            f"fp8 index pool must be uint8 [S, {d + 4}] with S a multiple of {PAGE_SIZE}",
        )
    else:
        check(
            index_pool.dtype == q.dtype and index_pool.shape[1] == d,
            f"dense index pool must be {q.dtype} [S, {d}]",
        )
    devs = {t.device for t in (q, w, index_pool, page_table, seq_lens, q_seq, q_pos)}
    check(len(devs) == 1, f"all indexer inputs must be on one device, got {devs}")


def indexer_logits_paged_ref(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    max_len: int | None = None,
    *,
    w_scale: float = 1.0,
) -> torch.Tensor:
    """Reference: per request, gather + dequantise its keys, then one fp32 matmul per query chunk."""
    _check_inputs(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, w_any_float=True)
    w = w.float() * w_scale
    tq, h, d = q.shape
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    out = torch.full((tq, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    if tq == 0 or max_len == 0:
        return out
    q_seq_l = q_seq.long()
    for b in torch.unique(q_seq_l).tolist():
        n = min(int(seq_lens[b]), max_len)
        if n <= 0:
            continue
        t = torch.arange(n, device=q.device)
        slots = page_table[b, t // PAGE_SIZE].long() * PAGE_SIZE + t % PAGE_SIZE
        k = read_index_k_ref(index_pool, slots, kind, torch.float32)  # [n, D]
        rows = torch.nonzero(q_seq_l == b).flatten()
        step = max(1, _REF_CHUNK_ELEMS // (h * n))
        for i in range(0, rows.numel(), step):
            r = rows[i : i + step]
            s = torch.relu(q[r].float().reshape(-1, d) @ k.T).view(r.numel(), h, n)
            s = (s * w[r, :, None]).sum(1)  # [r, n]
            s.masked_fill_(t[None, :] > q_pos[r, None], float("-inf"))
            out[r, :n] = s
    return out


def indexer_logits_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    kind: str,
    max_len: int | None = None,
    *,
    w_scale: float = 1.0,
    backend: str = "auto",
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,
    knobs: DecodeKnobs | None = None,
) -> torch.Tensor:
    """Indexer logits [Tq, max_len] fp32 (-inf where invalid); see the module docstring.

    q [Tq, H, D], w [Tq, H] float (unit stride on H) scaled by `w_scale`, index_pool [S, D+4] uint8 (fp8) or [S, D] (dense),
    page_table int32 [B, P], seq_lens int [B], q_seq int [Tq] (request of each query),
    q_pos int [Tq] (absolute position of each query). `max_len` defaults to max(seq_lens), which
    costs a device sync; pass it when known (the decode path does: then there is no host sync and no
    host->device copy, so the call can be captured in a CUDA graph). Queries sorted by request are
    fastest (the prefill kernel tiles BLOCK_M neighbouring queries and loops over the requests they span).

    Two kernels: decode batches (at most one query per request) run `_indexer_decode_kernel`, one
    program per (query, run of key tiles); other calls `_indexer_kernel`. Bench knobs, None picks
    the defaults: `block_n` (keys per tile, a power of two >= 16), `num_warps`, `num_stages`, and
    for decode `splits` (programs per query). Decode launches follow `knobs` (default
    `DECODE_KNOBS`, i.e. LONGCTX_INDEXER_DECODE), the four arguments above overriding its fields.
    """
    _check_inputs(q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, w_any_float=True)
    if not use_triton(backend, q.device):
        return indexer_logits_paged_ref(
            q, w, index_pool, page_table, seq_lens, q_seq, q_pos, kind, max_len, w_scale=w_scale
        )
    tq, h, d = q.shape
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    out = torch.empty((tq, max_len), dtype=torch.float32, device=q.device)
    if tq == 0 or max_len == 0:
        return out
    check(
        block_n is None or (block_n >= 16 and block_n & (block_n - 1) == 0),
        "indexer: block_n must be a power of two >= 16",
    )
    hp, dp = max(16, next_pow2(h)), max(16, next_pow2(d))
    fp8 = is_fp8(kind)
    interp = triton_interpret()
    if tq <= page_table.shape[0]:  # decode: no key tile is shared between queries
        kn = knobs or DECODE_KNOBS
        if block_n or num_warps or num_stages:  # (no dataclass copy on the plain decode path)
            kn = dataclasses.replace(
                kn, block_n=block_n or kn.block_n, warps=num_warps or kn.warps, stages=num_stages or kn.stages
            )
        _launch_decode(
            q, w, float(w_scale), index_pool, page_table, seq_lens, q_seq, q_pos, out, kind, kn, splits
        )
        return out
    # Prefill shares each key tile between BLOCK_M queries so keys are read Tq / BLOCK_M times
    # instead of Tq times.
    block_m = max(1, min(8, 128 // hp))
    block_n = block_n or (128 if d <= 128 else 64)
    grid = (_cdiv(tq, block_m), _cdiv(max_len, block_n))
    _indexer_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0), float(w_scale), index_pool, page_table, page_table.stride(0),
        seq_lens, q_seq, q_pos, out, out.stride(0), tq, max_len,
        H=h, HP=hp, D=d, DP=dp, ROW=index_pool.shape[1], FP8=fp8, PAGE=PAGE_SIZE,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        INTERPRET=interp, num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}),
    )  # fmt: skip
    return out


def _launch_decode(
    q: torch.Tensor,
    w: torch.Tensor,
    w_scale: float,
    index_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    out: torch.Tensor,
    kind: str,
    kn: DecodeKnobs,
    splits: int | None,
) -> None:
    """One decode launch into `out` [Tq, max_len]: the gather or the TMA kernel, gridded by `kn`."""
    tq, h, d = q.shape
    max_len = out.shape[1]
    hp, dp = max(16, next_pow2(h)), max(16, next_pow2(d))
    fp8 = is_fp8(kind)
    tma = kn.tma == 1 and _tma_ok(kind, d, q.device)
    bn = kn.block_n or (PAGE_SIZE if tma else _DECODE_BLOCK_N)
    if tma:
        bn = max(bn, PAGE_SIZE)
        rpp = PAGE_SIZE * (d + 4) // d  # D-byte rows per page: PAGE key rows, then the scales
        rows = index_pool.shape[0] // PAGE_SIZE * rpp
        flat = index_pool.view(-1)
        kdesc = _TensorDescriptor(
            flat.view(torch.float8_e4m3fn).view(rows, d), [rows, d], [d, 1], [PAGE_SIZE, d]
        )
        kernel = _indexer_decode_tma_kernel
        pool_args: tuple[Any, ...] = (kdesc, index_pool)
        consts: dict[str, Any] = dict(PAGE=PAGE_SIZE, RPP=rpp, PAGES=bn // PAGE_SIZE)
    else:
        kernel = _indexer_decode_kernel
        pool_args = (index_pool,)
        consts = dict(
            DP=dp,
            ROW=index_pool.shape[1],
            FP8=fp8,
            PAGE=PAGE_SIZE,
            BLOCK_N=bn,
            SC_AHEAD=fp8 and kn.sc_ahead == 1,
        )
    consts.update(
        H=h, HP=hp, D=d, IEEE=q.dtype == torch.float32, INTERPRET=triton_interpret(),
        num_warps=kn.warps, num_stages=kn.stages or (4 if tma else 3), **pdl(q.device),
    )  # fmt: skip

    def args(tiles_per: int) -> tuple[Any, ...]:
        return (
            q, q.stride(0), q.stride(1), w, w.stride(0), w_scale, *pool_args, page_table, page_table.stride(0),
            seq_lens, q_seq, q_pos, out, out.stride(0), max_len, tiles_per,
        )  # fmt: skip

    n_tiles = _cdiv(max_len, bn)
    # whole waves of programs (a few more than a wave cost a second one: batch 8 at 50 programs a
    # query took 584 us, at 99 410 us); one wave for a single query, two for a batch (measured best)
    # (on the interpreter 2 "SMs": tests cover several programs a query)
    waves = kn.waves or (1 if tq == 1 else 2)
    per_sm = kn.per_sm or _programs_per_sm(kernel, args(2), consts, q.device)
    per_query = splits or kn.splits or max(1, waves * per_sm * num_sms(q.device, cpu=2) // tq)
    tiles_per = _cdiv(n_tiles, min(per_query, n_tiles))
    grid = (tq, _cdiv(n_tiles, tiles_per))
    _LAST_DECODE.update(grid=grid, device=q.device, kernel=kernel[grid](*args(tiles_per), **consts))


_OCCUPANCY: dict[tuple[Any, ...], int] = {}


def _programs_per_sm(kernel: Any, args: tuple[Any, ...], consts: dict[str, Any], device: torch.device) -> int:
    """How many programs of this compiled kernel fit one SM (registers, shared memory, threads): the
    `per_sm=0` knob. Compiled (not launched) once per configuration; 3 where it cannot be asked (the
    interpreter, a private Triton API that moved)."""
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), device, *(
        a.dtype if isinstance(a, torch.Tensor) else None for a in args
    ), *sorted(consts.items()))  # fmt: skip
    if key not in _OCCUPANCY:
        fit = 3
        if device.type == "cuda" and not triton_interpret():
            try:
                ck = kernel.warmup(*args, grid=(1,), **consts)
                ck._init_handles()
                fit = _fit(ck.n_regs, ck.metadata.shared, consts["num_warps"], device)
            except Exception:  # noqa: BLE001 - the measured default rather than a failed launch
                fit = 3
        _OCCUPANCY[key] = fit
    return _OCCUPANCY[key]


# The gather kernel (dense pools, or no TMA): sm_90a SASS at 32 heads x 128 dims, fp8, bf16 q: 130
# registers, 41 KiB shared (2 key tiles in flight through cp.async), ~13 warp instructions per key, one
# 64x32x16 HGMMA per 16 dims of 64 keys; 3 programs fit on an SM (2 at 64 heads).

_DECODE_BLOCK_N = 128  # the gather kernel's tile (DecodeKnobs holds the other defaults)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@jit
def load_index_keys(
    pool_ptr, slot, kmask, offs_d, D: tl.constexpr, ROW: tl.constexpr, FP8: tl.constexpr, PAGE: tl.constexpr
):
    """Key tile [BK, DP] of the paged index pool at `slot` [BK] (int64): e4m3 (as tl.float8e4nv) for
    the page-major fp8 layout (`kv_layout`), else dense rows of ROW elements in the pool's dtype.
    Shared by the indexer and fused top-k kernels."""
    if FP8:
        key, _ = index_fp8_offsets(slot, D, PAGE)
        if D % 16 == 0:  # keys start on D-byte boundaries: whole-row 16-byte vector loads
            key = tl.multiple_of(key, 16)
        else:
            key = tl.multiple_of(key, 4)
        kp = pool_ptr.to(tl.pointer_type(tl.float8e4nv))
        k = tl.load(kp + key[:, None] + offs_d[None, :], mask=kmask, other=0.0)
    else:
        k = tl.load(pool_ptr + slot[:, None] * ROW + offs_d[None, :], mask=kmask, other=0.0)
    return k


@jit
def load_index_scales(pool_ptr, slot, mask, D: tl.constexpr, PAGE: tl.constexpr):
    """The fp32 scales [BK] of the fp8 index keys at `slot` (a page's 64 scales are contiguous)."""
    _, sc = index_fp8_offsets(slot, D, PAGE)
    return tl.load(pool_ptr.to(tl.pointer_type(tl.float32)) + sc, mask=mask, other=0.0)


@jit
def _indexer_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, w_scale, pool_ptr, pt_ptr, stride_pb,
    seq_lens_ptr, q_seq_ptr, q_pos_ptr, out_ptr, stride_ot, Tq, max_len,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROW: tl.constexpr,
    FP8: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # Program (m, n): queries [m*BLOCK_M, +BLOCK_M) x keys [n*BLOCK_N, +BLOCK_N). All H heads of the
    # BLOCK_M queries sit in one [BLOCK_M*HP, DP] register tile so one dot scores the key tile.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M * HP)
    mi = m0 + rows // HP
    hi = rows % HP
    rmask = (mi < Tq) & (hi < H)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    qt = tl.load(
        q_ptr + mi.to(tl.int64)[:, None] * stride_qt + hi[:, None] * stride_qh + offs_d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_M*HP, DP]
    wv = tl.load(w_ptr + mi.to(tl.int64) * stride_wt + hi, mask=rmask, other=0.0)
    wv = wv.to(tl.float32) * w_scale  # [BLOCK_M*HP], the reference's `w.float() * w_scale`
    if FP8 and not IEEE:  # fp16 operands, as in the decode kernel (fp32 q keeps fp32)
        qt, wq = fp16_scaled_q(qt, 1)  # [BLOCK_M*HP, DP] fp16, [BLOCK_M*HP]
        wv = wv * wq

    ms = m0 + tl.arange(0, BLOCK_M)
    mvalid = ms < Tq
    qb = tl.load(q_seq_ptr + ms, mask=mvalid, other=-1).to(tl.int32)
    qp = tl.load(q_pos_ptr + ms, mask=mvalid, other=-1).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    b_lo = tl.min(tl.where(mvalid, qb, 2147483647), axis=0)
    b_hi = tl.max(tl.where(mvalid, qb, -1), axis=0)
    for b in range(b_lo, b_hi + 1):
        in_b = mvalid & (qb == b)
        seqlen = tl.load(seq_lens_ptr + b).to(tl.int64)
        lim = tl.minimum(seqlen, tl.max(tl.where(in_b, qp, -1), axis=0) + 1)  # keys any query of b needs
        if n0 < lim:
            nmask = offs_n < lim
            page = tl.load(pt_ptr + b * stride_pb + offs_n // PAGE, mask=nmask, other=0)
            slot = page.to(tl.int64) * PAGE + offs_n % PAGE  # [BLOCK_N]
            k = load_index_keys(pool_ptr, slot, nmask[:, None] & dmask[None, :], offs_d, D, ROW, FP8, PAGE)
            k = k.to(qt.dtype)
            if FP8:
                kscale = load_index_scales(pool_ptr, slot, nmask, D, PAGE)
            if INTERPRET:  # the interpreter's dot reads bf16 as raw uint16; fp32 is exact for both
                s = tl.dot(qt.to(tl.float32), tl.trans(k.to(tl.float32)))
            elif IEEE:
                s = tl.dot(qt, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(qt, tl.trans(k))
            s = tl.maximum(s, 0.0) * wv[:, None]  # [BLOCK_M*HP, BLOCK_N]
            s = tl.sum(tl.reshape(s, (BLOCK_M, HP, BLOCK_N)), axis=1)  # [BLOCK_M, BLOCK_N]
            if FP8:
                s = s * kscale[None, :]
            valid = in_b[:, None] & (offs_n[None, :] <= qp[:, None]) & (offs_n[None, :] < seqlen)
            acc = tl.where(valid, s, acc)
    omask = mvalid[:, None] & (offs_n[None, :] < max_len)
    tl.store(out_ptr + ms.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], acc, mask=omask)


@jit
def _pow2(e):
    # 2^e as fp32 for integer e in [-126, 127]
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@jit
def fp16_scaled_q(q, AXIS: tl.constexpr):
    """(q * 2^(14 - e_h) as fp16, 2^(e_h - 14) fp32) for the heads of `q` along the other axis.

    e_h = floor(log2 max|q_h|) over AXIS (the head dimension D), so each head's largest element
    lies in [2^14, 2^15) and every bf16 / fp16 element at least 2^-29 of it converts exactly; the
    second value goes back into the head weight. With e4m3 keys converted to fp16 (exact, one
    instruction per two elements; bf16 takes two) the fp16 dot then gives the bf16 dot's products,
    summed in fp32. Shared by the indexer kernels here and the fused top-k kernel.
    """
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=AXIS)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2), amax >= 0
    e = tl.minimum(tl.maximum(e, -110), 127)  # 0 / subnormal heads and the bf16 top stay in range
    if AXIS == 0:
        qop = (qf * _pow2(14 - e)[None, :]).to(tl.float16)
    else:
        qop = (qf * _pow2(14 - e)[:, None]).to(tl.float16)
    return qop, _pow2(e - 14)


@jit
def _decode_pages(pt_row, t, lim, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    # page ids [BLOCK_N] of key tile t's keys; 0 (a page always in the pool) at or past `lim`
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(pt_row + offs_n // PAGE, mask=offs_n < lim, other=0)


@jit
def _indexer_decode_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, w_scale, pool_ptr, pt_ptr, stride_pb,
    seq_lens_ptr, q_seq_ptr, q_pos_ptr, out_ptr, stride_ot, max_len, tiles_per,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ROW: tl.constexpr,
    FP8: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr, SC_AHEAD: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # Program (i, j): query i against key tiles [j*tiles_per, +tiles_per) (of the max_len columns).
    # Keys are the M side of the dot ([BLOCK_N, D] x [D, HP]): the A operand may then come from
    # registers, where fp8 keys are converted, and the head sum runs along the accumulator's rows.
    #
    # fp8 pools, bf16 / fp16 queries: the dot runs in fp16. e4m3 -> fp16 is exact (and cheaper than -> bf16, which
    # takes a second conversion per element), and q is scaled per head by a power of two 2^(14-e)
    # with e = floor(log2 max|q_h|), so every element of q (bf16: 8 significant bits, 11 in fp16)
    # at least 2^-29 of its head's largest converts exactly; the power of two comes back through
    # the head weight. Products and sums are fp32 as in the bf16 dot, so the logits equal the bf16
    # path's up to fp32 rounding.
    i = tl.program_id(0)
    j = tl.program_id(1)
    offs_h = tl.arange(0, HP)
    hmask = offs_h < H
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    qT = tl.load(
        q_ptr + i.to(tl.int64) * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None],
        mask=hmask[None, :] & dmask[:, None],
        other=0.0,
    )  # [DP, HP]
    wv = tl.load(w_ptr + i.to(tl.int64) * stride_wt + offs_h, mask=hmask, other=0.0).to(tl.float32) * w_scale
    if FP8 and not IEEE:  # (fp32 q keeps fp32 operands: fp16 would round it)
        qop, wq = fp16_scaled_q(qT, 0)  # [DP, HP] fp16, [HP]
        wv = wv * wq
        if INTERPRET:
            qop = qop.to(tl.float32)
    elif INTERPRET:
        qop = qT.to(tl.float32)  # the interpreter's dot reads bf16 as raw uint16
    else:
        qop = qT

    b = tl.load(q_seq_ptr + i)
    seqlen = tl.load(seq_lens_ptr + b).to(tl.int64)
    lim = tl.minimum(seqlen, tl.load(q_pos_ptr + i).to(tl.int64) + 1)  # keys this query may see
    lim = tl.minimum(lim, max_len).to(tl.int32)
    t_lo = j * tiles_per
    t_hi = tl.minimum(t_lo + tiles_per, tl.cdiv(max_len, BLOCK_N))
    t_mid = tl.maximum(tl.minimum(t_hi, tl.cdiv(lim, BLOCK_N)), t_lo)
    out_row = out_ptr + i.to(tl.int64) * stride_ot
    pt_row = pt_ptr + b.to(tl.int64) * stride_pb
    # The page ids of tile t + 1 are loaded while tile t is scored, so the key loads depend on
    # loop-carried registers only and Triton's pipeliner can keep num_stages - 1 key tiles in flight.
    pg_nx = _decode_pages(pt_row, t_lo, lim, PAGE, BLOCK_N)
    if SC_AHEAD:
        # Triton pipelines only the loads that feed the dot (the keys); the scales, used after it, would
        # be a plain load waited for in the same iteration: one DRAM round trip per tile. Here they
        # are loaded a tile ahead into registers, from page ids loaded a tile before that (a chain of
        # their own: fed from the keys' page ids, the key loads are no longer pipelined).
        offs_0 = t_lo * BLOCK_N + tl.arange(0, BLOCK_N)
        sc_nx = load_index_scales(pool_ptr, pg_nx.to(tl.int64) * PAGE + offs_0 % PAGE, offs_0 >= 0, D, PAGE)
        pg_sc = _decode_pages(pt_row, t_lo + 1, lim, PAGE, BLOCK_N)
    for t in range(t_lo, t_mid):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = pg_nx.to(tl.int64) * PAGE + offs_n % PAGE  # [BLOCK_N]; page 0 past `lim`
        pg_nx = _decode_pages(pt_row, t + 1, lim, PAGE, BLOCK_N)
        if SC_AHEAD:
            kscale = sc_nx
            offs_nx = offs_n + BLOCK_N
            sc_nx = load_index_scales(
                pool_ptr, pg_sc.to(tl.int64) * PAGE + offs_nx % PAGE, offs_nx >= 0, D, PAGE
            )
            pg_sc = _decode_pages(pt_row, t + 2, lim, PAGE, BLOCK_N)
        # unmasked rows: slots past `lim` are page 0's, always in the pool
        k = load_index_keys(pool_ptr, slot, dmask[None, :], offs_d, D, ROW, FP8, PAGE)
        if FP8:
            if not SC_AHEAD:
                kscale = load_index_scales(pool_ptr, slot, offs_n >= 0, D, PAGE)
            k = k.to(qop.dtype)  # fp16 (exact), or fp32 for fp32 queries
        if INTERPRET:
            s = tl.dot(k.to(tl.float32), qop)
        elif IEEE:
            s = tl.dot(k, qop, input_precision="ieee")
        else:
            s = tl.dot(k, qop)  # [BLOCK_N, HP] fp32
        v = tl.sum(tl.maximum(s, 0.0) * wv[None, :], axis=1)  # [BLOCK_N]
        if FP8:
            v = v * kscale
        tl.store(out_row + offs_n, tl.where(offs_n < lim, v, float("-inf")), mask=offs_n < max_len)
    for t in range(t_mid, t_hi):  # columns past this query's keys
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < max_len)


@jit
def _tma_scales(
    pool_ptr, pt_row, t, lim, PAGES: tl.constexpr, PAGE: tl.constexpr, RPP: tl.constexpr, D: tl.constexpr
):
    # fp32 scales [PAGES, PAGE] of tile t's pages (page 0's past `lim`): a page's PAGE scales follow its keys
    offs_u = t * PAGES + tl.arange(0, PAGES)
    pg = tl.load(pt_row + offs_u, mask=offs_u * PAGE < lim, other=0).to(tl.int64)
    off = pg[:, None] * (RPP * D // 4) + PAGE * D // 4 + tl.arange(0, PAGE)[None, :]
    return tl.load(pool_ptr.to(tl.pointer_type(tl.float32)) + off)


@jit
def _indexer_decode_tma_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, w_scale, kdesc, pool_ptr, pt_ptr, stride_pb,
    seq_lens_ptr, q_seq_ptr, q_pos_ptr, out_ptr, stride_ot, max_len, tiles_per,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, RPP: tl.constexpr,
    PAGES: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(PDL)
    # `_indexer_decode_kernel` with whole pages moved by TMA: the pool is seen as rows of D bytes
    # (`kdesc`, e4m3), RPP rows a page: page p's keys are the [PAGE, D] box at row p * RPP. A loop
    # iteration scores PAGES pages (tile t = pages [t * PAGES, +PAGES) of the request); same numerics
    # as the gather kernel (fp16 operands for bf16 / fp16 queries, the scale after the head sum).
    # Triton pipelines only the loads that feed the dot: a scale load through a descriptor would be
    # issued and waited for in its own iteration, so the scales (256 contiguous bytes after each
    # page's keys) are plain loads a tile ahead into registers, their page ids a tile before that.
    BLOCK_N: tl.constexpr = PAGES * PAGE
    i = tl.program_id(0)
    j = tl.program_id(1)
    offs_h = tl.arange(0, HP)
    hmask = offs_h < H
    offs_d = tl.arange(0, D)
    qT = tl.load(
        q_ptr + i.to(tl.int64) * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None],
        mask=hmask[None, :],
        other=0.0,
    )  # [D, HP]
    wv = tl.load(w_ptr + i.to(tl.int64) * stride_wt + offs_h, mask=hmask, other=0.0).to(tl.float32) * w_scale
    if not IEEE:
        qop, wq = fp16_scaled_q(qT, 0)  # [D, HP] fp16, [HP]
        wv = wv * wq
        if INTERPRET:
            qop = qop.to(tl.float32)
    else:
        qop = qT

    b = tl.load(q_seq_ptr + i)
    seqlen = tl.load(seq_lens_ptr + b).to(tl.int64)
    lim = tl.minimum(seqlen, tl.load(q_pos_ptr + i).to(tl.int64) + 1)
    lim = tl.minimum(lim, max_len).to(tl.int32)
    t_lo = j * tiles_per
    t_hi = tl.minimum(t_lo + tiles_per, tl.cdiv(max_len, BLOCK_N))
    t_mid = tl.maximum(tl.minimum(t_hi, tl.cdiv(lim, BLOCK_N)), t_lo)
    out_row = out_ptr + i.to(tl.int64) * stride_ot
    pt_row = pt_ptr + b.to(tl.int64) * stride_pb
    offs_u = tl.arange(0, PAGES)
    # page ids of the next tile are loaded a tile ahead (page 0, always in the pool, past `lim`), so
    # the descriptor loads depend on loop-carried registers only and can be issued stages - 1 ahead
    pg_nx = tl.load(pt_row + t_lo * PAGES + offs_u, mask=(t_lo * PAGES + offs_u) * PAGE < lim, other=0)
    sc_nx = _tma_scales(pool_ptr, pt_row, t_lo, lim, PAGES, PAGE, RPP, D)  # [PAGES, PAGE]
    for t in range(t_lo, t_mid):
        pgs = pg_nx
        nx = (t + 1) * PAGES + offs_u
        pg_nx = tl.load(pt_row + nx, mask=nx * PAGE < lim, other=0)
        scs = sc_nx
        sc_nx = _tma_scales(pool_ptr, pt_row, t + 1, lim, PAGES, PAGE, RPP, D)
        for u in tl.static_range(PAGES):
            row = tl.sum(tl.where(offs_u == u, pgs, 0)).to(tl.int32) * RPP
            k = kdesc.load([row, 0])  # [PAGE, D] e4m3
            kscale = tl.sum(tl.where(offs_u[:, None] == u, scs, 0.0), axis=0)  # [PAGE] fp32 (exact)
            k = k.to(qop.dtype)
            if INTERPRET:
                s = tl.dot(k.to(tl.float32), qop)
            elif IEEE:
                s = tl.dot(k, qop, input_precision="ieee")
            else:
                s = tl.dot(k, qop)  # [PAGE, HP] fp32
            v = tl.sum(tl.maximum(s, 0.0) * wv[None, :], axis=1) * kscale  # [PAGE]
            offs_n = (t * PAGES + u) * PAGE + tl.arange(0, PAGE)
            tl.store(out_row + offs_n, tl.where(offs_n < lim, v, float("-inf")), mask=offs_n < max_len)
    for t in range(t_mid, t_hi):  # columns past this query's keys
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < max_len)
