"""`longctx plan`: how a model splits into pipeline stages and how many requests of a given context fit.

Pure arithmetic from the config (no torch, no GPU): parameter counts, per-stage weight bytes per GPU (as
the engine loads them and its room check counts them), MLA KV and indexer bytes per request on the device
and in the host pool, prefill activation headroom, and the number of concurrent requests each stage (and
so the pipeline) can hold.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from longctx.cli import CLIError
from longctx.config import KV_DTYPE_NAMES, ModelConfig, kv_dtype_name, resolve_config
from longctx.model.params import (
    WEIGHT_DTYPES,
    indexer_bytes_per_token,
    kv_bytes_of_layers,
    kv_bytes_per_token_per_layer,
    model_weight_bytes,
    n_full_indexer_layers,
    params_active,
    params_total,
    weight_dtype_name,
)
from longctx.stages.partition import DEFAULT_CHUNK, DEFAULT_GPU_MEM, PAGE_TOKENS, StagePlan, partition

_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20}


def parse_bytes(text: str, name: str = "size") -> int:
    """'141G' / '141GB' -> 141e9, '80GiB' -> 80 * 2**30, '1.5T' -> 1.5e12, '1024' -> 1024; refused `about` the
    setting `name` (a flag's dest) otherwise, as are `parse_tokens`' and `parse_int`'s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", text, re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise CLIError.about(name, repr(text), "not a byte size (examples: 141G, 80GiB, 2T, 1073741824)")
    unit = m.group(2).lower()
    mult = 1024 ** "kmgt".index(unit) * 1024 if m.group(3) else _BYTE_UNITS[unit]
    return int(float(m.group(1)) * mult)


def parse_tokens(text: str, name: str = "context") -> int:
    """'1048576' or '1M' (= 2**20) or '128K' (= 128 * 2**10)."""
    m = re.fullmatch(r"\s*(\d+)\s*([km]?)\s*", text, re.IGNORECASE)
    if not m:
        raise CLIError.about(name, repr(text), "not a token count (examples: 1048576, 1M, 128K)")
    return int(m.group(1)) * _TOKEN_UNITS[m.group(2).lower()]


def parse_int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CLIError.about(name, repr(text), "not an integer") from None


def build_report(cfg: ModelConfig, plans: list[StagePlan], opts: dict[str, Any]) -> dict[str, Any]:
    """The `--json` object."""
    ctx = opts["context"]
    kv_tok = kv_bytes_per_token_per_layer(cfg, opts["kv_dtype"])
    idx_tok = indexer_bytes_per_token(cfg, opts["kv_dtype"])
    tokens = -(-ctx // PAGE_TOKENS) * PAGE_TOKENS
    kv_all, index_all = kv_bytes_of_layers(cfg, 0, cfg.num_hidden_layers, opts["kv_dtype"])
    fit_host = [p.requests_fit_host for p in plans if p.requests_fit_host is not None]
    return {
        **opts,
        "params_total": params_total(cfg),
        "params_active": params_active(cfg),
        "num_layers": cfg.num_hidden_layers,
        "full_indexer_layers": n_full_indexer_layers(cfg),
        # the checkpoint on disk; the stages' weight_bytes are what the GPUs hold once loaded
        "model_weight_bytes": model_weight_bytes(cfg, opts["weight_dtype"]),
        "kv_bytes_per_token_per_layer": kv_tok,
        "indexer_bytes_per_token_per_full_layer": idx_tok,
        # (each layer in its dtype: an fp8 cache keeps the config's kv_fp8_skip_layers in bf16)
        "kv_bytes_per_request": tokens * kv_all,
        "indexer_bytes_per_request": tokens * index_all,
        "weight_bytes_per_gpu_max": max(p.weight_bytes for p in plans),
        "weight_bytes_all_gpus": sum(p.weight_bytes for p in plans) * opts["tp"],
        "requests_fit_device": min(p.requests_fit_device for p in plans),
        "requests_fit_host": min(fit_host) if fit_host else None,
        "requests_fit": min(p.requests_fit for p in plans),
        "bottleneck_stage": max(plans, key=lambda p: p.cost_s).stage,
        "stages": [
            {
                "stage": p.stage,
                "layers": list(p.layers),
                "full_indexer_layers": p.full_indexer_layers,
                "node": p.node,
                "cost_ms": p.cost_s * 1e3,
                "weight_bytes": p.weight_bytes,
                "kv_bytes_device": p.kv_bytes_device,
                "kv_bytes_host": p.kv_bytes_host,
                "indexer_bytes": p.indexer_bytes,
                "headroom_bytes": p.headroom_bytes,
                "requests_fit_device": p.requests_fit_device,
                "requests_fit_host": p.requests_fit_host,
                "requests_fit": p.requests_fit,
            }
            for p in plans
        ],
    }


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def format_report(r: dict[str, Any]) -> str:
    """The human-readable table."""
    hs = r["hisparse_device_tokens"]
    lines = [
        f"{r['config']}: {r['params_total'] / 1e9:.2f}B params, {r['params_active'] / 1e9:.2f}B active, "
        f"{r['num_layers']} layers ({r['full_indexer_layers']} full indexer); "
        f"checkpoint {r['weight_dtype']} {r['model_weight_bytes'] / 1e9:.1f} GB on disk",
        f"{r['gpus']} GPUs = pp {r['pp']} x tp {r['tp']}; context {r['context']:,} tokens; kv {r['kv_dtype']} "
        f"({r['kv_bytes_per_token_per_layer']} B/token/layer, indexer "
        f"{r['indexer_bytes_per_token_per_full_layer']} B/token/full layer); "
        f"HiSparse {'off' if hs is None else f'{hs:,} device tokens'}; chunk {r['chunk']}",
        f"GPU {_gb(r['gpu_mem'])} GB, host {_gb(r['host_mem'])} GB per node. "
        "Bytes per GPU; KV/indexer per request; GB = 1e9 B.",
        "",
    ]
    head = ("stage", "layers", "full", "cost ms", "weights", "KV dev", "KV host", "indexer", "headroom", "fit dev",
            "fit host")  # fmt: skip
    rows = [
        (
            str(s["stage"]),
            f"{s['layers'][0]}-{s['layers'][1] - 1}",
            str(s["full_indexer_layers"]),
            f"{s['cost_ms']:.3f}",
            _gb(s["weight_bytes"]),
            _gb(s["kv_bytes_device"]),
            _gb(s["kv_bytes_host"]),
            _gb(s["indexer_bytes"]),
            _gb(s["headroom_bytes"]),
            str(s["requests_fit_device"]),
            "-" if s["requests_fit_host"] is None else str(s["requests_fit_host"]),
        )
        for s in r["stages"]
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        lines.append("  ".join(x.rjust(w) for x, w in zip(row, widths)))
    host = "no limit given" if r["requests_fit_host"] is None else str(r["requests_fit_host"])
    lines += [
        "",
        f"per request: MLA KV {_gb(r['kv_bytes_per_request'])} GB + indexer keys "
        f"{_gb(r['indexer_bytes_per_request'])} GB",
        f"weights as loaded: {_gb(r['weight_bytes_per_gpu_max'])} GB on the fullest GPU, "
        f"{_gb(r['weight_bytes_all_gpus'])} GB over all GPUs",
        f"requests that fit: {r['requests_fit']} (device {r['requests_fit_device']}, host {host}); "
        f"slowest stage {r['bottleneck_stage']}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config)
    gpus = parse_int(args.gpus, "gpus")
    pp = parse_int(args.pp, "pp")
    tp = parse_int(args.tp, "tp")
    if gpus != pp * tp:
        raise CLIError.about("gpus", gpus, f"must equal {{}} x {{}} = {pp} x {tp} = {pp * tp}", "pp", "tp")
    context = parse_tokens(args.context, "context")
    split = None
    if args.layer_split is not None:
        split = [parse_int(x, "layer_split") for x in args.layer_split.split(",") if x.strip()]
    hs = (
        None
        if args.hisparse_device_tokens is None
        else parse_tokens(args.hisparse_device_tokens, "hisparse_device_tokens")
    )
    weight_dtype = args.weight_dtype or ("fp8" if cfg.quant_block else "bf16")
    opts: dict[str, Any] = {
        "config": args.config,
        "gpus": gpus,
        "pp": pp,
        "tp": tp,
        "context": context,
        "kv_dtype": args.kv_dtype,
        "weight_dtype": weight_dtype,
        "gpu_mem": parse_bytes(args.gpu_mem, "gpu_mem"),
        "host_mem": None if args.host_mem is None else parse_bytes(args.host_mem, "host_mem"),
        "hisparse_device_tokens": hs,
        "chunk": parse_tokens(args.chunk, "chunk"),
        "decode_batch": parse_int(args.decode_batch, "decode_batch"),
        "gpus_per_node": parse_int(args.gpus_per_node, "gpus_per_node"),
    }
    plans = partition(
        cfg,
        pp,
        context,
        split,
        tp=tp,
        weight_dtype=weight_dtype,
        kv_dtype=args.kv_dtype,
        gpu_mem=opts["gpu_mem"],
        host_mem=opts["host_mem"],
        hisparse_device_tokens=hs,
        chunk=opts["chunk"],
        decode_batch=opts["decode_batch"],
        gpus_per_node=opts["gpus_per_node"],
    )
    report = build_report(cfg, plans, opts)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="split a model into pipeline stages and count the requests that fit",
        description=__doc__.splitlines()[0],
    )
    # Numbers are parsed in `run`, so a bad value is a one-line error rather than argparse's usage dump.
    p.add_argument(
        "--config", required=True, help="config.json path, model dir, or name in configs/ (glm-5.3, tiny...)"
    )
    p.add_argument("--gpus", required=True, help="total GPUs; must equal pp x tp")
    p.add_argument("--pp", required=True, help="pipeline stages")
    p.add_argument("--tp", default="1", help="tensor-parallel GPUs per stage (default 1)")
    p.add_argument("--context", required=True, help="tokens per request: 1048576, 1M (= 2**20), 128K")
    p.add_argument(
        "--gpu-mem", default=f"{DEFAULT_GPU_MEM // 2**30}GiB", help="memory per GPU (default 140GiB)"
    )
    p.add_argument(
        "--host-mem", default=None, help="host memory per node for KV pools, e.g. 2T (default: no limit)"
    )
    p.add_argument(
        "--kv-dtype",
        type=kv_dtype_name,
        choices=KV_DTYPE_NAMES,
        default="fp8_e4m3",
        help="KV cache dtype, as the engine's --kv-dtype (auto: fp8 on CUDA; model: bf16; default fp8_e4m3)",
    )
    p.add_argument(
        "--weight-dtype",
        type=weight_dtype_name,
        choices=WEIGHT_DTYPES,
        default=None,
        help="default: fp8 for an fp8 checkpoint, else bf16",
    )
    p.add_argument(
        "--hisparse-device-tokens", default=None, help="HiSparse device slots per request and layer"
    )
    p.add_argument(
        "--layer-split", default=None, help="pp-1 cut points (10,20,30) or pp+1 boundaries (0,10,...,78)"
    )
    p.add_argument(
        "--chunk", default=str(DEFAULT_CHUNK), help=f"prefill chunk tokens (default {DEFAULT_CHUNK})"
    )
    p.add_argument(
        "--decode-batch", default="1", help="requests per decode step in the cost model (default 1)"
    )
    p.add_argument("--gpus-per-node", default="8", help="GPUs per node; host memory is per node (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)
