"""Correctness of the whole engine on the GPU before anything is timed.

transformers' GlmMoeDsaForCausalLM vs longctx on a tiny random checkpoint, on CUDA: fp32 with the
torch references and with the Triton kernels (logits rel <= 1e-3, identical greedy tokens), and bf16
with fp8 KV through Triton against the torch path on a smooth model; decode through CUDA graphs against
eager decode (plain, HiSparse-capped, with `index_local_window`, and with `index_topk_long` too); and the
engine's CUDA-only set-up paths (`cuda_paths`: `cuda:N`, the default pool's size, the room check against
the GPU's free memory). `sampled_decode` times decode (graphs, overlapped) of small-1m's first four
layers with a GLM vocabulary, greedy, greedy with penalties, temperature-only and top-p sampled (each
CUDA-gated sampler route on and off), with top-p's candidates first and with whole
rows sorted (`sampling.TOP_P_CANDIDATES = 0`), at two temperatures: one where the candidates hold top_p
of the mass, one where they do not. Writes gpu-check.json.

    python -m bench.gpu_check [--only fp32,bf16,graphs,hisparse_graphs,window,topk_long,mixed_kv,cuda_paths,
        sampled_decode]
        [--out $OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import sampler_route, scratch_dir  # noqa: E402

if TYPE_CHECKING:
    from longctx.config import ModelConfig


CHECKS = {
    "fp32", "bf16", "graphs", "hisparse_graphs", "window", "topk_long", "mixed_kv", "cuda_paths", "sampled_decode"
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated checks of fp32, bf16, graphs, hisparse_graphs, window, topk_long, mixed_kv, "
        "cuda_paths, sampled_decode (default: all)",
    )
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only is not None and not only <= CHECKS:
        print(f"gpu_check: --only {args.only}: each of {', '.join(sorted(CHECKS))}", file=sys.stderr)
        return 2

    def want(name: str) -> bool:
        return only is None or name in only

    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    from bench.common import environment, write_results
    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig

    root = Path(__file__).resolve().parents[1]
    base = ModelConfig.from_json(root / "configs" / "tiny.json")
    tmp = scratch_dir()
    res: dict = {"env": environment()}
    smooth = dataclasses.replace(base, index_topk=512, mlp_layer_types=("dense",) * base.num_hidden_layers)
    d2 = init_random_checkpoint(smooth, tmp / "smooth", seed=1, dtype="bfloat16", std=0.08)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    long_prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (900, 1300, 610)
    ]
    if want("fp32"):
        fp32_vs_transformers(base, tmp, ids, res)
    if want("bf16"):
        outs = {}
        for backend in ("torch", "triton"):
            with Engine(
                d2, device="cuda", dtype="bfloat16", kv_dtype="fp8_e4m3", backend=backend, kv_pages=256
            ) as e:
                outs[backend] = e.score(ids)
        rel = float((outs["triton"] - outs["torch"]).abs().max() / outs["torch"].abs().max())
        res["bf16_fp8kv_triton_vs_torch"] = {"rel_err": rel, "ok": rel <= 0.05}
        print(res["bf16_fp8kv_triton_vs_torch"])
    if want("graphs"):
        graph_vs_eager(d2, ids, res)
    if want("hisparse_graphs"):
        hisparse_graph_vs_eager(d2, long_prompts, res)
    if want("window"):
        window_graph_vs_eager(d2, long_prompts, res)
    if want("topk_long"):
        topk_long_graph_vs_eager(d2, long_prompts, res)
    if want("mixed_kv"):
        mixed_kv(d2, ids, long_prompts, res)
    if want("sampled_decode"):
        sampled_decode(base, tmp, ids, res)
    if want("cuda_paths"):
        cuda_paths(d2, ids, tmp, res)
    write_results("gpu-check", res, "\n".join(f"{k}: {v}" for k, v in res.items()), args.out)
    return 0


def fp32_vs_transformers(base: ModelConfig, tmp: Path, ids: list[int], res: dict) -> None:
    """The tiny model in fp32, torch and Triton backends, against transformers: logits and greedy tokens."""
    import transformers

    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint

    d = init_random_checkpoint(base, tmp / "tiny", seed=0, dtype="float32", std=0.08)
    ref = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(d), dtype=torch.float32, attn_implementation="eager"
        )
        .cuda()
        .eval()
    )
    with torch.no_grad():
        want = ref(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
        x = list(ids[:100])
        for _ in range(16):
            x.append(int(ref(torch.tensor([x], device="cuda")).logits[0, -1].argmax()))
    for backend in ("torch", "triton"):
        with Engine(
            d, device="cuda", dtype="float32", backend=backend, chunk_size=128, kv_pages=256, kv_dtype="model"
        ) as e:
            got = e.score(ids)
            toks = e.generate([ids[:100]], max_new_tokens=16, ignore_eos=True)[0].token_ids
        rel = float((got - want).abs().max() / want.abs().max())
        res[f"fp32_{backend}"] = {
            "rel_err": rel,
            "tokens_match": toks == x[100:],
            "ok": rel <= 1e-3 and toks == x[100:],
        }
        print(backend, res[f"fp32_{backend}"], flush=True)


REPS = 3  # sampled_decode: timed runs of each route, their median reported (and max - min as its spread)


def sampled_decode(base: ModelConfig, tmp: Path, ids: list[int], res: dict, device: str = "cuda") -> None:
    """ms per generated token (64 after a 40-token prompt, its prefill included), greedy against temperature
    alone (scaled in the Gumbel kernel or first), greedy with penalties (their kernel or torch form), top_p
    0.9 with and without the candidates route and greedy held to a regex (guided decoding), batch 1, 8 and
    32 (on CUDA small-1m's first four layers with a GLM vocabulary, else `base`'s)."""
    import time

    from longctx import Engine
    from longctx.checkpoint.init_random import init_random_checkpoint
    from longctx.config import ModelConfig

    if device == "cuda":  # a GPU-bound step (~0.7 ms): small-1m's first 4 layers
        big = ModelConfig.from_json(Path(__file__).resolve().parents[1] / "configs" / "small-1m.json")
        n = 4
        base = dataclasses.replace(
            big,
            num_hidden_layers=n,
            indexer_types=big.indexer_types[:n],
            mlp_layer_types=big.mlp_layer_types[:n],
        )
    cfg = dataclasses.replace(base, vocab_size=154_880)
    d = init_random_checkpoint(cfg, tmp / "vocab", seed=2, dtype="bfloat16", std=0.02)
    out: dict = {}
    with Engine(d, device=device, dtype="bfloat16", kv_pages=512) as e:
        std = float(e.score(ids[:64]).std())
        # a temperature that scales the logits to a standard deviation of 6 (peaked: the likeliest 1,024 tokens
        # hold most of the mass) and 1 (flat, for random weights: they do not)
        temps = {"peaked": std / 6.0, "flat": 1.0}
        for batch in (1, 8, 32):
            prompts = [ids[i : i + 40] for i in range(batch)]

            def per_step(prompts: list[list[int]] = prompts, **kw: Any) -> float:
                kw.setdefault("ignore_eos", True)  # (a guide is refused with it; its pattern holds EOS back)
                e.generate(prompts, max_new_tokens=8, **kw)  # (graphs captured)
                t0 = time.perf_counter()
                got = e.generate(prompts, max_new_tokens=64, **kw)
                assert all(len(c.token_ids) == 64 for c in got), [len(c.token_ids) for c in got]
                return (time.perf_counter() - t0) / 64 * 1e3

            # (key, sampler route, generate's sampling arguments): temperature alone with the Gumbel kernel
            # scaling the raw logits itself or the logits scaled first; greedy with every penalty through
            # their kernel or its torch form; top_p with its candidates first or whole rows sorted
            plain = dict(temperature=temps["peaked"], seed=3)
            pen = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
            runs: list[tuple[str, dict, dict]] = [
                ("temperature_ms", {"scale_in_kernel": True}, plain),
                ("temperature_scaled_first_ms", {"scale_in_kernel": False}, plain),
                ("penalties_ms", {"penalties_kernel": True}, pen),
                ("penalties_torch_ms", {"penalties_kernel": False}, pen),
                # greedy held to a regex (200 letters: no EOS before them): its masks, and each step's draw
                # queued behind its forward once the step before is read (the forward stays overlapped)
                ("guided_regex_ms", {}, dict(guided_regex="[a-z ]{200}", ignore_eos=False)),
            ]
            for name, t in temps.items():
                top_p = dict(temperature=t, top_p=0.9, seed=3)
                runs += [
                    (f"top_p_{name}_ms", {}, top_p),
                    (f"top_p_{name}_sorted_ms", {"candidates": 0}, top_p),
                ]
            # every route timed REPS times, the rounds interleaved (greedy, each route, greedy, ...), and the
            # median kept: single 64-token runs at batch 32 moved by ~2 ms between two runs of one call
            times: dict[str, list[float]] = {}
            for _ in range(REPS):
                times.setdefault("greedy_ms", []).append(per_step())
                for key, route, kw in runs:
                    with sampler_route(**route):
                        times.setdefault(key, []).append(per_step(**kw))
            row = {k: statistics.median(v) for k, v in times.items()}
            out[f"batch_{batch}_spread"] = {k: max(v) - min(v) for k, v in times.items()}
            out[f"batch_{batch}"] = row
            print("sampled_decode", batch, {k: round(v, 3) for k, v in row.items()}, flush=True)
    out.update(logit_std=std, temperatures=temps, reps=REPS, ok=True)
    res["sampled_decode"] = out


def graph_vs_eager(d2: Path, ids: list[int], res: dict) -> None:
    from longctx import Engine

    # decode through CUDA graphs, overlapped with device-fed continuations == eager decode one step
    # at a time: same greedy tokens for a ragged batch (bf16, fp8 KV), and the same seeded draws (the
    # sampler's Gumbel kernel, top_p and top_k + min_p)
    prompts = [ids[:n] for n in (37, 100, 211, 300)]
    toks, drawn = {}, {}
    sampled = ({"top_p": 0.9}, {"top_k": 40, "min_p": 0.02})
    draw = {"temperature": 0.8, "seed": 7}
    for graphs in (True, False):
        with Engine(
            d2, device="cuda", dtype="bfloat16", kv_pages=256, cuda_graphs=graphs, overlap=graphs
        ) as e:
            toks[graphs] = [o.token_ids for o in e.generate(prompts, max_new_tokens=24, ignore_eos=True)]
            drawn[graphs] = [
                [o.token_ids for o in e.generate(prompts, max_new_tokens=24, ignore_eos=True, **draw, **kw)]
                for kw in sampled
            ]
            # guided draws (overlapped: each step's forward launched device-fed, its masked draw queued
            # once the step before is read)
            drawn[graphs].append(
                [
                    o.token_ids
                    for o in e.generate(prompts, max_new_tokens=24, guided_regex="[a-z ]{5,40}", **draw)
                ]
            )
            replays = e.runner.graphs.replays if graphs and e.runner.graphs is not None else 0
            if graphs:
                res["graph_vs_eager"] = {
                    "replays": replays,
                    "device_fed_steps": e.stats()["device_fed_steps"],
                }
    same, same_drawn = toks[True] == toks[False], drawn[True] == drawn[False]
    g = res["graph_vs_eager"]
    g.update(
        tokens_match=same,
        sampled_tokens_match=same_drawn,
        ok=same and same_drawn and g["replays"] > 0 and g["device_fed_steps"] > 0,
    )
    print(res["graph_vs_eager"])


def hisparse_graph_vs_eager(d2: Path, long_prompts: list[list[int]], res: dict) -> None:
    from longctx import Engine

    # HiSparse-capped decode through CUDA graphs (overlapped, device-fed) == capped eager decode one
    # step at a time: top-k 512 of up to 1,400 keys with 700 device slots, so misses swap in
    try:
        htoks, hs = {}, {}
        for graphs in (True, False):
            with Engine(d2, device="cuda", dtype="bfloat16", kv_pages=256, cuda_graphs=graphs, overlap=graphs,
                        hisparse_device_tokens=700) as e:  # fmt: skip
                outs = e.generate(long_prompts, max_new_tokens=24, ignore_eos=True)
                htoks[graphs] = [o.token_ids for o in outs]
                hs[graphs] = {
                    "replays": e.runner.graphs.replays if e.runner.graphs is not None else 0,
                    "hisparse": e.stats().get("hisparse"),
                }
        same = htoks[True] == htoks[False]
        res["hisparse_graph_vs_eager"] = {
            **hs[True],
            "tokens_match": same,
            "ok": same and hs[True]["replays"] > 0,
        }
    except Exception as e:  # noqa: BLE001 - report it with the other checks' results
        res["hisparse_graph_vs_eager"] = {"error": repr(e)[:500], "ok": False}
    print(res["hisparse_graph_vs_eager"])


def window_graph_vs_eager(d2: Path, long_prompts: list[list[int]], res: dict) -> None:
    """`index_local_window` 64 (top-k 512 of up to 1,400 keys): decode through CUDA graphs gives eager
    decode's tokens, uncapped and HiSparse-capped (700 slots, each against its own eager run as
    `hisparse_graph_vs_eager` compares), and the window changes them."""
    _selection_graph_vs_eager(
        d2, long_prompts, res, "window_graph_vs_eager", {"index_local_window": 64}, {"index_local_window": 0}
    )


def topk_long_graph_vs_eager(d2: Path, long_prompts: list[list[int]], res: dict) -> None:
    """The same with queries from position 800 on selecting 256 instead of 512 (`index_topk_long`; the
    900- and 1,300-token prompts' prefill takes both selections, and the decode batch's rows sit on both
    sides), against the window alone."""
    window = {"index_local_window": 64}
    _selection_graph_vs_eager(
        d2, long_prompts, res, "topk_long_graph_vs_eager",
        {**window, "index_topk_long": 256, "index_topk_long_from": 800}, window,
    )  # fmt: skip


def mixed_kv(d2: Path, ids: list[int], long_prompts: list[list[int]], res: dict) -> None:
    """An fp8 cache that keeps layers 1 (shared) and 2 (full: its index keys too) in bf16
    (`kv_fp8_skip_layers`): the Triton path's logits against the torch references', then decode through
    CUDA graphs against eager decode, uncapped and capped at 700 slots (host rows and slot buffers of two
    sizes), and the all-fp8 cache writes other tokens."""
    from longctx import Engine

    skip = {"kv_fp8_skip_layers": (1, 2)}
    try:
        outs = {}
        for backend in ("torch", "triton"):
            with Engine(d2, device="cuda", dtype="bfloat16", kv_dtype="fp8_e4m3", backend=backend, kv_pages=256,
                        **skip) as e:  # fmt: skip
                outs[backend] = e.score(ids)
        rel = float((outs["triton"] - outs["torch"]).abs().max() / outs["torch"].abs().max())
        res["mixed_kv_triton_vs_torch"] = {"rel_err": rel, "ok": rel <= 0.05}
    except Exception as e:  # noqa: BLE001 - report it with the other checks' results
        res["mixed_kv_triton_vs_torch"] = {"error": repr(e)[:500], "ok": False}
    print(res["mixed_kv_triton_vs_torch"])
    _selection_graph_vs_eager(
        d2, long_prompts, res, "mixed_kv_graph_vs_eager", skip, {"kv_fp8_skip_layers": ()}
    )


def _selection_graph_vs_eager(
    d2: Path, long_prompts: list[list[int]], res: dict, name: str, sel: dict, base: dict
) -> None:
    """Engines selecting as `sel` says: graphs against eager decode, uncapped and capped at 700 slots;
    `changes_tokens`: eager decode selecting as `base` says writes other tokens."""
    from longctx import Engine

    try:
        toks = {}
        runs = (
            (True, None, True),
            (True, None, False),
            (True, 700, True),
            (True, 700, False),
            (False, None, False),
        )
        for with_sel, cap, graphs in runs:
            with Engine(d2, device="cuda", dtype="bfloat16", kv_pages=256, cuda_graphs=graphs, overlap=graphs,
                        hisparse_device_tokens=cap, **(sel if with_sel else base)) as e:  # fmt: skip
                outs = e.generate(long_prompts, max_new_tokens=24, ignore_eos=True)
                toks[(with_sel, cap, graphs)] = [o.token_ids for o in outs]
        eager = toks[(True, None, False)]
        r = {
            "graphs_match": toks[(True, None, True)] == eager,
            "capped_graphs_match": toks[(True, 700, True)] == toks[(True, 700, False)],
            "changes_tokens": toks[(False, None, False)] != eager,
        }
        res[name] = {**r, "ok": all(r.values())}
    except Exception as e:  # noqa: BLE001 - report it with the other checks' results
        res[name] = {"error": repr(e)[:500], "ok": False}
    print(res[name])


def cuda_paths(d2: Path, ids: list[int], tmp: Path, res: dict) -> None:
    """The engine's set-up paths that only run on CUDA (the CPU suite cannot reach them):
    - `device="cuda:0"` gives `device="cuda"`'s greedy tokens; `cuda:<count>` is refused in one line;
    - the default pool (`kv_pages=None`) takes no more than half the free memory and the pages the
      engine's rule gives (`sizing.default_pages`: half the free memory, at most 80% of what the weights
      leave, at most two max_context requests);
    - the room check against the GPU's free memory: kv_pages=10**9, and GLM-5.3's config (~750 GB of
      weights), are refused with the one line before anything is allocated on the GPU."""
    import shutil

    from longctx import Engine
    from longctx.config import ModelConfig
    from longctx.engine.sizing import PAGE_SIZE
    from longctx.errors import ConfigError

    r: dict = {}
    try:
        toks = {}
        for dev in ("cuda", "cuda:0"):
            with Engine(d2, device=dev, dtype="bfloat16", kv_pages=256) as e:
                toks[dev] = e.generate([ids[:120]], max_new_tokens=16, ignore_eos=True)[0].token_ids
        r["cuda0_tokens_match"] = toks["cuda"] == toks["cuda:0"]

        def refused(**kw: object) -> tuple[str, int]:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            try:
                Engine(**kw).close()  # type: ignore[arg-type]
                msg = ""
            except ConfigError as err:
                msg = str(err)
            torch.cuda.synchronize()
            return msg, torch.cuda.memory_allocated() - before

        n = torch.cuda.device_count()
        msg, _ = refused(model_dir=d2, device=f"cuda:{n}")
        r["cuda_n_refused"] = msg
        msg, grew = refused(model_dir=d2, device="cuda", dtype="bfloat16", kv_pages=10**9)
        r["huge_pool_refused"], r["huge_pool_allocated_bytes"] = msg, grew
        big = tmp / "glm-5.3-config-only"
        big.mkdir(exist_ok=True)
        for f in Path(d2).iterdir():  # the tokenizer and the rest, no weights
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, big / f.name)
        root = Path(__file__).resolve().parents[1]
        shutil.copy(root / "configs" / "glm-5.3.json", big / "config.json")
        msg, grew = refused(model_dir=big, device="cuda", max_context=131072)
        r["big_model_refused"], r["big_model_allocated_bytes"] = msg, grew

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        max_context = ModelConfig.from_json(d2).max_position_embeddings
        before = torch.cuda.memory_allocated()
        with Engine(d2, device="cuda", dtype="bfloat16", max_context=max_context) as e:
            pages = e.allocator.num_pages
            pool = torch.cuda.memory_allocated() - before
            out = e.generate([ids[:120]], max_new_tokens=4, ignore_eos=True)[0].token_ids
        r["default_pages"] = {
            "pages": pages,
            "max_context": max_context,
            "two_requests_pages": 2 * max_context // PAGE_SIZE + 64,
            "free_bytes_before": free,
            "allocated_bytes": pool,
            "generated": len(out),
        }
        ok_pages = 16 <= pages <= 2 * max_context // PAGE_SIZE + 64 and pool <= free // 2 and len(out) == 4
        r["ok"] = (
            r["cuda0_tokens_match"]
            and "CUDA devices" in r["cuda_n_refused"]
            and "GPU memory" in r["huge_pool_refused"]
            and r["huge_pool_allocated_bytes"] == 0
            and "GPU memory" in r["big_model_refused"]
            and r["big_model_allocated_bytes"] == 0
            and ok_pages
        )
    except Exception as e:  # noqa: BLE001 - report it with the other checks' results
        r.update(error=repr(e)[:500], ok=False)
    res["cuda_paths"] = r
    print(res["cuda_paths"])


if __name__ == "__main__":
    sys.exit(main())
