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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {"fp8": "fp8", "model": "auto"}  # this script's names -> the pools' kinds


def split_pools(mla: str, index: str) -> None:
    """Make every PagedKVPool built from here on hold MLA rows of kind `mla` and index keys of `index`."""
    from longctx.kernels.kv_layout import alloc_index_pool, alloc_mla_pool

    from longctx.kvstore.pool import PagedKVPool

    init = PagedKVPool.__init__

    def __init__(self, cfg, layers, num_pages, kind, dtype, device, page_size=64):  # type: ignore[no-untyped-def]
        init(self, cfg, layers, num_pages, KINDS[mla], dtype, device, page_size)
        self.index_kind = KINDS[index]
        L, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
        self._mla = {
            i: alloc_mla_pool(self.num_slots, L, R, self.kind, dtype, device).zero_() for i in layers
        }
        self._index = {
            i: alloc_index_pool(self.num_slots, D, self.index_kind, dtype, device).zero_()
            for i in layers
            if cfg.is_full_indexer(i)
        }

    PagedKVPool.__init__ = __init__  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mla", choices=sorted(KINDS), required=True, help="the MLA rows' kind")
    p.add_argument("--index", choices=sorted(KINDS), required=True, help="the index keys' kind")
    p.add_argument(
        "run_args", nargs=argparse.REMAINDER, help="-- then `bench.retrieval_eval run`'s arguments"
    )
    args = p.parse_args(argv)
    rest = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    if "--kv-dtype" in rest or "--cap-fraction" in rest:
        p.error("the split sets the KV kinds itself and covers the uncapped pools only")
    split_pools(args.mla, args.index)
    from bench.retrieval_eval import main as retrieval_eval

    rc = retrieval_eval(["run", *rest])
    out = Path(rest[rest.index("--out") + 1]) / "run.json"
    if out.exists():  # (the split is not one of run.json's engine flags: recorded beside them)
        meta = json.loads(out.read_text())
        meta["kv_split"] = {"mla": args.mla, "index": args.index}
        out.write_text(json.dumps(meta, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
