"""Pipeline stages and TP groups on GPUs (NCCL): the CPU tests' parity checks, on CUDA.

On a tiny random checkpoint, pp=1 against pp=2, tp=2, pp=2 x tp=2 (and pp=4 / tp=4 / pp=2 x tp=4
when there are GPUs for them), with and without HiSparse: fp32 model, fp8 KV (CUDA's default),
logits rel <= 1e-3 and identical greedy tokens; plus per-stage stats (host pool bytes, busy time)
and the wall time of a short generate. Needs >= 2 GPUs. Writes stages-check.json / .md.

    python -m bench.stages_check [--out $OUT]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import scratch_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    n = torch.cuda.device_count()
    if n < 2:
        print("needs >= 2 GPUs")
        return 0
    from bench.common import environment, write_results
    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig

    root = Path(__file__).resolve().parents[1]
    cfg = ModelConfig.from_json(root / "configs" / "tiny.json")
    d = init_random_checkpoint(cfg, scratch_dir() / "tiny", seed=0, dtype="float32", std=0.08)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [ids[:40], ids[100:190]]
    kw = dict(device="cuda", dtype="float32", kv_pages=64, chunk_size=128)

    def run(pp: int, tp: int, hs: int | None) -> dict:
        t0 = time.perf_counter()
        with Engine(d, pp=pp, tp=tp, hisparse_device_tokens=hs, **kw) as e:
            up = time.perf_counter() - t0
            logits = e.score(ids)
            t1 = time.perf_counter()
            toks = [c.token_ids for c in e.generate(prompts, max_new_tokens=32, ignore_eos=True)]
            gen_s = time.perf_counter() - t1
            st = e.stats()
        return {"logits": logits, "tokens": toks, "startup_s": up, "generate_s": gen_s, "stats": st}

    res: dict = {"env": environment(), "runs": []}
    rows = [
        "| pp | tp | hisparse | rel | tokens equal | startup s | generate s | host pool bytes/stage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for hs in (None, 96):
        ref = run(1, 1, hs)
        shapes = [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (2, 4)]
        for pp, tp in [s for s in shapes if s[0] * s[1] <= n]:
            r = run(pp, tp, hs)
            rel = ((r["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
            same = r["tokens"] == ref["tokens"]
            ok &= rel <= 1e-3 and same
            host = [s["host_pool_bytes"] for s in r["stats"]["stages"]]
            res["runs"].append(
                {"pp": pp, "tp": tp, "hisparse": hs, "rel": rel, "tokens_equal": same,
                 "startup_s": r["startup_s"], "generate_s": r["generate_s"], "stages": r["stats"]["stages"],
                 "hisparse_stats": r["stats"].get("hisparse")}
            )  # fmt: skip
            rows.append(
                f"| {pp} | {tp} | {hs} | {rel:.2e} | {same} | {r['startup_s']:.1f} | {r['generate_s']:.2f} | {host} |"
            )
            print(rows[-1], flush=True)
    res["ok"] = ok
    write_results("stages-check", res, "\n".join(rows), args.out)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
