"""`python -m longctx.train`: train (or resume) the retrieval model. See docs/training.md."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, NoReturn


def _ensure_kernels() -> None:
    """Make `longctx.kernels` importable from a plain checkout (no `pip install -e`), as on the GPU box.

    The installed package maps the repo's top-level `kernels/` to `longctx.kernels`; without the
    install, register that directory under the same name before anything imports it.
    """
    import longctx

    if importlib.util.find_spec("longctx.kernels") is not None:
        return
    root = Path(longctx.__file__).resolve().parents[1] / "kernels"
    spec = importlib.util.spec_from_file_location(
        "longctx.kernels", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["longctx.kernels"] = mod
    spec.loader.exec_module(mod)
    longctx.kernels = mod  # type: ignore[attr-defined]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the whole usage of ~60 flags before it
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The flags, one per TrainConfig / DataConfig field and named after it (each flag's dest is its field's
    name: `said_as` names a field in an error by the flag that sets it)."""
    from longctx.config import dtype_arg
    from longctx.train.data import DataConfig, curriculum_text
    from longctx.train.loop import SAVE_DTYPES, TrainConfig
    from longctx.train.model import NEEDLE_FORMS, SELECT_DOTS, SELECT_FORMS, SPARSE_ATTENTION_FORMS

    t, d = TrainConfig(), DataConfig()
    p = _Parser(prog="python -m longctx.train", description=__doc__)
    p.add_argument(
        "--config",
        dest="model_config",
        default=t.model_config,
        help="model config.json (default %(default)s)",
    )
    p.add_argument("--out", required=True, help="output directory (checkpoint + trainer state + log)")
    p.add_argument("--resume", default=None, help="a previous --out directory to continue from")
    p.add_argument("--init-from", default=None, help="a checkpoint to start from (weights only, step 0)")
    p.add_argument("--steps", type=int, default=t.steps, help="total steps of the schedule (%(default)s)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop and save after this wall time")
    p.add_argument("--device", default=t.device, help="auto | cpu | cuda (%(default)s)")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--warmup-steps", type=int, default=t.warmup_steps)
    p.add_argument(
        "--dense-warmup-steps",
        type=int,
        default=t.dense_warmup_steps,
        help="steps of dense attention while the indexer warms up (%(default)s)",
    )
    p.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    p.add_argument(
        "--curriculum",
        default=curriculum_text(d.curriculum),
        help="STEP:SEQLEN,... sequence length from each step on (%(default)s)",
    )
    p.add_argument("--text-fraction", type=float, default=d.text_fraction)
    p.add_argument(
        "--copy-fraction", type=float, default=d.copy_fraction, help="rows of recurring random strings"
    )
    p.add_argument(
        "--task-weights",
        dest="tasks",
        default=None,
        metavar="TASK=W,...",
        help="how often each retrieval task is drawn, relative (e.g. niah_multikey_1=3,vt=0; the others "
        "1.0; default all 1.0, or the resumed run's)",
    )
    p.add_argument(
        "--copy-hex-fraction",
        type=float,
        default=None,
        help="copy rows whose recurring strings are UUIDs (lowercase hex: bytes recur inside a string) "
        f"(default {d.copy_hex_fraction}, or the resumed run's)",
    )
    p.add_argument(
        "--copy-upper-fraction",
        type=float,
        default=None,
        help="copy rows (of those not UUIDs) whose recurring strings are capital letters, as vt's names "
        f"(default {d.copy_upper_fraction}, or the resumed run's)",
    )
    p.add_argument(
        "--copy-pairs-fraction",
        type=float,
        default=None,
        help="copy rows laid out as pairs: each string twice, random chunks of its alphabet between, so "
        f"only copying predicts a repeat (default {d.copy_pairs_fraction}, or the resumed run's)",
    )
    p.add_argument(
        "--vt-hops",
        default=None,
        metavar="H,...",
        help="vt rows' chain lengths, one drawn per row (e.g. 1,2,3,4; default RULER's 4, or the resumed run's)",
    )
    p.add_argument(
        "--pose-max",
        type=int,
        default=None,
        help="PoSE: rows' rotary positions skip so that they span up to this many positions "
        f"(0: positions 0..S-1; default {d.pose_max}, or the resumed run's)",
    )
    p.add_argument(
        "--pose-prob",
        type=float,
        default=None,
        help=f"PoSE: the share of rows with skips (default {d.pose_prob}, or the resumed run's)",
    )
    p.add_argument(
        "--pose-chunks",
        type=int,
        default=None,
        help=f"PoSE: pieces a skipped row is cut into (default {d.pose_chunks}, or the resumed run's)",
    )
    p.add_argument(
        "--pose-far",
        type=float,
        default=None,
        help="PoSE: the share of skipped rows whose skip is drawn uniformly over the range instead of "
        f"log-uniformly (far distances as often as near ones; default {d.pose_far}, or the resumed run's)",
    )
    p.add_argument(
        "--chat-fraction",
        type=float,
        default=None,
        help="retrieval rows rendered in the chat template, as /v1/chat/completions sends them "
        f"(default {d.chat_fraction}, or the resumed run's)",
    )
    p.add_argument(
        "--document-fraction",
        type=float,
        default=None,
        help="niah rows (of those not drawn for chat) as POST /v1/documents/{id}/ask renders them: the "
        f"haystack as the document, then the question (default {d.document_fraction}, or the resumed run's)",
    )
    p.add_argument(
        "--replay-fraction",
        type=float,
        default=None,
        help="steps at a shorter curriculum length begun before (drawn per step), so short rows stay in "
        f"the mix as rows lengthen (default {d.replay_fraction}, or the resumed run's)",
    )
    p.add_argument("--lm-weight", type=float, default=t.lm_weight)
    p.add_argument("--kl-weight", type=float, default=t.kl_weight)
    p.add_argument("--kl-rows", type=int, default=t.kl_rows)
    p.add_argument(
        "--needle-weight",
        type=float,
        default=t.needle_weight,
        help="weight of the indexer's needle loss on answer rows (0: the DSA recipe alone)",
    )
    p.add_argument(
        "--needle-form",
        choices=NEEDLE_FORMS,
        default=t.needle_form,
        help="the needle loss: the index mass on the needle as a whole over the KL's keys (set: the "
        "selection in the sparse stage), or every needle byte's own probability over every causal key "
        "(bytes: a byte ranked out of the selection is pulled back in)",
    )
    p.add_argument(
        "--lead-weight",
        type=float,
        default=t.lead_weight,
        help="weight of each retrieval row's first value byte in the answer loss (1: all answer bytes alike)",
    )
    p.add_argument(
        "--long-topk",
        default=None,
        metavar="S:K",
        help="from rows of S tokens on the sparse stage selects the top K instead of the config's top-k "
        "(e.g. 65536:32: 32 of 128K is the share 256 of 1M is); off by default",
    )
    p.add_argument(
        "--long-topk-prob",
        type=float,
        default=t.long_topk_prob,
        help="the share of those steps that take --long-topk's K (drawn per step)",
    )
    p.add_argument(
        "--kl-local",
        type=int,
        default=t.kl_local,
        metavar="W",
        help="the sparse stage's indexer KL also covers each KL row's last W positions, selected or not "
        "(0: the selection only, as DSA)",
    )
    p.add_argument(
        "--kl-share",
        action=argparse.BooleanOptionalAction,
        default=t.kl_share,
        help="each full layer's indexer KL target averages its own and its IndexShare layers' attention "
        "(default: its own, as DSA)",
    )
    p.add_argument(
        "--index-local-window",
        type=int,
        default=None,
        metavar="W",
        help="the trained model's index_local_window: each query's newest W positions always in every "
        "full layer's selection, the rest of the top-k by index score (saved in the checkpoint's config; "
        "default: the model config's)",
    )
    p.add_argument(
        "--select",
        choices=SELECT_FORMS,
        default=t.select,
        help="the sparse stage's top-k selection: chunked torch scores, the engine's fused indexer + top-k "
        "kernel (nothing of rows x rows in memory), or auto (per row length the faster as the time fit's "
        "probe timed them, from 16K-token rows on; torch without a probe)",
    )
    p.add_argument(
        "--select-dot",
        choices=SELECT_DOTS,
        default=t.select_dot,
        help="the fused selection's fp32 products: three TF32 tensor-core products (~1e-6 relative) or "
        "exact ieee ones (fp32 FMAs); a GPU that cannot compile tf32x3 falls back to ieee by itself",
    )
    p.add_argument(
        "--kv-fp8",
        action="store_true",
        help="every layer's attention reads its latent and rope as the engine's fp8 KV cache (its default "
        "on CUDA) serves them, the gradient passing straight through the rounding",
    )
    p.add_argument(
        "--index-fp8",
        action="store_true",
        help="every full layer's indexer scores its keys as the engine's fp8 KV cache serves them (e4m3, "
        "one scale per key), so training selects the tokens the engine selects; gradient straight through",
    )
    p.add_argument(
        "--sparse-attention",
        choices=SPARSE_ATTENTION_FORMS,
        default=t.sparse_attention,
        help="the sparse stage's attention: over each query's top-k (gather), over every key with the "
        "selection as a mask (mask), or per row length (auto: the faster of the two as the time fit's probe "
        "timed them; mask up to 16K without a probe); the same function",
    )
    p.add_argument(
        "--capitals-from-lowercase",
        action="store_true",
        help="with --init-from: the capitals' embedding and lm_head rows start as the lowercase letters' "
        "(capitals then copy as lowercase letters do; bench.copy_probe)",
    )
    p.add_argument(
        "--train-only",
        choices=("all", "indexer"),
        default=t.train_only,
        help="indexer: only the DSA indexers train, by their KL (the main model stays as loaded)",
    )
    p.add_argument(
        "--advance-exact",
        type=float,
        default=t.advance_exact,
        help="gated curriculum: move to the next length once the answer exact match reaches this "
        "(0: follow the curriculum's steps)",
    )
    p.add_argument("--advance-window", type=int, default=t.advance_window, help="log rows the gate averages")
    p.add_argument("--advance-min-steps", type=int, default=t.advance_min_steps)
    p.add_argument("--save-every", type=int, default=t.save_every)
    p.add_argument("--log-every", type=int, default=t.log_every)
    p.add_argument("--print-every", type=int, default=t.print_every)
    p.add_argument("--num-workers", type=int, default=t.num_workers)
    p.add_argument("--save-dtype", type=dtype_arg, choices=SAVE_DTYPES, default=t.save_dtype)
    p.add_argument("--save-momentum", action="store_true", help="also keep AdamW's first moments")
    p.add_argument(
        "--eval-samples",
        type=int,
        default=t.eval_samples,
        help="NIAH samples per task and length through longctx.Engine at the end (0: none)",
    )
    p.add_argument("--eval-lengths", default=",".join(map(str, t.eval_lengths)))
    return p


# the DataConfig numbers a resumed run keeps from its recipe unless given (beside tasks and vt_hops)
_RESUMED_NUMBERS = (
    "pose_max",
    "pose_prob",
    "pose_chunks",
    "pose_far",
    "chat_fraction",
    "document_fraction",
    "replay_fraction",
    "copy_hex_fraction",
    "copy_upper_fraction",
    "copy_pairs_fraction",
)


def _resumable_data_settings(args: argparse.Namespace, from_recipe: set[str]) -> dict[str, Any]:
    """The --pose-*, --chat-fraction, --document-fraction, --replay-fraction, --copy-hex-fraction,
    --copy-upper-fraction, --task-weights and --vt-hops flags as given; one left out keeps the resumed
    run's saved value (else the default), so a resumed run goes on with the rows it was training on. Adds
    the fields it takes from the saved recipe to `from_recipe`."""
    from longctx.train.checkpoint import read_recipe
    from longctx.train.data import DataConfig, parse_task_weights, parse_vt_hops

    saved = read_recipe(args.resume).get("data", {}) if args.resume else {}
    from_recipe.update(
        k for k in ("tasks", "vt_hops", *_RESUMED_NUMBERS) if getattr(args, k) is None and k in saved
    )
    d = DataConfig()
    out: dict[str, Any] = {}
    if args.tasks is not None:
        out["tasks"] = parse_task_weights(args.tasks)
    else:  # (the recipe's JSON holds [name, weight] lists)
        out["tasks"] = tuple((str(t), float(w)) for t, w in saved.get("tasks", d.tasks))
    out["vt_hops"] = (
        parse_vt_hops(args.vt_hops) if args.vt_hops is not None else tuple(saved.get("vt_hops", ()))
    )
    for k in _RESUMED_NUMBERS:
        given = getattr(args, k)
        default = getattr(d, k)
        out[k] = given if given is not None else type(default)(saved.get(k, default))
    return out


def parse_long_topk(spec: str | None) -> tuple[int, int]:
    """--long-topk "S:K" -> (S, K); None -> (0, 0), off."""
    from longctx.errors import ConfigError

    if spec is None:
        return 0, 0
    try:
        s, k = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError.about("long_topk", repr(spec), "expected S:K (row length : top-k)") from None
    if s < 1 or k < 1:
        raise ConfigError.about("long_topk", repr(spec), "wants a row length and a top-k >= 1")
    return s, k


def parse_lengths(name: str, text: str) -> tuple[int, ...]:
    """'1024,4096' -> (1024, 4096), for the list setting `name`."""
    from longctx.errors import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError.about(name, repr(text), "expected lengths like 1024,4096") from None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the loop, a second Ctrl-C in it, or in the eval (saves are atomic)
        print("interrupted: --out holds the last checkpoint saved, if any", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    _ensure_kernels()
    from longctx.cli import said_as
    from longctx.errors import LongctxError, os_error_line
    from longctx.train.data import DataConfig, parse_curriculum
    from longctx.train.loop import TrainConfig, train

    parser = build_parser()
    args = parser.parse_args(argv)
    from_recipe: set[str] = set()
    try:
        data = DataConfig(
            seed=args.seed,
            tokens_per_step=args.tokens_per_step,
            curriculum=parse_curriculum(args.curriculum),
            text_fraction=args.text_fraction,
            copy_fraction=args.copy_fraction,
            **_resumable_data_settings(args, from_recipe),
        )
        long_topk = parse_long_topk(args.long_topk)
        cfg = dataclasses.replace(
            TrainConfig(),
            model_config=args.model_config,
            out=args.out,
            resume=args.resume,
            init_from=args.init_from,
            steps=args.steps,
            max_minutes=args.max_minutes,
            seed=args.seed,
            device=args.device,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            dense_warmup_steps=args.dense_warmup_steps,
            lm_weight=args.lm_weight,
            kl_weight=args.kl_weight,
            kl_rows=args.kl_rows,
            train_only=args.train_only,
            capitals_from_lowercase=args.capitals_from_lowercase,
            needle_weight=args.needle_weight,
            needle_form=args.needle_form,
            lead_weight=args.lead_weight,
            long_topk_from=long_topk[0],
            long_topk=long_topk[1],
            long_topk_prob=args.long_topk_prob,
            kl_local=args.kl_local,
            kl_share=args.kl_share,
            index_local_window=args.index_local_window,
            sparse_attention=args.sparse_attention,
            select=args.select,
            select_dot=args.select_dot,
            kv_fp8=args.kv_fp8,
            index_fp8=args.index_fp8,
            advance_exact=args.advance_exact,
            advance_window=args.advance_window,
            advance_min_steps=args.advance_min_steps,
            save_every=args.save_every,
            log_every=args.log_every,
            print_every=args.print_every,
            num_workers=args.num_workers,
            save_dtype=args.save_dtype,
            save_momentum=args.save_momentum,
            eval_samples=args.eval_samples,
            eval_lengths=parse_lengths("eval_lengths", args.eval_lengths),
            data=data,
        )
        summary = train(cfg)
    except LongctxError as e:
        # (a setting the resumed run took from its saved recipe is named by the recipe's key)
        recipe = {k: f"--resume's recipe {k}" for k in from_recipe}
        print(f"error: {e.named(said_as(parser, recipe))}", file=sys.stderr)
        return 2
    except OSError as e:  # a save that failed (disk full, ...): the last checkpoint stays as it was
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 130 if summary.get("stopped") == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
