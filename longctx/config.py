"""Model configuration, read from a Hugging Face `config.json` (`glm_moe_dsa` or `deepseek_v32`).

Nothing about the architecture is hard-coded elsewhere: every module takes a `ModelConfig`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeGuard

from longctx.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
# sizes a config must give as positive integers (checked before anything is built from them)
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "max_position_embeddings",
)
_NON_NEGATIVE = ("n_shared_experts", "first_k_dense_replace")
# The model dtypes longctx runs, by their torch names (with their bytes per element), and the short names
# users also write for them: one table for Engine(dtype=), --dtype, init-model's dtype, the trainer's
# --save-dtype, the KV cache's bf16 and the KV pools' dense kinds. (config.json keeps torch names:
# transformers reads its dtype as a torch attribute.)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_NAMES = tuple(DTYPE_BYTES)
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
# The KV cache's dtypes (`kv_dtype`: Engine, every --kv-dtype, `longctx plan`) and their other names: fp8
# here, and every name of bfloat16 for bf16 (`kv_dtype_name`).
KV_DTYPE_NAMES = ("auto", "model", "bf16", "fp8_e4m3")
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# The scheduler's policies (`scheduling_policy`: Engine, the Scheduler, every --scheduling-policy)
SCHEDULING_POLICIES = ("fcfs", "priority")
_ROPE_TYPES = ("default", "yarn")
ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    # longctx's own (not in GLM-5 / DeepSeek-V3.2, whose checkpoints leave it 0): each full layer's
    # selection keeps the query's newest `index_local_window` positions (itself and the tokens just
    # before it) and takes the top (index_topk - window) of the earlier keys by index score
    index_local_window: int = 0
    # longctx's own too (0: off): a query at position >= `index_topk_long_from` selects
    # `index_topk_long` (< index_topk, its window included) instead of index_topk. At 1M tokens a late
    # needle's own rows share their attention with the far keys they select; the retrieval model trained
    # to 128K read its near needles back at 1M only with fewer of them (docs/training.md, run 26)
    index_topk_long: int = 0
    index_topk_long_from: int = 0
    # longctx's own too: layers whose KV an fp8 cache keeps in the model dtype (latent + rope rows and,
    # on full layers, index keys). A checkpoint names the layers e4m3 rounding costs it; `Engine(...,
    # kv_fp8_skip_layers=)` overrides it
    kv_fp8_skip_layers: tuple[int, ...] = ()
    indexer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-5
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6}
    )
    max_position_embeddings: int = 1_048_576
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # FP8 block quantisation of the checkpoint's linear weights, as `quantization_config` says.
    quant_block: tuple[int, int] | None = None

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Elements per token per layer in the MLA cache: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default":
            mscale_all_dim = rp.get("mscale_all_dim", 0)
            factor = rp.get("factor", 1.0)
            if mscale_all_dim and factor > 1:
                m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
                scale = scale * m * m
        return scale

    def is_full_indexer(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        if e is None:
            return []
        return list(e) if isinstance(e, list | tuple) else [int(e)]

    # ---- io --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unknown model_type {mt!r}: longctx runs {', '.join(SUPPORTED_MODEL_TYPES)}")
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        if "num_experts" in d and "n_routed_experts" not in d:
            kw["n_routed_experts"] = d["num_experts"]
        # Rope: transformers 5 writes `rope_parameters`; older checkpoints write rope_theta + rope_scaling.
        rp = d.get("rope_parameters")
        if rp is None:
            rp = dict(d.get("rope_scaling") or {})
            rp.setdefault("rope_type", rp.pop("type", "default"))
            rp["rope_theta"] = d.get("rope_theta", 10000.0)
        kw["rope_parameters"] = dict(rp)
        # Per-layer indexer pattern (IndexShare). DeepSeek-V3.2 runs the indexer on every layer.
        it = d.get("indexer_types")
        if it is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                it = (
                    [{"F": "full", "S": "shared"}[c] for c in pattern]
                    if isinstance(pattern, str)
                    else pattern
                )
            elif mt == "glm_moe_dsa":
                freq = max(int(d.get("index_topk_freq", 1)), 1)
                off = int(d.get("index_skip_topk_offset", 2))
                it = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
            else:
                it = ["full"] * n
        kw["indexer_types"] = tuple(it)
        mlt = d.get("mlp_layer_types")
        if mlt is None:
            k = min(int(d.get("first_k_dense_replace", cls.first_k_dense_replace)), n)
            mlt = ["dense"] * k + ["sparse"] * (n - k)
        kw["mlp_layer_types"] = tuple(mlt)
        if "kv_fp8_skip_layers" in d:
            kw["kv_fp8_skip_layers"] = check_kv_fp8_skip_layers(d["kv_fp8_skip_layers"], n)
        q = d.get("quantization_config")
        if q:
            if q.get("quant_method") != "fp8":
                raise ConfigError(f"unsupported quantization_config.quant_method {q.get('quant_method')!r}")
            kw["quant_block"] = tuple(q.get("weight_block_size", [128, 128]))
        if "torch_dtype" not in kw and "dtype" in d:
            kw["torch_dtype"] = d["dtype"]
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"config not found: {p}")
        try:  # (bytes: a file that is not UTF-8 failed in read_text, a traceback)
            d = json.loads(p.read_bytes())
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p} is not a JSON object")
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type (ConfigError passes)
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{p}: a field has the wrong type or value: {e}") from None

    def validate(self) -> None:
        for names, low, what in ((_POSITIVE, 1, "a positive"), (_NON_NEGATIVE, 0, "a non-negative")):
            for name in names:
                v = getattr(self, name)
                if not is_int(v) or v < low:
                    raise ConfigError(f"{name} must be {what} integer, got {v!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) is more than n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) is more than n_group ({self.n_group})")
        _check_real("rms_norm_eps", self.rms_norm_eps, positive=True)
        _check_real("routed_scaling_factor", self.routed_scaling_factor, positive=True)
        rp = self.rope_parameters
        if not isinstance(rp, dict) or rp.get("rope_type", "default") not in _ROPE_TYPES:
            raise ConfigError(f"rope_parameters.rope_type must be one of {list(_ROPE_TYPES)}, got {rp!r}")
        _check_real("rope_parameters.rope_theta", rp.get("rope_theta", 10000.0), positive=True)
        if self.torch_dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.torch_dtype!r}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            ids = v if isinstance(v, list | tuple) else [] if v is None else [v]
            if not all(is_int(i) and 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(
                    f"{name} must be token ids in [0, vocab_size = {self.vocab_size}), got {v!r}"
                )
        n = self.num_hidden_layers
        if len(self.indexer_types) != n:
            raise ConfigError(f"indexer_types has {len(self.indexer_types)} entries for {n} layers")
        if len(self.mlp_layer_types) != n:
            raise ConfigError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {n} layers")
        if n and self.indexer_types[0] != "full":
            raise ConfigError("layer 0 must be a 'full' indexer layer: shared layers reuse an earlier top-k")
        bad = set(self.indexer_types) - {"full", "shared"}
        if bad:
            raise ConfigError(f"indexer_types may hold 'full' or 'shared', not {sorted(bad)}")
        bad = set(self.mlp_layer_types) - {"dense", "sparse"}
        if bad:
            raise ConfigError(f"mlp_layer_types may hold 'dense' or 'sparse', not {sorted(bad)}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError("n_routed_experts must be divisible by n_group")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError("index_head_dim must be at least qk_rope_head_dim")
        check_local_window(self.index_local_window, self.index_topk)
        check_topk_long(self)
        check_kv_fp8_skip_layers(self.kv_fp8_skip_layers, n)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers reads (and longctx reads back identically)."""
        d = asdict(self)
        d.pop("quant_block")
        if not self.index_local_window:  # (a GLM-5 / DeepSeek-V3.2 config.json stays as theirs)
            d.pop("index_local_window")
        if not self.index_topk_long:
            d.pop("index_topk_long")
            d.pop("index_topk_long_from")
        if self.kv_fp8_skip_layers:
            d["kv_fp8_skip_layers"] = list(self.kv_fp8_skip_layers)
        else:
            d.pop("kv_fp8_skip_layers")
        d["indexer_types"] = list(self.indexer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        d["num_key_value_heads"] = self.num_attention_heads
        d["head_dim"] = self.qk_rope_head_dim
        d["dtype"] = d.pop("torch_dtype")
        if self.model_type == "deepseek_v32":
            d.pop("indexer_types")  # DeepSeek-V3.2 has no IndexShare: every layer is full
        if self.quant_block is not None:
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.quant_block),
            }
        return d


def check_layout(cfg: ModelConfig, pp: int, tp: int) -> None:
    """pp pipeline stages of tp tensor-parallel ranks must fit the model: pp in [1, layers], tp a
    divisor of the attention heads."""
    if tp < 1:
        raise ConfigError.about("tp", tp, "must be at least 1")
    if cfg.num_attention_heads % tp:
        raise ConfigError.about("tp", tp, f"must divide num_attention_heads = {cfg.num_attention_heads}")
    if pp < 1 or pp > cfg.num_hidden_layers:
        raise ConfigError.about("pp", pp, f"must be in [1, {cfg.num_hidden_layers}] (the layer count)")


def canonical_dtype(name: object) -> str | None:
    """The torch name of a model dtype given by any of its names (`bfloat16`, `bf16`, `BF16`) or as a
    torch.dtype; None for anything else."""
    key = name.lower() if isinstance(name, str) else str(name).removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    return key if key in DTYPE_NAMES else None


def dtype_name(name: object, extra: Sequence[str] = ()) -> str:
    """`canonical_dtype`, or a ConfigError listing every accepted name (`extra`: the caller's own words,
    such as "auto", first)."""
    canon = canonical_dtype(name)
    if canon is None:
        names = ", ".join((*extra, *DTYPE_NAMES))
        raise ConfigError.about(
            "dtype", repr(name), f"must be one of {names} (or {', '.join(DTYPE_ALIASES)})"
        )
    return canon


def dtype_arg(text: str) -> str:
    """A `--dtype` flag: a model dtype's short names (bf16, half, ...) as its torch name; other text as
    given, for argparse's choices or `dtype_name` to refuse."""
    return canonical_dtype(text) or text


def kv_dtype_name(kv_dtype: str) -> str:
    """A KV cache dtype under its name in `KV_DTYPE_NAMES` (every name of bfloat16 as "bf16", fp8 as
    "fp8_e4m3", any case); anything else as given, for its parser to refuse."""
    if canonical_dtype(kv_dtype) == "bfloat16":
        return "bf16"
    key = kv_dtype.lower() if isinstance(kv_dtype, str) else kv_dtype
    key = KV_DTYPE_ALIASES.get(key, key)
    return key if key in KV_DTYPE_NAMES else kv_dtype


def check_kv_dtype(kv_dtype: str) -> str:
    """`kv_dtype_name`, or a ConfigError listing every accepted name."""
    name = kv_dtype_name(kv_dtype)
    if name not in KV_DTYPE_NAMES:
        names, aliases = ", ".join(KV_DTYPE_NAMES), ", ".join(KV_DTYPE_ALIASES)
        raise ConfigError.about(
            "kv_dtype", repr(kv_dtype), f"must be one of {names} (or {aliases}, bfloat16)"
        )
    return name


def is_int(v: object) -> TypeGuard[int]:
    """An int and not a bool (True would reach torch.topk as a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def int_text(text: object) -> int:
    """An integer as a user types one on a command line ("1_000" and "1,000" read as 1000); ValueError for
    other text."""
    return int(str(text).replace("_", "").replace(",", ""))


def is_real(v: object) -> TypeGuard[float]:
    """A finite int or float, not a bool."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _check_real(name: str, v: object, positive: bool = False) -> None:
    """A finite real number (an int or a float, not a bool or a string), > 0 if `positive`."""
    if not is_real(v) or (positive and v <= 0):
        raise ConfigError(f"{name} must be a finite{' positive' if positive else ''} number, got {v!r}")


def check_local_window(window: object, topk: int) -> None:
    """`index_local_window` must be an int in [0, index_topk): the window takes part of the top-k's budget."""
    if not is_int(window) or not 0 <= window < topk:
        raise ConfigError.about(
            "index_local_window", repr(window), f"must be an int in [0, index_topk = {topk})"
        )


def check_kv_fp8_skip_layers(layers: object, num_layers: int) -> tuple[int, ...]:
    """`kv_fp8_skip_layers`: distinct layer numbers in [0, num_layers) (a list, tuple or other sequence; not a
    string), as a sorted tuple."""
    items = list(layers) if isinstance(layers, Sequence) and not isinstance(layers, str) else None
    if (
        items is None
        or not all(is_int(i) and 0 <= i < num_layers for i in items)
        or len(set(items)) != len(items)
    ):
        # (layer numbers shown as a command line takes them: 1,9)
        shown = ",".join(map(str, items)) if items and all(map(is_int, items)) else repr(layers)
        raise ConfigError.about(
            "kv_fp8_skip_layers", shown, f"must be distinct layer numbers in [0, {num_layers})"
        )
    return tuple(sorted(items))


def check_topk_long(cfg: ModelConfig) -> None:
    """`index_topk_long` / `index_topk_long_from`: both 0 (off), or a top-k in (index_local_window,
    index_topk) from a position >= index_topk (a query there always has more keys than either top-k)."""
    k, start = cfg.index_topk_long, cfg.index_topk_long_from
    for name, v in (("index_topk_long", k), ("index_topk_long_from", start)):
        if not is_int(v) or v < 0:
            raise ConfigError.about(name, repr(v), "must be a non-negative int")
    if not k and not start:
        return
    if not cfg.index_local_window < k < cfg.index_topk:
        raise ConfigError.about(
            "index_topk_long",
            k,
            f"must be in (index_local_window = {cfg.index_local_window}, index_topk = {cfg.index_topk})",
        )
    if start < cfg.index_topk:
        raise ConfigError.about("index_topk_long_from", start, f"must be >= index_topk = {cfg.index_topk}")


# the config fields (and Engine keywords) that change how the same weights select: `with_selection`
SELECTION_FIELDS = ("index_topk", "index_local_window", "index_topk_long", "index_topk_long_from")
# the least of each a command line takes: a top-k of one token at least; 0 turns the others off
SELECTION_MIN = {"index_topk": 1, "index_local_window": 0, "index_topk_long": 0, "index_topk_long_from": 0}


def check_selection_min(name: str, value: int, shown: object = None) -> None:
    """A selection flag's integer (`name` one of SELECTION_FIELDS) at least its SELECTION_MIN, as `serve` and
    the workloads' embedded engine check their flags before any model is read, one message for both
    (`index_topk 0: must be >= 1`; the value as `shown`, the text typed, where given). `with_selection`
    checks the rest against the checkpoint."""
    lo = SELECTION_MIN[name]
    if value < lo:
        raise ConfigError.about(name, value if shown is None else shown, f"must be >= {lo}")


def with_selection(
    cfg: ModelConfig,
    index_topk: int | None = None,
    index_local_window: int | None = None,
    index_topk_long: int | None = None,
    index_topk_long_from: int | None = None,
) -> ModelConfig:
    """`cfg` selecting otherwise (the same weights): each given field instead of the checkpoint's, None
    keeping it; `index_topk_long=0` alone turns the checkpoint's narrowing off. Checked as a whole."""
    if index_topk is not None:
        # every full layer selects this many tokens (a trade of attention work for what a long context
        # keeps in view)
        if not is_int(index_topk):
            raise ConfigError.about("index_topk", repr(index_topk), "must be an int")
        check_selection_min("index_topk", index_topk)  # (serve's and the workloads' message too)
        cfg = replace(cfg, index_topk=index_topk)
    if index_local_window is not None:
        cfg = replace(cfg, index_local_window=index_local_window)
    elif index_topk is not None and cfg.index_local_window >= index_topk:
        # (the error is the override's, as below: the checkpoint's window is no setting the caller gave)
        raise ConfigError.about(
            "index_topk",
            index_topk,
            f"leaves no room for the checkpoint's index_local_window {cfg.index_local_window} (must be > it); "
            "lower {} or raise {}",
            "index_local_window",
            "index_topk",
        )
    check_local_window(cfg.index_local_window, cfg.index_topk)
    if index_topk_long is not None or index_topk_long_from is not None:
        long_k = cfg.index_topk_long if index_topk_long is None else index_topk_long
        start = cfg.index_topk_long_from if index_topk_long_from is None else index_topk_long_from
        if long_k == 0 and index_topk_long_from is None:
            start = 0
        cfg = replace(cfg, index_topk_long=long_k, index_topk_long_from=start)
    try:
        check_topk_long(cfg)
    except ConfigError as e:
        if index_topk is not None and index_topk_long is None:  # a top-k override under a narrowing
            # (the error is the override's: the checkpoint's narrowing is no setting the caller gave)
            theirs = str(e).replace("{", "{{").replace("}", "}}")
            raise ConfigError.about(
                "index_topk",
                index_topk,
                f"does not fit the checkpoint's {theirs}; {{}} 0 turns it off",
                "index_topk_long",
            ) from None
        raise
    return cfg


def check_device_tokens(cfg: ModelConfig, device_tokens: int | None) -> None:
    """HiSparse's cap (`hisparse_device_tokens`, None: none) against `cfg`'s selection (as `with_selection`
    left it): each (request, layer) must keep more tokens on the device than a full layer selects. Checked
    before any weight is read, by the Engine and by `serve` before it binds its port."""
    if device_tokens is not None and device_tokens <= cfg.index_topk:
        raise ConfigError.about(
            "hisparse_device_tokens",
            device_tokens,
            f"must be more than {{}} ({cfg.index_topk}), the tokens a full layer selects",
            "index_topk",
        )


CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def resolve_config(spec: str) -> ModelConfig:
    """A config file, a model directory, or a name from the repo's configs/ (`tiny` or `tiny.json`
    -> configs/tiny.json). Used by `longctx init-model` and `longctx plan`."""
    p = Path(spec)
    if p.exists():
        return ModelConfig.from_json(p)
    named = CONFIGS_DIR / (spec if spec.endswith(".json") else f"{spec}.json")
    if "/" not in spec and named.exists():
        return ModelConfig.from_json(named)
    known = ", ".join(sorted(q.stem for q in CONFIGS_DIR.glob("*.json"))) or "none found"
    raise ConfigError(f"config {spec!r} not found: not a file, nor a name in configs/ ({known})")
