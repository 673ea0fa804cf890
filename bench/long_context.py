"""HiSparse at long context (H200): a 1,048,576-token request with <= 10% of its KV on the GPU.

Runs through the public `Engine` (scheduler, chunked prefill, paged host-backed KV, sparse MLA):
- request_1m: one request of `--ctx` (1,048,576) random tokens of configs/small-1m.json, prefilled
  and decoded greedily with `hisparse_device_tokens` = `--cap-fraction` (0.1) of the context, and
  the same request uncapped; reports prefill seconds, decode ms/token, peak device memory, host
  pool bytes, the device KV fraction (device MLA slot bytes / the request's full MLA KV bytes),
  whether the greedy tokens equal the uncapped run's, and the prefill roofline (FLOPs at the bf16 /
  fp8 GEMM peaks and the swap bytes at the pinned H2D rate, all measured in this run);
- decode_128k: a `--ctx-b` (131,072) request capped and uncapped; decode step ratio and the
  HiSparse hit rate over the decode steps.
Both runs use the absorbed prefill form, so capped and uncapped do identical arithmetic on
identical KV bytes and their tokens must match exactly.

    longctx init-model configs/small-1m.json --out /tmp/small-1m   # or let --model create it
    python -m bench.long_context [--model /tmp/small-1m] [--phases 1m,128k]
    python -m bench.long_context --quick      # CPU, tiny config, seconds (checks the script)

Writes bench/results/long-context-h200.json + .md (and under $OUT when set); with --phases the
new figures are merged into the existing JSON, so the phases can run as separate commands.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
NAME = "long-context-h200"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ensure_model(model: str | None, config: Path) -> Path:
    """The checkpoint dir: `model` if it has a config.json, else a random one of `config` made there."""
    from longctx.checkpoint.init_random import init_random_checkpoint, resolve_config

    out = Path(model) if model else Path(tempfile.gettempdir()) / f"longctx-bench-{config.stem}"
    if not (out / "config.json").exists():
        init_random_checkpoint(resolve_config(str(config)), out, seed=0)
    return out


def active_linear_params(cfg: Any) -> int:
    """Linear weights one token multiplies by (routed experts: only the top-k it picks)."""
    from longctx.model.params import layer_weights

    n = 0
    for i in range(cfg.num_hidden_layers):
        for w in layer_weights(cfg, i):
            if len(w.shape) != 2:
                continue
            frac = cfg.num_experts_per_tok / w.count if w.count > 1 else 1.0
            n += int(w.params * frac)
    return n


def prefill_flops(cfg: Any, ctx: int) -> dict[str, float]:
    """FLOPs of prefilling `ctx` tokens: linear layers, indexer logits (causal), sparse MLA."""
    n_full = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_full_indexer(i))
    L, R, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    # each query scores min(pos + 1, K) keys: 576-d score + 512-d output per head
    sel = sum(min(p + 1, cfg.index_topk) for p in range(0, ctx, max(1, ctx // 4096))) * max(1, ctx // 4096)
    return {
        "linear": 2.0 * active_linear_params(cfg) * ctx,
        "indexer": n_full * 2.0 * cfg.index_n_heads * cfg.index_head_dim * ctx * (ctx + 1) / 2,
        "sparse_mla": cfg.num_hidden_layers * 2.0 * H * (L + R + L) * sel,
    }


def run_request(eng: Any, prompt: list[int], n_decode: int, rid: str) -> dict[str, Any]:
    """Prefill + greedy decode of one request through the step API; per-phase timings and stats.

    The first half of the decode steps runs as the engine runs them (no sync of ours: a step may
    launch the next one's work before the host reads its tokens), timed between the steps that
    return a token (`decode_ms_per_token`, the rate a client sees); the second half syncs the device
    after every step and times each step alone (`decode_ms_per_token_synced`: host and device work
    in a row, nothing overlapped)."""
    from longctx.engine.request import Request, SamplingParams

    dev = eng.device
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    params = SamplingParams(max_new_tokens=n_decode, temperature=0.0, ignore_eos=True)
    eng.add_request(Request(rid, list(prompt), params))
    tokens: list[int] = []
    loop_s: list[float] = []  # engine loop: from the step that returned the last token
    step_s: list[float] = []  # synced: one step alone
    n_loop = n_decode // 2
    prefill_s = 0.0
    at_prefill_end: dict[str, Any] = {}
    t_start = time.perf_counter()
    t_last = t_start
    done = False
    while not done:
        synced = not tokens or len(tokens) > n_loop  # (prefill: synced, for its seconds)
        t0 = time.perf_counter()
        outs = eng.step()
        if synced:
            _sync(dev)
        t1 = time.perf_counter()
        for o in outs:
            if o.rid != rid:
                continue
            if o.new_token_ids:
                if not tokens:  # the step that finished the prompt sampled the first token
                    prefill_s = t1 - t_start
                    at_prefill_end = eng.stats()
                    # a line per phase, so a run cut short by its time limit still says how far it got
                    print(f"[{rid}] prefill {prefill_s:.1f} s", file=sys.stderr, flush=True)
                    t1 = time.perf_counter()  # (the stats are not the next step's time)
                elif synced:
                    step_s.append(t1 - t0)
                else:
                    loop_s.append(t1 - t_last)
                t_last = t1
                tokens.extend(o.new_token_ids)
            done = o.finished
            if o.error:
                raise RuntimeError(o.error)
    end = eng.stats()
    kv = eng.runner.worker.kv

    def ms(xs: list[float]) -> float | None:
        return 1e3 * statistics.median(xs) if xs else None

    if loop_s or step_s:
        print(
            f"[{rid}] decode {len(loop_s)} + {len(step_s)} steps, {ms(loop_s) or 0:.2f} ms/token "
            f"({ms(step_s) or 0:.2f} synced)",
            file=sys.stderr,
            flush=True,
        )
    out: dict[str, Any] = {
        "context_tokens": len(prompt),
        "tokens": tokens,
        "prefill_s": prefill_s,
        "decode_ms_per_token": ms(loop_s),
        "decode_ms_per_token_synced": ms(step_s),
        "decode_steps": len(loop_s) + len(step_s),
        "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "host_pool_bytes": end.get("host_pool_bytes", 0),
        "kv_device_bytes": kv.nbytes(),
    }
    if "hisparse" in end:
        a, z = at_prefill_end.get("hisparse", {}), end["hisparse"]
        hits = z["hits"] - a.get("hits", 0)
        misses = z["misses"] - a.get("misses", 0)
        out["hisparse"] = kv.stats()["hisparse"]  # the cache's own, with cap and overflow figures
        out["prefill_swap_bytes"] = a.get("swap_bytes", 0)
        out["decode_hit_rate"] = hits / max(1, hits + misses)
        out["device_mla_bytes"] = kv.device_kv_bytes()
        out["overflow_rows_max"] = out["hisparse"]["overflow_rows_max"]
    return out


def run_pair(
    model_dir: Path, device: str, prompt: list[int], n_decode: int, cap: int, chunk: int, tag: str
) -> dict[str, Any]:
    """The same request uncapped, then capped at `cap` device tokens per (request, layer)."""
    from longctx import Engine

    pages = -(-(len(prompt) + n_decode) // 64) + 4
    kw = dict(
        device=device,
        kv_pages=pages,
        max_context=len(prompt) + n_decode,
        chunk_size=chunk,
        prefill_form="absorbed",
    )
    res = {}
    for name, hs in (("uncapped", None), ("capped", cap)):
        print(f"[{tag}] {name}: {len(prompt):,} tokens, cap {hs}", file=sys.stderr, flush=True)
        with Engine(model_dir, hisparse_device_tokens=hs, **kw) as eng:
            res[name] = run_request(eng, prompt, n_decode, f"{tag}-{name}")
            res[name]["row_bytes_all_layers"] = _row_bytes_all_layers(eng)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return res


def _row_bytes_all_layers(eng: Any) -> int:
    """A token's MLA row bytes summed over the layers, each in its kind (`Engine.kv_kinds`)."""
    from longctx.kernels.kv_layout import mla_row_bytes

    cfg, kinds = eng.cfg, eng.kv_kinds
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return sum(mla_row_bytes(L, R, kinds.mla(i), eng.dtype) for i in range(cfg.num_hidden_layers))


def summarise_1m(pair: dict[str, Any], cfg: Any, ceilings: dict[str, float]) -> dict[str, Any]:
    c, u = pair["capped"], pair["uncapped"]
    ctx = c["context_tokens"]
    full = ctx * c["row_bytes_all_layers"]
    fl = prefill_flops(cfg, ctx)
    bf16 = ceilings.get("bf16_gemm_flops")
    fp8 = ceilings.get("fp8_gemm_flops", bf16)
    h2d = ceilings.get("pinned_h2d_Bps")
    roof: dict[str, Any] = {"flops": fl}
    if bf16:
        compute_s = (fl["linear"] + fl["sparse_mla"]) / bf16 + fl["indexer"] / (fp8 or bf16)
        swap_s = c.get("prefill_swap_bytes", 0) / h2d if h2d else 0.0
        roof.update(
            compute_s=compute_s,
            swap_s=swap_s,
            roofline_s=max(compute_s, swap_s),
            capped_over_roofline=c["prefill_s"] / max(compute_s, swap_s),
            uncapped_over_roofline=u["prefill_s"] / compute_s,
        )
    return {
        "context_tokens": ctx,
        "device_tokens_cap": c["hisparse"]["device_tokens_cap"],
        "device_kv_fraction": c["device_mla_bytes"] / full,
        "device_kv_fraction_prefill_peak": (
            c["device_mla_bytes"] + c["overflow_rows_max"] * full / ctx / cfg.num_hidden_layers
        )
        / full,
        "tokens_match_uncapped": int(c["tokens"] == u["tokens"]),
        "tokens": c["tokens"],
        "prefill_s": {"capped": c["prefill_s"], "uncapped": u["prefill_s"]},
        **_decode_figures(c, u),
        "peak_device_bytes": {"capped": c["peak_device_bytes"], "uncapped": u["peak_device_bytes"]},
        "host_pool_bytes": c["host_pool_bytes"],
        "full_mla_kv_bytes": full,
        "hisparse": c["hisparse"],
        "decode_hit_rate": c["decode_hit_rate"],
        "prefill_roofline": roof,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _decode_figures(c: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    """The decode step capped and uncapped: as the engine loop runs it, and synced step by step."""
    return {
        key: {"capped": c[key], "uncapped": u[key]}
        for key in ("decode_ms_per_token", "decode_ms_per_token_synced")
    }


def summarise_128k(pair: dict[str, Any]) -> dict[str, Any]:
    c, u = pair["capped"], pair["uncapped"]
    return {
        "context_tokens": c["context_tokens"],
        "device_tokens_cap": c["hisparse"]["device_tokens_cap"],
        "capped_over_uncapped_step": _ratio(c["decode_ms_per_token"], u["decode_ms_per_token"]),
        "capped_over_uncapped_step_synced": _ratio(
            c["decode_ms_per_token_synced"], u["decode_ms_per_token_synced"]
        ),
        "hit_rate": c["decode_hit_rate"],
        **_decode_figures(c, u),
        "prefill_s": {"capped": c["prefill_s"], "uncapped": u["prefill_s"]},
        "tokens_match_uncapped": int(c["tokens"] == u["tokens"]),
        "hisparse": c["hisparse"],
    }


def table(data: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ".3g") -> str:
        return "-" if x is None else format(x, spec)

    rows = ["| figure | capped | uncapped | target |", "|---|---|---|---|"]
    r = data.get("request_1m")
    if r:
        gib = 2**30
        rows += [
            f"| request_1m.context_tokens | {r['context_tokens']:,} | | 1,048,576 |",
            f"| request_1m.device_kv_fraction | {f(r['device_kv_fraction'])} (prefill peak "
            f"{f(r['device_kv_fraction_prefill_peak'])}) | 1 | <= 0.1 |",
            f"| request_1m.tokens_match_uncapped | {r['tokens_match_uncapped']} | | 1 |",
            f"| prefill s | {f(r['prefill_s']['capped'])} | {f(r['prefill_s']['uncapped'])} | < 600 |",
            *_decode_rows("decode ms/token", r, f),
            f"| peak device GiB | {f((r['peak_device_bytes']['capped'] or 0) / gib)} | "
            f"{f((r['peak_device_bytes']['uncapped'] or 0) / gib)} | |",
            f"| host pool GiB | {f(r['host_pool_bytes'] / gib)} | | |",
            f"| decode hit rate | {f(r['decode_hit_rate'])} | | |",
        ]
        roof = r["prefill_roofline"]
        if "roofline_s" in roof:
            rows.append(
                f"| prefill roofline s (compute {f(roof['compute_s'])}, swap {f(roof['swap_s'])}) | "
                f"{f(roof['capped_over_roofline'])}x | {f(roof['uncapped_over_roofline'])}x | |"
            )
    for key in ("decode_128k", "decode_128k_ruler"):
        d = data.get(key)
        if d:
            rows += [
                f"| {key}.capped_over_uncapped_step | {f(d['capped_over_uncapped_step'])} | | <= 1.1 |",
                f"| {key}.hit_rate | {f(d['hit_rate'])} | | >= 0.9 |",
                *_decode_rows(f"{key} ms/token", d, f),
            ]
            if d.get("capped_over_uncapped_step_synced") is not None:
                rows.append(
                    f"| {key}.capped_over_uncapped_step synced | {f(d['capped_over_uncapped_step_synced'])} | | |"
                )
    return "\n".join(rows)


def _decode_rows(name: str, r: dict[str, Any], f: Any) -> list[str]:
    """The decode rows of a result: the engine loop's, and the synced steps' where it has them (results
    written before the fourteenth session timed synced steps only, under `decode_ms_per_token`)."""
    rows = [
        f"| {name} | {f(r['decode_ms_per_token']['capped'])} | {f(r['decode_ms_per_token']['uncapped'])} | |"
    ]
    synced = r.get("decode_ms_per_token_synced")
    if synced:
        rows.append(f"| {name} synced | {f(synced['capped'])} | {f(synced['uncapped'])} | |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (created from --config if empty)")
    p.add_argument(
        "--config", default=None, help="config for a new checkpoint (default configs/small-1m.json)"
    )
    p.add_argument("--ctx", type=int, default=1_048_576)
    p.add_argument("--ctx-b", type=int, default=131_072)
    p.add_argument(
        "--decode",
        type=int,
        default=64,
        help="greedy tokens per request (half timed as the engine loop, half synced)",
    )
    p.add_argument("--cap-fraction", type=float, default=0.1, help="hisparse_device_tokens / context")
    p.add_argument("--cap-b", type=int, default=None, help="device tokens for the 128K request")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--phases", default="check,1m,128k", help="any of check (tiny model on the GPU), 1m, 128k")
    p.add_argument(
        "--prompt",
        choices=("random", "ruler"),
        default="random",
        help="random token ids, or a RULER niah_single_1 sample in bytes (for the trained byte-level model)",
    )
    p.add_argument("--quick", action="store_true", help="CPU, tiny config, tiny lengths")
    p.add_argument("--out", default=None, help="extra output dir (default $OUT when set)")
    args = p.parse_args(argv)

    quick = args.quick
    device = "cpu" if quick or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not quick:
        print("bench.long_context needs CUDA (use --quick for the CPU check)", file=sys.stderr)
        return 0
    if quick:
        args.ctx, args.ctx_b, args.decode, args.chunk = 1024, 512, 8, 256
    config = (
        Path(args.config) if args.config else ROOT / "configs" / ("tiny.json" if quick else "small-1m.json")
    )
    model_dir = ensure_model(args.model, config)
    from longctx.config import ModelConfig

    cfg = ModelConfig.from_json(model_dir)
    ceilings: dict[str, float] = {}
    if device == "cuda":
        from bench.common import measure_ceilings

        ceilings = measure_ceilings()
    gen = torch.Generator().manual_seed(0)
    vocab = min(cfg.vocab_size, 250) if quick else cfg.vocab_size
    data: dict[str, Any] = {}
    out_json = ROOT / "bench" / "results" / f"{NAME}.json"
    if not quick and out_json.exists() and args.phases != "check,1m,128k":
        data = json.loads(out_json.read_text())
    phases = args.phases.split(",")
    if device == "cuda" and "check" in phases:
        # first the tiny model on this GPU: capped must equal uncapped before hours go into 1M
        tiny = ensure_model(None, ROOT / "configs" / "tiny.json")
        ids = torch.randint(0, 250, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
        pair = run_pair(tiny, device, ids, 8, 120, 512, "check")
        ok = pair["capped"]["tokens"] == pair["uncapped"]["tokens"]
        data["gpu_check"] = {"tokens_match_uncapped": int(ok), "hisparse": pair["capped"]["hisparse"]}
        if not ok:
            print("HiSparse GPU check FAILED: capped tokens differ from uncapped", file=sys.stderr)

    def make_prompt(n: int) -> list[int]:
        if args.prompt == "random":
            return torch.randint(0, vocab, (n,), generator=gen).tolist()
        from bench.common import niah_byte_prompt

        return niah_byte_prompt(n - args.decode)

    # the keys (request_1m, decode_128k) are the random-prompt figures of the model given (by
    # default configs/small-1m.json); a RULER prompt (a trained byte-level model) writes its own keys
    # beside them, so neither run overwrites the other
    suffix = "_ruler" if args.prompt == "ruler" else ""
    command = "python -m bench.long_context " + " ".join(sys.argv[1:] if argv is None else argv)
    source = {"prompt": args.prompt, "model": str(args.model or config), "command": command}
    written: list[str] = []  # the keys this run wrote
    if "1m" in phases:
        cap = max(cfg.index_topk + 2, math.floor(args.cap_fraction * args.ctx) - 1)  # + 1 trash row
        prompt = make_prompt(args.ctx)
        pair = run_pair(model_dir, device, prompt, args.decode, cap, args.chunk, "1m")
        data["request_1m" + suffix] = {**summarise_1m(pair, cfg, ceilings), **source}
        written.append("request_1m" + suffix)
    if "128k" in phases:
        cap_b = args.cap_b or max(cfg.index_topk + 2, math.floor(args.cap_fraction * args.ctx_b) - 1)
        prompt = make_prompt(args.ctx_b)
        pair = run_pair(model_dir, device, prompt, args.decode, cap_b, args.chunk, "128k")
        data["decode_128k" + suffix] = {**summarise_128k(pair), **source}
        written.append("decode_128k" + suffix)

    def describe(**fields: Any) -> None:
        # the top level (ceilings, environment, command) describes the random-prompt run; a
        # RULER run keeps its own inside its keys, so it cannot relabel the other run's figures
        for name, value in fields.items():
            for d in [data[key] for key in written] if suffix else [data]:
                d[name] = value

    if suffix:
        describe(ceilings=ceilings)
    else:
        config_name = str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config)
        describe(ceilings=ceilings or data.get("ceilings", {}), command=command, config=config_name)
    md = table(data)
    if quick:
        out = Path(args.out or tempfile.mkdtemp(prefix="long-context-quick-"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "long-context-quick.json").write_text(json.dumps(data, indent=2, default=float) + "\n")
        (out / "long-context-quick.md").write_text(md + "\n")
        print(f"wrote {out}/long-context-quick.json", file=sys.stderr)
    else:
        from bench.common import environment, write_results

        describe(environment=environment())
        extra = args.out or os.environ.get("OUT")
        for path in write_results(NAME, data, md, Path(extra) if extra else None):
            print(f"wrote {path}", file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
