"""Which half of the fp8 KV cache costs a checkpoint its scores: the MLA rows or the indexer keys.

The engine stores both halves of a token's KV in one kind (`kv_dtype`: fp8 MLA rows go with fp8 index
keys, a model-dtype cache holds both in the model dtype). This runs `bench.retrieval_eval run` with the
two halves split: `--mla fp8 --index model` (fp8 latent + rope rows, model-dtype index keys) or `--mla
model --index fp8`, by building each stage's pools with the other half's kind. Diagnostic only (the
engine has no such option); the torch references read either layout on any device.

    python -m bench.kv_split --mla fp8 --index model -- --model DIR --lengths 4k --samples 20 \
        --tasks niah_multivalue,niah_multiquery --out R
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {"fp8": "fp8", "model": "auto"}  # this script's names -> the pools' kinds


def split_pools(mla: str, index: str, fp8_layers: frozenset[int] | None = None) -> None:
    """Make every PagedKVPool built from here on hold MLA rows of kind `mla` and index keys of `index`.

    `fp8_layers` (with mla "fp8"): only these layers' rows in fp8, the others' in the model dtype. Their
    pools hold the model dtype and each write is replaced at once by what an fp8 pool would give back
    (`mla_fp8_roundtrip`), which is every value an fp8 pool's reads return."""
    from longctx.kernels.kv_layout import alloc_index_pool, mla_fp8_roundtrip

    from longctx.kvstore.pool import PagedKVPool

    init = PagedKVPool.__init__
    rows_kind = KINDS["model"] if fp8_layers is not None else KINDS[mla]

    def __init__(self, cfg, layers, num_pages, kind, dtype, device, page_size=64):  # type: ignore[no-untyped-def]
        init(
            self, cfg, layers, num_pages, rows_kind, dtype, device, page_size
        )  # (its MLA pools are as asked)
        if self.index_kind == KINDS[index]:
            return
        self.index_kind, D = KINDS[index], cfg.index_head_dim
        self._index = {
            i: alloc_index_pool(self.num_slots, D, self.index_kind, dtype, device).zero_()
            for i in layers
            if cfg.is_full_indexer(i)
        }

    PagedKVPool.__init__ = __init__  # type: ignore[method-assign]
    if fp8_layers is None:
        return

    def after_write(self, layer, ctx):  # type: ignore[no-untyped-def]
        if layer in fp8_layers:
            pool, slots, lora = self._mla[layer], ctx.slot_mapping.long(), self.cfg.kv_lora_rank
            c, r = mla_fp8_roundtrip(pool[slots, :lora], pool[slots, lora:])
            pool[slots] = torch.cat([c, r.to(c.dtype)], -1)

    PagedKVPool.after_write = after_write  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mla", choices=sorted(KINDS), required=True, help="the MLA rows' kind")
    p.add_argument("--index", choices=sorted(KINDS), required=True, help="the index keys' kind")
    p.add_argument(
        "--layers",
        default=None,
        help="with --mla fp8: only these layers' MLA rows in fp8 (comma list), the rest in the model dtype",
    )
    p.add_argument(
        "run_args", nargs=argparse.REMAINDER, help="-- then `bench.retrieval_eval run`'s arguments"
    )
    args = p.parse_args(argv)
    rest = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    if "--kv-dtype" in rest or "--cap-fraction" in rest:
        p.error("the split sets the KV kinds itself and covers the uncapped pools only")
    layers = None
    if args.layers is not None:
        if args.mla != "fp8":
            p.error("--layers picks the layers whose MLA rows are fp8: give it with --mla fp8")
        try:
            layers = frozenset(int(x) for x in args.layers.split(","))
        except ValueError:
            p.error(f"--layers must be a comma list of layer numbers, not {args.layers!r}")
    split_pools(args.mla, args.index, layers)
    from bench.retrieval_eval import main as retrieval_eval

    rc = retrieval_eval(["run", *rest])
    out = Path(rest[rest.index("--out") + 1]) / "run.json"
    if out.exists():  # (the split is not one of run.json's engine flags: recorded beside them)
        meta = json.loads(out.read_text())
        meta["kv_split"] = {"mla": args.mla, "index": args.index, "fp8_layers": sorted(layers or [])}
        out.write_text(json.dumps(meta, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
