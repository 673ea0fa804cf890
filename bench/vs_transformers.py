"""longctx vs transformers on the same GPU, same random checkpoint (configs/small-1m.json), same run.

Prefill tokens/s at 2K/8K/16K and decode ms/token at 2K/8K/16K (batch 1) for both; the longest
context each reaches; longctx alone at 128K (and 1M with --long), and decode throughput at batch 8
and 32. Decode ms/token is each engine's own loop (transformers' `generate`, longctx's `step()` with its
overlapped launches), from one device sync to the next; longctx's figure with the device synced after every
step is beside it (`decode_ms_synced`). The decode roofline at 128K is the bytes a step must read (weights
touched + KV) at the HBM copy rate measured in the same run. Writes bench/results/vs-transformers-<gpu>.{json,md} (h100, h200, ...).

    python -m bench.vs_transformers [--long] [--quick] [--out $OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, gpu_tag, measure_ceilings, scratch_dir, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def sync() -> None:
    torch.cuda.synchronize()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------- transformers
def hf_run(model_dir: Path, lengths: list[int], decode_tokens: int) -> dict:
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
        .cuda()
        .eval()
    )
    out: dict = {"prefill_tok_s": {}, "decode_ms": {}, "max_context": 0, "errors": {}}
    for n in lengths:
        ids = torch.tensor([prompt(n)], device="cuda")
        try:
            with torch.no_grad():
                model(ids)  # warm at this length too, as longctx is
                sync()
                t = time.perf_counter()
                model(ids, use_cache=False)
                sync()
                pre = time.perf_counter() - t
                t = time.perf_counter()
                g = model.generate(
                    ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False
                )
                sync()
                total = time.perf_counter() - t
            assert g.shape[1] == n + decode_tokens
            out["prefill_tok_s"][n] = n / pre
            out["decode_ms"][n] = (total - pre) / (decode_tokens - 1) * 1e3
            out["max_context"] = n
        except torch.OutOfMemoryError as e:
            out["errors"][n] = "OOM: " + str(e).splitlines()[0][:120]
            break
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        print("transformers", n, out["prefill_tok_s"].get(n), out["decode_ms"].get(n), flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- longctx
def lc_prefill_decode(
    eng, n: int, decode_tokens: int, batch: int = 1, synced: bool = False
) -> tuple[float, float]:
    """(prefill seconds for the batch, decode seconds a step), stepping the engine directly.

    The decode figure is the engine's own loop, as a client sees it: the time between the host receiving
    the rows' first tokens and their (decode_tokens - 1)-th, over the steps between, each step's host
    work overlapping the step before it on the GPU as in serving (transformers' figure is its `generate`
    loop's too). The step that delivers the last token also retires the requests (their pages, the prefix
    cache's hashes of the whole prompt) and is left out. `synced`: the median step with the device synced
    after each one instead (a step's host and GPU time in series)."""
    import itertools

    from longctx.engine.request import Request, SamplingParams

    assert decode_tokens >= 3, "the loop figure needs tokens 1 .. decode_tokens - 1 to span a step"
    tag = next(_ids)
    reqs = [
        Request(
            f"b{tag}-{i}",
            prompt(n, seed=1000 * tag + i),
            SamplingParams(max_new_tokens=decode_tokens, ignore_eos=True),
        )
        for i in range(batch)
    ]
    for r in reqs:
        eng.add_request(r)
    sync()
    t0 = time.perf_counter()
    first_done: float | None = None
    steps: list[float] = []  # synced steps' seconds
    got: dict[int, float] = {}  # tokens every row has -> when the host had them (the first time)
    live = {r.rid for r in reqs}
    for _ in itertools.count():
        t = time.perf_counter()
        outs = eng.step()
        if synced or first_done is None:
            sync()
        now = time.perf_counter()
        if first_done is not None:
            steps.append(now - t)
        elif all(r.output_ids for r in reqs):
            first_done = now - t0
        got.setdefault(min(len(r.output_ids) for r in reqs), now)
        live -= {o.rid for o in outs if o.finished}
        if not live:
            break
    sync()
    assert first_done is not None and steps
    assert all(len(r.output_ids) == decode_tokens for r in reqs)
    if synced:
        steps.sort()
        return first_done, steps[len(steps) // 2]
    lo = min(k for k in got if k >= 1)
    hi = max(k for k in got if k <= decode_tokens - 1)
    return first_done, (got[hi] - got[lo]) / (hi - lo)


_ids = iter(range(1, 1 << 30))


def lc_run(
    model_dir: Path,
    lengths: list[int],
    decode_tokens: int,
    long_lengths: list[int],
    batches: list[int],
    max_context: int,
) -> dict:
    from longctx import Engine

    out: dict = {
        "prefill_tok_s": {},
        "decode_ms": {},
        "decode_ms_synced": {},
        "max_context": 0,
        "errors": {},
        "batch_decode_tok_s": {},
    }
    with Engine(model_dir, device="cuda", dtype="bfloat16", max_context=max_context) as eng:
        lc_prefill_decode(eng, 1024, 4)  # warm-up: compiles every kernel
        for n in lengths + long_lengths:
            try:
                # a first request at each length pays Triton compiles and graph captures: time the second
                lc_prefill_decode(eng, n, 3)
                pre, step = lc_prefill_decode(eng, n, decode_tokens)
                out["prefill_tok_s"][n] = n / pre
                out["decode_ms"][n] = step * 1e3
                _, synced = lc_prefill_decode(eng, n, decode_tokens, synced=True)
                out["decode_ms_synced"][n] = synced * 1e3
                out["max_context"] = n
            except torch.OutOfMemoryError as e:
                out["errors"][n] = "OOM: " + str(e).splitlines()[0][:120]
                break
            print("longctx", n, out["prefill_tok_s"][n], out["decode_ms"][n], flush=True)
        for b in batches:
            # the same run first: it compiles and captures every bucket the measured run steps through (a
            # shorter one did not: the batch's prompts prefill over several steps, so with 4 tokens each the
            # first rows had finished before the last started and the full batch's bucket was first captured
            # inside the measured window, 1.5K tok/s at batch 32 in s58b against ~11K)
            lc_prefill_decode(eng, 2048, decode_tokens, batch=b)
            _, step = lc_prefill_decode(eng, 2048, decode_tokens, batch=b)
            out["batch_decode_tok_s"][b] = b / step
            print("longctx batch", b, out["batch_decode_tok_s"][b], flush=True)
        out["stats"] = {k: v for k, v in eng.stats().items() if not isinstance(v, dict | list)}
    return out


def decode_roofline_s(cfg, ctx: int, hbm: float) -> float:
    """Bytes one batch-1 decode step must read at `ctx` (bf16 weights touched, fp8 KV) / HBM rate."""
    from longctx.model.params import params_active

    w = params_active(cfg) * 2  # bf16 weights a batch-1 token touches
    n_full = sum(1 for t in cfg.indexer_types if t == "full")
    kv = n_full * ctx * (cfg.index_head_dim + 4) + cfg.num_hidden_layers * min(cfg.index_topk, ctx) * 656
    return (w + kv) / hbm


def add_long_from(res: dict, lc: dict, path: Path) -> None:
    """Fold the uncapped 1M request of a long-context JSON into `lc` and `res` (source recorded)."""
    r = json.loads(path.read_text()).get("request_1m")
    if not r or r.get("prefill_s", {}).get("uncapped") is None:
        res["long_from"] = {"source": str(path), "error": "no uncapped request_1m in that file"}
        return
    n = int(r["context_tokens"])
    lc["prefill_tok_s"][n] = n / r["prefill_s"]["uncapped"]
    lc["decode_ms"][n] = r["decode_ms_per_token"]["uncapped"]
    lc["max_context"] = max(lc["max_context"], n)
    res["max_context"]["longctx"] = lc["max_context"]
    res["long_from"] = {
        "source": str(path),
        "note": "the 1M request ran in bench.long_context (same checkpoint, same GPU, same device call)",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="also 1,048,576 tokens")
    ap.add_argument(
        "--long-from",
        type=Path,
        default=None,
        help="instead of --long: take the 1,048,576-token request (uncapped) from the long-context JSON "
        "that `bench.long_context --phases 1m --model M` wrote earlier in the same device call, same M",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", type=Path, default=None, help="an existing small-1m checkpoint")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--sparse-mla-heads-min",
        type=int,
        default=None,
        help="sparse MLA uses impl='heads' from this many queries up (default: the kernel's HEADS_MIN_QUERIES)",
    )
    args = ap.parse_args(argv)
    if args.sparse_mla_heads_min is not None:
        from longctx.kernels import sparse_mla as _sm

        _sm.HEADS_MIN_QUERIES = args.sparse_mla_heads_min
    if not torch.cuda.is_available():
        print("bench/vs_transformers.py needs CUDA; nothing to do on this machine")
        return 0
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig

    cfg = ModelConfig.from_json(ROOT / "configs" / "small-1m.json")
    model_dir = args.model
    if model_dir is None:
        model_dir = scratch_dir() / "small-1m"
        t = time.time()
        init_random_checkpoint(cfg, model_dir, seed=0, dtype="bfloat16")
        print(f"wrote {model_dir} in {time.time() - t:.0f}s", flush=True)
    ceil = measure_ceilings(gemm=False)
    lengths = [2048, 8192] if args.quick else [2048, 8192, 16384]
    decode_tokens = 16 if args.quick else 32
    hf = {} if args.skip_hf else hf_run(model_dir, lengths + ([] if args.quick else [32768]), decode_tokens)
    long_lengths = [131072] + ([1 << 20] if args.long and args.long_from is None else [])
    lc = lc_run(model_dir, lengths, decode_tokens, long_lengths, [8, 32], max_context=(1 << 20) + 4096)
    from longctx.kernels import sparse_mla as _sm

    res: dict = {"env": environment(), "ceilings": ceil, "transformers": hf, "longctx": lc}
    res["sparse_mla_heads_min_queries"] = _sm.HEADS_MIN_QUERIES
    for n in lengths:
        k = f"{n // 1024}k"
        if hf.get("decode_ms", {}).get(n):
            res[f"decode_{k}"] = {
                "transformers_ms": hf["decode_ms"][n],
                "longctx_ms": lc["decode_ms"][n],
                "speedup": hf["decode_ms"][n] / lc["decode_ms"][n],
            }
            res[f"prefill_{k}"] = {
                "transformers_tok_s": hf["prefill_tok_s"][n],
                "longctx_tok_s": lc["prefill_tok_s"][n],
                "speedup": lc["prefill_tok_s"][n] / hf["prefill_tok_s"][n],
            }
    res["max_context"] = {"transformers": hf.get("max_context"), "longctx": lc["max_context"]}
    if args.long_from is not None:
        add_long_from(res, lc, args.long_from)
    if 131072 in lc["decode_ms"]:
        roof = decode_roofline_s(cfg, 131072, ceil["hbm_copy_Bps"])
        res["decode_128k"] = {
            "longctx_ms": lc["decode_ms"][131072],
            "roofline_ms": roof * 1e3,
            "roofline_ratio": lc["decode_ms"][131072] / 1e3 / roof,
            # the device synced after every step: the step's host time in series with its kernels
            "longctx_ms_synced": lc["decode_ms_synced"][131072],
            "roofline_ratio_synced": lc["decode_ms_synced"][131072] / 1e3 / roof,
        }
    rows = ["| figure | transformers | longctx | speedup |", "|---|---|---|---|"]
    for n in lengths:
        k = f"{n // 1024}k"
        if f"prefill_{k}" in res:
            p, d = res[f"prefill_{k}"], res[f"decode_{k}"]
            rows.append(
                f"| prefill {k} tok/s | {p['transformers_tok_s']:.0f} | {p['longctx_tok_s']:.0f} | {p['speedup']:.2f} |"
            )
            rows.append(
                f"| decode {k} ms/token | {d['transformers_ms']:.1f} | {d['longctx_ms']:.1f} | {d['speedup']:.2f} |"
            )
    rows.append(f"| longest context | {hf.get('max_context')} | {lc['max_context']} | |")
    for n in sorted(set(long_lengths) | {n for n in lc["decode_ms"] if n > 131072}):
        if n in lc["decode_ms"]:
            rows.append(
                f"| longctx {n} tokens: prefill tok/s, decode ms | | {lc['prefill_tok_s'][n]:.0f}, "
                f"{lc['decode_ms'][n]:.1f} | |"
            )
    for b, v in lc["batch_decode_tok_s"].items():
        rows.append(f"| longctx decode batch {b}, 2K ctx | | {v:.0f} tok/s | |")
    if "decode_128k" in res:
        x = res["decode_128k"]
        rows.append(
            f"| decode 128K vs roofline | | {x['longctx_ms']:.2f} ms vs {x['roofline_ms']:.2f} ms | "
            f"ratio {x['roofline_ratio']:.2f} |"
        )
        rows.append(
            f"| decode 128K, device synced each step | | {x['longctx_ms_synced']:.2f} ms | "
            f"ratio {x['roofline_ratio_synced']:.2f} |"
        )
    table = "\n".join(rows)
    print(table)
    write_results(f"vs-transformers-{gpu_tag()}", res, table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
