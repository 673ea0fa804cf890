"""The engine-construction flags shared by `longctx generate/score` and `longctx serve`.

`add_engine_args(parser)` declares them; `engine_kwargs(obj)` reads them back (off an argparse
namespace or a `server.engine_proc.EngineSpec`) as `Engine(model_dir, **engine_kwargs(obj))`.
`add_selection_args` / `selection_kwargs`: the selection's four of them alone (the benches' too).
"""

from __future__ import annotations

import argparse
from typing import Any

from longctx.config import (
    DTYPE_NAMES,
    KV_DTYPE_NAMES,
    SCHEDULING_POLICIES,
    SELECTION_FIELDS,
    dtype_arg,
    kv_dtype_name,
)
from longctx.errors import ConfigError

# Engine keyword arguments that both commands expose, in Engine's positional order (then keywords).
ENGINE_FIELDS = (
    "device",
    "dtype",
    "kv_dtype",
    "pp",
    "tp",
    "hisparse_device_tokens",
    "max_context",
    "backend",
    *SELECTION_FIELDS,
    "kv_fp8_skip_layers",
    "scheduling_policy",
    "kv_pages",
    "chunk_size",
    "max_running",
    "cuda_graphs",
)

_CHOICES = {
    "device": ["auto", "cpu", "cuda"],
    "dtype": ["auto", *DTYPE_NAMES],
    "kv_dtype": list(KV_DTYPE_NAMES),
    "backend": ["auto", "torch", "triton"],
    "scheduling_policy": list(SCHEDULING_POLICIES),
}


def add_engine_args(p: argparse.ArgumentParser, *, model_help: str, choices: bool) -> None:
    """--model (required) and the ENGINE_FIELDS flags, with the same names and defaults everywhere.

    `choices=True` lets argparse reject unknown --device/--dtype/--kv-dtype/--backend values (serve);
    with False they reach `Engine`, which raises a ConfigError on them (generate/score). Either way a
    dtype's other names (--dtype bf16, half, ...; --kv-dtype fp8, bfloat16) are read as the names listed
    (`longctx.config.DTYPE_ALIASES`, `KV_DTYPE_ALIASES`).
    """

    def pick(name: str) -> dict[str, Any]:
        return {"choices": _CHOICES[name]} if choices else {"help": " | ".join(_CHOICES[name])}

    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--device", default="auto", **pick("device"))
    p.add_argument("--dtype", default="auto", type=dtype_arg, **pick("dtype"))
    p.add_argument("--kv-dtype", default="auto", type=kv_dtype_name, **pick("kv_dtype"))
    p.add_argument(
        "--kv-fp8-skip-layers",
        default=None,
        metavar="L,..",
        help="layers whose KV an fp8 cache keeps in the model dtype, or 'none' (default: the "
        "checkpoint's kv_fp8_skip_layers)",
    )
    p.add_argument("--backend", default="auto", **pick("backend"))
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument(
        "--hisparse-device-tokens",
        type=int,
        default=None,
        help="device KV slots per request and layer (HiSparse); default: all on device",
    )
    p.add_argument("--max-context", type=int, default=1_048_576, help="longest prompt + output, in tokens")
    policy = pick("scheduling_policy")
    policy["help"] = (
        "fcfs: arrival order (a request's priority must be 0); priority: by each request's priority, lower "
        "first, then arrival, preempting lower-priority requests for pages (vLLM's)"
    )
    p.add_argument("--scheduling-policy", default="fcfs", **policy)
    p.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        metavar="N",
        help="KV pages of 64 tokens per stage (default: what the device's free memory holds, up to what "
        "max_running requests of max_context need)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens a prefill chunk takes, and a step's token budget (default: the engine's)",
    )
    p.add_argument(
        "--max-running",
        "--max-num-seqs",
        dest="max_running",
        type=int,
        default=64,
        help="requests run together at most (--max-num-seqs: vLLM's name for it)",
    )
    # (before --cuda-graphs: an error names a setting by the last flag of its dest, `longctx.cli.said_as`)
    p.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_const",
        const=False,
        help="vLLM's name for --no-cuda-graphs",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps replayed from CUDA graphs (default: on CUDA; --no-cuda-graphs runs them eagerly)",
    )
    add_selection_args(p)


def skip_layers_arg(text: str) -> tuple[int, ...]:
    """`--kv-fp8-skip-layers`: a comma list of layer numbers, or "none" (no layer kept out of fp8)."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError.about(
            "kv_fp8_skip_layers",
            repr(text),
            "expected a comma list of layer numbers (e.g. 4 or 1,4) or 'none'",
        ) from None


def add_selection_args(p: argparse.ArgumentParser) -> None:
    """The flags that change how the same weights select (SELECTION_FIELDS; default each: the checkpoint's),
    for the CLI's engine commands and the benches that load a model."""
    p.add_argument(
        "--index-topk",
        type=int,
        default=None,
        help="tokens each full layer's indexer selects (default: the checkpoint's index_topk)",
    )
    p.add_argument(
        "--index-local-window",
        type=int,
        default=None,
        help="each query's newest positions every full layer keeps in its selection, out of the top-k "
        "(default: the checkpoint's index_local_window, 0 for GLM-5 / DeepSeek-V3.2)",
    )
    p.add_argument(
        "--index-topk-long",
        type=int,
        default=None,
        help="tokens a full layer selects for queries from --index-topk-long-from on, fewer than "
        "--index-topk (default: the checkpoint's index_topk_long, 0: off)",
    )
    p.add_argument(
        "--index-topk-long-from",
        type=int,
        default=None,
        help="the position from which queries select --index-topk-long (default: the checkpoint's)",
    )


def selection_kwargs(obj: Any) -> dict[str, Any]:
    """{field: obj.field} for SELECTION_FIELDS (None: the checkpoint's)."""
    return {name: getattr(obj, name) for name in SELECTION_FIELDS}


def engine_kwargs(obj: Any) -> dict[str, Any]:
    """{field: obj.field} for ENGINE_FIELDS: an argparse namespace or an EngineSpec -> Engine kwargs
    (--kv-fp8-skip-layers' text read as layer numbers; a ConfigError says what is wrong with it)."""
    kw = {name: getattr(obj, name) for name in ENGINE_FIELDS}
    if isinstance(kw["kv_fp8_skip_layers"], str):
        kw["kv_fp8_skip_layers"] = skip_layers_arg(kw["kv_fp8_skip_layers"])
    return kw
