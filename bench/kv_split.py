"""Which half of the fp8 KV cache costs a checkpoint its scores: the MLA rows or the indexer keys.

The engine stores both halves of a token's KV in one kind (`kv_dtype`: fp8 MLA rows go with fp8 index
keys, a model-dtype cache holds both in the model dtype). This runs `bench.retrieval_eval run` with the
two halves split: `--mla fp8 --index model` (fp8 latent + rope rows, model-dtype index keys) or `--mla
model --index fp8`, by building each stage's pools with the other half's kind. Diagnostic only (the
engine keeps a layer's index keys in the kind of its rows); the torch references read either layout on any
device. `--layers L,..` keeps the other layers' rows in the model dtype, as the engine's `kv_fp8_skip_layers`
does with the complement.

    python -m bench.kv_split --mla fp8 --index model -- --model DIR --lengths 4k --samples 20 \
        --tasks niah_multivalue,niah_multiquery --out R
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longctx.kv_kinds import KVKinds  # noqa: E402
from longctx.kvstore.pool import PagedKVPool  # noqa: E402

KINDS = {"fp8": "fp8", "model": "auto"}  # this script's names -> the pools' kinds


@dataclass(frozen=True)
class SplitKinds(KVKinds):
    """KVKinds whose index keys are all of `index_base`, whatever the rows beside them are."""

    index_base: str = "auto"

    def index(self, layer: int) -> str:
        return self.index_base


def split_pools(mla: str, index: str, fp8_layers: frozenset[int] | None = None) -> None:
    """Make every PagedKVPool built from here on hold MLA rows of kind `mla` and index keys of `index`.

    `fp8_layers` (with mla "fp8"): only these layers' rows in fp8, the others' in the model dtype."""
    init = PagedKVPool.__init__

    def __init__(self, cfg, layers, num_pages, kind, dtype, device, page_size=64):  # type: ignore[no-untyped-def]
        everyone = frozenset(range(cfg.num_hidden_layers))
        keep = everyone - fp8_layers if fp8_layers is not None else frozenset()
        kinds = SplitKinds(KINDS[mla], keep, KINDS[index])
        init(self, cfg, layers, num_pages, kinds, dtype, device, page_size)

    PagedKVPool.__init__ = __init__  # type: ignore[method-assign]


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
    if {"--kv-dtype", "--kv-fp8-skip-layers", "--cap-fraction"} & set(rest):
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
