"""The training loop: AdamW + cosine schedule, two DSA stages, deadline checkpoints, resume, JSONL log.

Stages (DeepSeek-V3.2's indexer recipe, adapted to training from scratch): for the first
`dense_warmup_steps` attention is dense (causal) and the indexer learns, by KL, to predict where
the main attention looks; afterwards attention runs over the indexer's top-k (the inference
model), the indexer keeps training by KL on its selected set, and the main model trains through
the sparse attention. See docs/training.md for the recipe and the numbers.

Loss = CE(answer tokens) + lm_weight * CE(all other tokens) + kl_weight * mean indexer KL.
The indexer sees detached inputs, so the KL trains only the indexer and the CE only the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from longctx.config import ModelConfig, canonical_dtype, with_selection
from longctx.engine.sizing import resolve_device  # (the benches import it from here too)
from longctx.errors import ConfigError
from longctx.seeds import MASK63, SEED_RANGE, generator_seed, is_seed
from longctx.train.checkpoint import (
    check_out_dir,
    load_model_weights,
    read_training,
    restore_moments,
    save_training,
)
from longctx.train.data import (
    ANSWER,
    LM,
    Batch,
    BatchDataset,
    DataConfig,
    check_retrieval_fits,
    collate,
    curriculum_text,
)
from longctx.train.model import (
    _FUSED_FROM,
    NEEDLE_FORMS,
    SELECT_DOTS,
    SELECT_FORMS,
    SPARSE_ATTENTION_FORMS,
    Needle,
    TrainCausalLM,
)

# the loop's clock (deadlines, the time fit, the log's rates); tests swap in one driven by the steps
_monotonic = time.monotonic


def capitals_from_lowercase(model: TrainCausalLM) -> None:
    """Set the embedding and lm_head rows of the byte tokens A-Z to those of a-z (in place)."""
    upper = torch.arange(ord("A"), ord("Z") + 1)
    assert model.model.embed_tokens is not None and model.lm_head is not None  # (a whole model)
    with torch.no_grad():
        for w in (model.model.embed_tokens.weight, model.lm_head.weight):
            w[upper] = w[upper + (ord("a") - ord("A"))]


# The dtypes a checkpoint is saved in (the --save-dtype flag also takes their short names, bf16 / fp32 /
# float: `longctx.config.DTYPE_ALIASES`).
SAVE_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class TrainConfig:
    """The recipe. Every field is a CLI flag (`python -m longctx.train --help`)."""

    model_config: str = "configs/retrieval.json"
    out: str = "runs/retrieval"
    resume: str | None = None
    init_from: str | None = None  # start from these weights (fresh optimizer, step 0)
    steps: int = 10000  # length of the cosine schedule (over all resumed runs); 0: fit to max_minutes
    max_minutes: float | None = None  # stop (and save) at this wall-clock budget
    seed: int = 0
    device: str = "auto"
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    lm_weight: float = 0.5
    kl_weight: float = 1.0
    kl_rows: int = 256  # query rows per sequence that the indexer KL is computed on
    # "all", or "indexer": only the DSA indexers train (by their KL against the main attention); the
    # main model stays as loaded and its router bias does not move. The seventh session's CPU check
    # found run 7's weights retrieving 24 of 24 niah_single prompts at 768 tokens with dense attention
    # but 8 of 24 through the top-256 selection: the indexer, not the model, was the gap there.
    train_only: str = "all"
    # with init_from: the byte embeddings and lm_head rows of the capitals A-Z start as those of a-z. A model
    # trained on copy rows of lowercase strings only copies no capitals (bench.copy_probe; vt's names are
    # capitals); with their rows a copy of their lowercase ones, capitals inherit what lowercase letters
    # carry (their copying too), and training has only the case to tell apart
    capitals_from_lowercase: bool = False
    # weight of the indexer's needle loss on answer rows (TrainCausalLM._indexer_kl): -log of the index
    # softmax's mass on the answer value's bytes in the prompt; 0 (the DSA recipe) skips it
    needle_weight: float = 0.0
    # its form (`model.Needle`): "set", the mass on the needle as a whole over the KL's keys (the selection
    # in the sparse stage), or "bytes", every needle byte's own probability over every causal key (run
    # 21's UUID misses are hex letters that dropped out of the selection while its digits stayed in)
    needle_form: str = "set"
    # weight of each retrieval row's first value byte in the answer loss (1: every answer byte alike). The
    # fifteenth session's misses at 32K-128K (bench/results/needle-recall-h200.md) selected the needle
    # and got the value's first digit wrong, then copied the rest: that byte is the hard one
    lead_weight: float = 1.0
    # from rows of `long_topk_from` tokens on (0: never), the sparse stage selects the top `long_topk`
    # instead of the config's top-k, on a `long_topk_prob` share of those steps (drawn per step). At 1M
    # the shipped model's answers are haystack prose although every full layer selects the needle: on the
    # CPU its last prompt row selects 0.62 / 0.94 of the prompt's last 64 positions at 4K (layers 1 / 3),
    # 0.31 / 0.41 at 32K, ever fewer as haystack keys outnumber the question's. 256 of 1M is the
    # share 32 of 128K is, so 128K rows with the top 32 train the indexers to rank what the question
    # needs as high as 1M needs it (a hypothesis: the row that writes the answer's first byte reads the
    # question, 0.39-0.74 of layers 1 / 3's attention at 4K-16K, bench/results/long-parity-cpu.md)
    long_topk_from: int = 0
    long_topk: int = 0
    long_topk_prob: float = 1.0
    # the sparse stage's indexer KL (and needle loss) over each KL row's selection plus its last
    # `kl_local` causal positions, selected or not (0: the selection only, DSA's L_I). Over the selection
    # alone a token the indexer ranks out of the top-k gets no gradient back in: at 1M the shipped model
    # selects almost none of the question (0.00-0.06 of the prompt's last 64 positions, the seventeenth
    # session), and --long-topk's smaller selections only make that worse unless the KL reaches past them
    kl_local: int = 0
    # each full layer's KL target: the mean of its own and its IndexShare layers' attention (they attend
    # over its selection; in the retrieval model layers 2 and 4 read the needle while full layers 1 and 3
    # read the question: bench.long_parity's table), not its own alone as in DSA
    kl_share: bool = False
    # the model's `index_local_window` (each query's newest W positions always in its selection, the rest
    # of the top-k by index score; `model.indexer.with_local_window`), saved in the checkpoint's config
    # (None: the resumed or --init-from checkpoint's, else the model config's). At 1M the top 256 held
    # almost none of the question and the answer's first byte came out as haystack prose; with the
    # question forced in, the space (eighteenth session)
    index_local_window: int | None = None
    # the sparse stage's attention (TrainCausalLM.sparse_attention): auto, gather or mask; the same
    # function, different cost. auto takes at each row length the form the time fit's probe timed
    # faster (`sparse_forms`); without a probe (a fixed --steps) masked up to 16K-token rows, gathered
    # beyond
    sparse_attention: str = "auto"
    # the sparse stage's top-k selection (TrainCausalLM.select_form): "torch" (chunked scores, then
    # top-k), "fused" (the engine's fused prefill indexer + top-k kernel; 2x faster at 128K on the H200) or
    # "auto" (per row length the one the time fit's probe timed faster, `select_forms`; torch below
    # 16K-token rows and without a probe)
    select: str = "torch"
    # the fused selection's fp32 products (TrainCausalLM.select_dot): "tf32x3" (three TF32 tensor-core
    # products, ~1e-6 relative) or "ieee" (exact, fp32 FMAs); see kernels.indexer_topk
    select_dot: str = "tf32x3"
    # the attention reads the KV as the engine's fp8 cache serves it (TrainCausalLM.kv_fp8)
    kv_fp8: bool = False
    # the indexers score the keys as the engine's fp8 index cache serves them (TrainCausalLM.index_fp8)
    index_fp8: bool = False
    # filled by the time fit with select auto: ((row length, "torch" | "fused"), ...)
    select_forms: tuple[tuple[int, str], ...] = ()
    # filled by the time fit with auto: ((row length, "gather" | "mask"), ...), the faster form per length
    sparse_forms: tuple[tuple[int, str], ...] = ()
    dense_warmup_steps: int = 5500  # dense attention until the 4096 phase (retrieval first, then sparsity)
    bias_update_rate: float = 1e-3
    save_every: int = 500
    log_every: int = 10
    print_every: int = 0  # also print a log line every N steps (0: only at saves)
    num_workers: int = 4
    save_dtype: str = "bfloat16"  # one of SAVE_DTYPES, by its torch name
    save_momentum: bool = False
    # gated curriculum (advance_exact > 0): the curriculum's lengths in order, each next one only once
    # the answer exact match (mean of the last advance_window log rows at this length) reaches
    # advance_exact, after at least advance_min_steps steps at it; the curriculum's step numbers are
    # then ignored. Run 5 showed what moving on by the clock does to a half-learned skill.
    advance_exact: float = 0.0
    advance_window: int = 10
    advance_min_steps: int = 100
    eval_samples: int = 0  # NIAH samples per (task, length) after training (0: no eval)
    eval_lengths: tuple[int, ...] = (1024, 4096)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        # any name of a dtype (bf16, BF16, torch.float32) as its torch name, as the CLI's --save-dtype reads it
        # and as recipes record it; another value stays for check_config to refuse
        canon = canonical_dtype(self.save_dtype)
        if canon is not None:
            object.__setattr__(self, "save_dtype", canon)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


NOMINAL_STEPS = TrainConfig.steps  # with steps=0 the curriculum's step numbers are read out of this
# rows of this many tokens on are timed once after the warm-up, not `reps` times: each timed step of a
# 256K row is ~10-25 s of the training budget, and a median of three of them moves the fit little
_PROBE_ONE_REP_FROM = 131072
# once the fused selection's step beat the chunked one's by this factor at a length, longer lengths time
# the fused one alone: both grow as S^2, the fused one's lead with S (H200, run 25's probe: 2.4x at 64K,
# 3.5x at 128K), and the chunked step's two probe runs at 256K would be ~1 minute of the training budget
FUSED_ALONE_LEAD = 1.5


def free_after_oom(model: TrainCausalLM, device: torch.device) -> None:
    """After a step ran out of device memory: drop its gradients and hand the allocator's cached blocks
    back, so what comes next (another form, a retry, the save) starts from what the run really holds."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def probe_step_seconds(
    model: TrainCausalLM, cfg: TrainConfig, device: torch.device, reps: int = 3
) -> tuple[dict[int, float], dict[int, str]]:
    """Seconds of one sparse-stage forward + backward at each curriculum length (no optimizer step),
    and, with `sparse_attention="auto"`, the sparse attention form ("gather" or "mask") that ran it
    fastest at that length. With `select_form="auto"` it also times, from `_FUSED_FROM`-token rows on,
    the step with the fused selection, and leaves the faster selection per length in
    `model.measured_selects` (a fused step that fails in any way, out of memory or a kernel that does
    not compile, leaves that length to the torch selection).

    "auto" times both forms at each length, shortest first, until the gathered one wins or the masked
    one runs out of memory; longer rows then take the gathered form untimed (the masked form's cost
    grows as S^2 per row, the gathered one's as S * top-k). A fixed form is timed alone. A length at
    which no form fits a step in memory ends the probe: it and the longer lengths get no seconds.
    Likewise once the fused selection won at a length by FUSED_ALONE_LEAD, longer lengths time it alone
    (the chunked selection untimed: it would lose by more), unless it fails there."""
    from longctx.train.data import make_batch

    # the steps timed select each indexer's own top-k: not a --long-topk draw, which made the seventeenth
    # session's probe time (and choose forms by) the top 32 or the top 256 by the luck of step 0's draw;
    # the own top-k is the costlier step of the two in the gathered form, so the fit errs short
    own_topk = dataclasses.replace(cfg, long_topk_from=0)

    def median_seconds(batch: Any, rival: float | None = None) -> float:
        # `rival`: the time to beat; a timed step over twice it ends the timing there (a form that
        # slow loses anyway, and its reps would come out of the training budget: the seventeenth
        # session's fused top-32 steps at 128K took 69 s each against 6.8)
        times = []
        n = reps if batch.ids.shape[1] < _PROBE_ONE_REP_FROM else 1  # a long step varies little
        for i in range(n + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss, _, _ = compute_loss(model, batch, own_topk, step, device)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
                if rival is not None and times[-1] > 2 * rival:
                    return times[-1]
        return sorted(times)[len(times) // 2]

    seconds: dict[int, float] = {}
    forms: dict[int, str] = {}
    step = max(cfg.dense_warmup_steps, 0)
    auto = model.sparse_attention == "auto"
    mask_lost = False  # the gathered form already won at a shorter length (or the mask did not fit)
    fused_lead = False  # the fused selection won by FUSED_ALONE_LEAD at a shorter length
    # the phase's own length: with replay the step a phase begins at may draw a shorter one (the
    # thirteenth session's H200 probe timed a 16K row for the 64K phase: 0.35 s against ~3 s)
    own = dataclasses.replace(cfg.data, replay_fraction=0.0)

    def time_forms(batch: Any, S: int, timed: dict[str, float], suffix: str) -> None:
        # each attention form's step at S (with the selection measured_selects[S] names), into
        # timed[form + suffix]; a form that does not fit in memory gets no entry
        for form in ("gather",) if mask_lost or not auto else ("gather", "mask"):
            if auto:
                model.measured_forms[S] = form
            try:
                timed[form + suffix] = median_seconds(batch, rival=min(timed.values(), default=None))
            except torch.OutOfMemoryError:  # this form does not fit a step at S
                free_after_oom(model, device)

    def fused_failed(S: int, e: Exception) -> None:  # the fused kernel's first GPU runs may fail
        free_after_oom(model, device)
        print(json.dumps({"probe": {"seq_len": S, "fused_failed": f"{type(e).__name__}: {e}"[:300]}}))

    for first, S in sorted(cfg.data.curriculum, key=lambda p: p[1]):
        if S in seconds:
            continue
        batch = make_batch(own, first)
        assert batch.ids.shape[1] == S
        timed: dict[str, float] = {}
        fusing = model.select_form == "auto" and S >= _FUSED_FROM
        if fusing and fused_lead:  # the fused selection alone
            model.measured_selects[S] = "fused"
            try:
                time_forms(batch, S, timed, "+fused")
            except Exception as e:  # then both selections are timed, as below
                fused_failed(S, e)
                timed.clear()
            if not timed:
                model.measured_selects.pop(S)
        alone = bool(timed)
        if not alone:
            time_forms(batch, S, timed, "")
        if not timed:  # no form fits: S and every longer length are left out of the seconds
            model.measured_forms.pop(S, None)
            break
        best = min(timed, key=timed.__getitem__).removesuffix("+fused")  # the attention form
        if auto:
            model.measured_forms[S] = best
        if fusing and not alone:
            model.measured_selects[S] = "fused"
            try:
                timed[best + "+fused"] = median_seconds(batch, rival=timed[best])
            except Exception as e:  # any failure leaves S to torch
                fused_failed(S, e)
            fastest = min(timed, key=timed.__getitem__)  # (a tie keeps the chunked selection)
            model.measured_selects[S] = "fused" if fastest == best + "+fused" else "torch"
            fused_lead = fastest == best + "+fused" and timed[best] >= FUSED_ALONE_LEAD * timed[fastest]
        print(json.dumps({"probe": {"seq_len": S, "seconds": timed}}), flush=True)
        seconds[S] = min(timed.values())
        if auto:
            forms[S] = best
            mask_lost = forms[S] == "gather"
    model.measured_forms = dict(forms)
    return seconds, forms


def fit_schedule(cfg: TrainConfig, step_s: dict[int, float], budget_s: float) -> TrainConfig:
    """The schedule length N whose curriculum (step numbers scaled by N / NOMINAL_STEPS) fills budget_s.

    The dense warm-up is scaled the same way (a value past NOMINAL_STEPS keeps the whole run dense).
    The probe times sparse steps, which bounds the dense ones from above. With replay a phase's step
    is its length's, or (`replay_fraction` of them) that of a shorter one begun before, each alike."""
    cur = cfg.data.curriculum
    bounds = [first / NOMINAL_STEPS for first, _ in cur] + [1.0]
    F = cfg.data.replay_fraction

    def phase_s(i: int) -> float:
        first, S = cur[i]
        shorter = cfg.data.replay_lengths(first)
        if F <= 0.0 or not shorter:
            return step_s[S]
        return (1 - F) * step_s[S] + F * sum(step_s[s] for s in shorter) / len(shorter)

    per_step = sum((b - a) * phase_s(i) for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
    n = max(cfg.warmup_steps + 1, int(budget_s / (per_step * 1.06)))  # 6%: optimizer, logging, saves
    scaled = tuple((round(first * n / NOMINAL_STEPS), S) for first, S in cur)
    scaled = tuple(p for i, p in enumerate(scaled) if i == 0 or p[0] > scaled[i - 1][0])
    dense = cfg.dense_warmup_steps
    if dense <= NOMINAL_STEPS:  # past the nominal end the whole run stays dense
        dense = round(dense * n / NOMINAL_STEPS)
    return dataclasses.replace(
        cfg, steps=n, dense_warmup_steps=dense, data=dataclasses.replace(cfg.data, curriculum=scaled)
    )


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine from lr to lr * min_lr_ratio at `steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + (cfg.lr - lo) * 0.5 * (1 + math.cos(math.pi * t))


def build_optimizer(model: TrainCausalLM, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # matrices decay; norms, biases and the embedding table do not
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kw)


def kl_rows(batch_kind: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Query rows for the indexer KL: every answer position first, then random others. [B, min(n, S)]."""
    B, S = batch_kind.shape
    score = torch.rand(B, S, generator=gen, device=batch_kind.device) + 2.0 * (batch_kind == ANSWER)
    return score.topk(min(n, S), dim=1).indices.sort(dim=1).values


def lead_targets(ans: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: each row's first value byte among its answer targets. Every answer is `answer_text`'s
    " " + value..., so that is the target after the row's first answer target (none in rows without one,
    or whose answer is a single target). No host sync."""
    S = ans.shape[1]
    at = ans.to(torch.uint8).argmax(1, keepdim=True) + 1  # [B, 1]: after the first answer target
    ok = (at < S) & ans.any(1, keepdim=True)
    return torch.zeros_like(ans).scatter_(1, at.clamp(max=S - 1), True) & ans & ok


def step_topk(cfg: TrainConfig, step: int, S: int) -> int | None:
    """The sparse stage's top-k at `step` for rows of S tokens: `long_topk` from `long_topk_from` on, on a
    `long_topk_prob` share of steps (a host draw from the seed and the step: no device work, the same on
    a resume), else None (the config's top-k)."""
    if not cfg.long_topk_from or cfg.long_topk_from > S:
        return None
    if cfg.long_topk_prob < 1.0 and random.Random(f"{cfg.seed}:{step}:topk").random() >= cfg.long_topk_prob:
        return None
    return cfg.long_topk


def compute_loss(
    model: TrainCausalLM, batch: Batch, cfg: TrainConfig, step: int, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """One forward: the total loss and the (device, unsynced) metrics."""
    ids = batch.ids.to(device, non_blocking=True)
    targets = batch.targets.to(device, non_blocking=True)
    kind = batch.kind.to(device, non_blocking=True)
    gen = torch.Generator(device=device).manual_seed((generator_seed(cfg.seed) * 1_000_003 + step) & MASK63)
    rows = kl_rows(kind, cfg.kl_rows, gen) if cfg.kl_weight > 0 or cfg.needle_weight > 0 else None
    needle = None
    if rows is not None and cfg.needle_weight > 0:
        at_rows = torch.gather(kind, 1, rows) == ANSWER  # the kl rows that predict answer bytes
        needle = Needle(batch.needle.to(device, non_blocking=True), at_rows, cfg.needle_form)
    positions = None if batch.positions is None else batch.positions.to(device, non_blocking=True)
    sparse = step >= cfg.dense_warmup_steps
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _null()
    with amp:
        h, aux = model.forward_train(
            ids, sparse=sparse, kl_rows=rows, needle=needle, positions=positions,
            topk=step_topk(cfg, step, ids.shape[1]), kl_local=cfg.kl_local, kl_share=cfg.kl_share,
        )  # fmt: skip
        logits = model.logits(h)  # [B, S, V] fp32
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    ans, lm = kind == ANSWER, kind == LM
    n_ans = ans.sum()
    lead = lead_targets(ans)
    w = ans.to(ce.dtype)
    if cfg.lead_weight != 1.0:
        w = w + (cfg.lead_weight - 1.0) * lead.to(ce.dtype)
    loss_ans = (ce * w).sum() / w.sum().clamp(min=1)
    loss_lm = (ce * lm).sum() / lm.sum().clamp(min=1)
    kl = torch.stack(aux.indexer_kl).mean() if aux.indexer_kl else ce.new_zeros(())
    nll = torch.stack(aux.indexer_needle).mean() if aux.indexer_needle else ce.new_zeros(())
    loss = loss_ans + cfg.lm_weight * loss_lm + cfg.kl_weight * kl + cfg.needle_weight * nll
    with torch.no_grad():
        right = logits.argmax(-1) == targets
        has = ans.any(1)
        exact = (has & ~(ans & ~right).any(1)).sum() / has.sum().clamp(min=1)
        acc = (right & ans).sum() / n_ans.clamp(min=1)
        lead_acc = (right & lead).sum() / lead.sum().clamp(min=1)
    metrics = {
        "loss": loss.detach(),
        "loss_answer": loss_ans.detach(),
        "loss_lm": loss_lm.detach(),
        "indexer_kl": kl.detach(),
        "indexer_needle": nll.detach(),
        "answer_acc": acc,
        "answer_exact": exact,
        "answer_lead_acc": lead_acc,
    }
    return loss, metrics, aux.expert_load


def train_step(
    model: TrainCausalLM,
    opt: torch.optim.Optimizer,
    batch: Batch,
    cfg: TrainConfig,
    step: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One optimizer step on `batch` at `step`'s lr, and the router bias update after it. Returns the
    metrics (and grad_norm) as device tensors: nothing here waits for the GPU, so the host queues the
    next step while this one runs; the loop reads them at the log cadence."""
    for g in opt.param_groups:
        g["lr"] = lr_at(cfg, step)
    loss, metrics, loads = compute_loss(model, batch, cfg, step, device)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    if cfg.train_only == "all":
        model.update_router_bias(loads, cfg.bias_update_rate)
    metrics["grad_norm"] = gnorm.detach()
    return metrics


def gather_instead(
    model: TrainCausalLM, S: int, step: int, device: torch.device, recipe: dict[str, Any]
) -> bool:
    """After a step on rows of S tokens ran out of memory: when "auto" had given S the masked form (an
    S x S mask per layer), give S and every longer measured length the gathered form (memory S x top-k)
    and say so; True when the step is worth one more try. The probe times the masked form on a fresh
    allocator before any optimizer state exists, so a form that fit there by a few GB may not fit
    mid-run (the forty-second session's H100 run stopped at step 94 of 263 on its first 64K row)."""
    if model.sparse_attention != "auto" or model._gathers(S):
        return False
    # S itself even when the probe left it unmeasured (then "auto" masks rows up to _GATHER_FROM)
    switched = sorted({S, *(n for n, f in model.measured_forms.items() if n > S and f != "gather")})
    for n in switched:
        model.measured_forms[n] = "gather"
    free_after_oom(model, device)
    note = {"step": step, "seq_len": S, "gather_from_now": switched}
    recipe.setdefault("oom_fallbacks", []).append(note)
    recipe["sparse_forms"] = sorted(model.measured_forms.items())  # what a resumed run takes
    print(json.dumps({"oom_fallback": note}), flush=True)
    return True


def _auto_schedule(
    cfg: TrainConfig,
    model: TrainCausalLM,
    device: torch.device,
    state: dict[str, Any] | None,
    t_start: float,
    eval_reserve: float,
) -> TrainConfig:
    """steps=0: a resumed run keeps the schedule it was planned with; a fresh one times each length and
    fits the schedule to what is left of max_minutes (less `eval_reserve` seconds for the final eval)."""
    if state is not None and int(state["recipe"].get("steps", 0)) > 0:
        r = state["recipe"]
        cur = _pairs(r["data"]["curriculum"])
        return dataclasses.replace(
            cfg,
            steps=int(r["steps"]),
            dense_warmup_steps=int(r.get("dense_warmup_steps", cfg.dense_warmup_steps)),
            sparse_forms=tuple((int(a), str(b)) for a, b in r.get("sparse_forms", ())),
            select_forms=tuple((int(a), str(b)) for a, b in r.get("select_forms", ())),
            data=dataclasses.replace(cfg.data, curriculum=cur),
        )
    if cfg.max_minutes is None:
        raise ConfigError.about(
            "steps", 0, "fits the schedule to the time budget, which needs {}", "max_minutes"
        )
    minutes = cfg.max_minutes
    model.train()
    step_s, forms = probe_step_seconds(model, cfg, device)
    # lengths with no seconds did not fit in memory: the plan leaves them out (the length before them
    # keeps their steps); none fitting is an error, not a run
    kept = tuple(p for p in cfg.data.curriculum if p[1] in step_s)
    dropped = sorted({S for _, S in cfg.data.curriculum} - step_s.keys())
    if not kept:
        raise ConfigError(f"no curriculum length fits a training step in memory (tried {dropped})")
    kept = ((0, kept[0][1]),) + kept[1:]
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, curriculum=kept))
    left = t_start + 60 * minutes - _monotonic() - eval_reserve
    fitted = dataclasses.replace(
        fit_schedule(cfg, step_s, left),
        sparse_forms=tuple(sorted(forms.items())),
        select_forms=tuple(sorted(model.measured_selects.items())),
    )
    print(
        json.dumps(
            {
                "plan": {
                    "step_seconds": step_s,
                    "budget_s": round(left, 1),
                    "steps": fitted.steps,
                    "dense_warmup_steps": fitted.dense_warmup_steps,
                    "curriculum": fitted.data.curriculum,
                    "sparse_forms": fitted.sparse_forms,
                    "select_forms": fitted.select_forms,
                    "dropped_lengths": dropped,  # no step fitted in memory
                }
            }
        ),
        flush=True,
    )
    return fitted


def _pairs(rows: Any) -> tuple[tuple[int, int], ...]:
    """A curriculum as saved in the trainer state (JSON lists) -> ((first step, length), ...)."""
    return tuple((int(a), int(b)) for a, b in rows)


AT_LEN = "answer_exact_at_len"  # the log's answer exact match over the steps not replayed


def gate_ready(rows: list[dict[str, Any]], phase_start: int, cfg: TrainConfig) -> bool:
    """Whether the gated curriculum moves on: enough steps at this length and the answer exact match
    of its last `advance_window` log rows at least `advance_exact` on average. With replay a row's
    exact match counts only its steps at the curriculum's own length (AT_LEN): the
    shorter, easier replayed steps would move the gate early; a row with none of them is left out."""

    def exact(r: dict[str, Any]) -> Any:  # with replay, the mean over the row's steps at this length
        return r.get(AT_LEN, r["answer_exact"])

    recent = [r for r in rows if r["step"] > phase_start and exact(r) is not None][-cfg.advance_window :]
    if len(recent) < cfg.advance_window or recent[-1]["step"] - phase_start < cfg.advance_min_steps:
        return False
    return sum(float(exact(r)) for r in recent) / len(recent) >= cfg.advance_exact


def realized_curriculum(cfg: TrainConfig, state: dict[str, Any] | None) -> tuple[tuple[int, int], ...]:
    """The gated curriculum so far: (first step, length) of every length reached (resumes keep it)."""
    got = (state or {}).get("recipe", {}).get("realized_curriculum")
    if got:
        return _pairs(got)
    return ((0, cfg.data.curriculum[0][1]),)


NEVER = 1 << 62  # a step no run reaches
# A gated, time-fitted run whose gate held it at short (cheap) lengths reaches its planned steps early;
# with at least this many seconds left it goes on at the schedule's final lr until the deadline (run 7
# stopped after 286 of its 413 s).
EXTEND_MIN_S = 20.0


def gated_dense_warmup(cfg: TrainConfig, realized: tuple[tuple[int, int], ...]) -> int:
    """The step where attention turns sparse under a gated curriculum: as many steps into the same
    curriculum length as `dense_warmup_steps` is into its length in the nominal schedule (NEVER
    while that length is not reached). The warm-up follows the length it was set against: run 6
    turned sparse by the clock at 768 tokens while the gate still held it there, and its answer
    exact match fell from 0.49 to 0.10."""
    d = cfg.dense_warmup_steps
    i = sum(1 for first, _ in cfg.data.curriculum if first <= d) - 1
    if i < 0:  # before the first length
        return d
    return realized[i][0] + d - cfg.data.curriculum[i][0] if i < len(realized) else NEVER


def next_length(cfg: TrainConfig, realized: tuple[tuple[int, int], ...]) -> int | None:
    planned = [s for _, s in cfg.data.curriculum]
    return planned[len(realized)] if len(realized) < len(planned) else None


def check_config(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    """Refuse (ConfigError `about` the field at fault, one line) a recipe that cannot train `mcfg`, before any
    work: a bad choice, a number out of its range (NaN and inf included), rows longer than the model's
    positions."""
    for name, choices in (
        ("sparse_attention", SPARSE_ATTENTION_FORMS),
        ("select", SELECT_FORMS),
        ("select_dot", SELECT_DOTS),
        ("needle_form", NEEDLE_FORMS),
        ("train_only", ("all", "indexer")),
        ("save_dtype", SAVE_DTYPES),
    ):
        if getattr(cfg, name) not in choices:
            raise ConfigError.about(name, repr(getattr(cfg, name)), f"must be one of {choices}")
    if not is_seed(cfg.seed):
        raise ConfigError.about("seed", cfg.seed, f"must be {SEED_RANGE}")
    for name, lo in (
        ("steps", 0),
        ("warmup_steps", 0),
        ("dense_warmup_steps", 0),
        ("kl_rows", 1),
        ("kl_local", 0),
        ("save_every", 1),
        ("log_every", 1),
        ("print_every", 0),
        ("num_workers", 0),
        ("advance_window", 1),
        ("advance_min_steps", 0),
        ("eval_samples", 0),
    ):
        if getattr(cfg, name) < lo:
            raise ConfigError.about(name, getattr(cfg, name), f"must be >= {lo}")
    for name in ("lm_weight", "kl_weight", "needle_weight", "lead_weight"):
        if not 0.0 <= getattr(cfg, name) < math.inf:
            raise ConfigError.about(name, getattr(cfg, name), "must be a finite number >= 0")
    if not 0.0 < cfg.lr < math.inf:
        raise ConfigError.about("lr", cfg.lr, "must be a finite number > 0")
    if cfg.max_minutes is not None and not 0.0 < cfg.max_minutes < math.inf:
        raise ConfigError.about("max_minutes", cfg.max_minutes, "must be a finite number > 0")
    for name in ("advance_exact", "long_topk_prob"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ConfigError.about(name, getattr(cfg, name), "must be in [0, 1]")
    if cfg.long_topk_from < 0:
        raise ConfigError.about("long_topk_from", cfg.long_topk_from, "must be >= 0 (0: off)")
    if cfg.long_topk_from and cfg.long_topk < 1:
        raise ConfigError.about("long_topk", cfg.long_topk, "must be >= 1 with {} on", "long_topk_from")
    if cfg.long_topk_from and cfg.long_topk <= mcfg.index_local_window:
        raise ConfigError.about(
            "long_topk",
            cfg.long_topk,
            f"must be larger than the model's index_local_window ({mcfg.index_local_window}): the window is "
            "part of the top-k",
        )
    evals = cfg.eval_lengths if cfg.eval_samples else ()
    evals_text = ",".join(map(str, evals))
    if any(n < 1 for n in evals):
        raise ConfigError.about("eval_lengths", evals_text, "must be >= 1")
    for name, shown, longest in (
        ("curriculum", curriculum_text(cfg.data.curriculum), max(s for _, s in cfg.data.curriculum)),
        ("pose_max", cfg.data.pose_max, cfg.data.pose_max),
        ("eval_lengths", evals_text, max(evals, default=0)),
    ):
        if longest > mcfg.max_position_embeddings:
            raise ConfigError.about(
                name,
                shown,
                f"rows of {longest} positions exceed the model's max_position_embeddings "
                f"({mcfg.max_position_embeddings})",
            )
    check_retrieval_fits(cfg.data)
    if cfg.resume and cfg.init_from:
        raise ConfigError.about(
            "init_from", cfg.init_from, "excludes {} (a resumed run has its own weights)", "resume"
        )
    if cfg.resume and cfg.capitals_from_lowercase:
        # (the resumed run's capitals are its own trained rows: copying a-z over them would undo them)
        raise ConfigError.about(
            "capitals_from_lowercase", None, "applies to {} only, not to a resumed run", "init_from"
        )
    if cfg.capitals_from_lowercase and not cfg.init_from:
        raise ConfigError.about(
            "capitals_from_lowercase", None, "needs {} (trained lowercase rows to copy)", "init_from"
        )


class StopOnInterrupt:
    """The SIGINT (Ctrl-C) handler `train` installs. While `armed` (the loop and its final save) the first
    Ctrl-C asks the loop to stop after the step in progress, the run then saving as at a deadline; a second
    one, or one while not armed, interrupts at once (KeyboardInterrupt; saves are atomic)."""

    def __init__(self) -> None:
        self.armed = self.requested = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.armed or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("interrupted: saving after this step (Ctrl-C again: quit unsaved)", file=sys.stderr, flush=True)


def _ignore_sigint(worker: int) -> None:
    """DataLoader workers leave Ctrl-C to the main process (a worker it killed would fail the next batch)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; saves to cfg.out. Returns a summary dict (also written as summary.json);
    its `stopped` is "interrupted" after a Ctrl-C (`StopOnInterrupt`), the steps trained before it saved."""
    stop = StopOnInterrupt()
    # only over Python's default handler: not where SIGINT is ignored (a background job) or already handled
    ours = threading.current_thread() is threading.main_thread()
    ours = ours and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    prev = signal.signal(signal.SIGINT, stop) if ours else None
    try:
        return _train(cfg, stop)
    finally:
        if ours:
            signal.signal(signal.SIGINT, prev)


def _train(cfg: TrainConfig, stop: StopOnInterrupt) -> dict[str, Any]:
    t_start = _monotonic()
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    mcfg = ModelConfig.from_json(cfg.model_config)
    window = cfg.index_local_window
    source = cfg.resume or cfg.init_from
    src = ModelConfig.from_json(source) if source else None
    if window is None and src:  # the weights' own window goes on with them
        window = src.index_local_window
    long_k = long_from = None
    if src and src.index_topk_long and not mcfg.index_topk_long:
        # and so does their narrowing (the shipped model's; training rows stay short of it, but the saved
        # model then scores past it as the weights it came from do)
        long_k, long_from = src.index_topk_long, src.index_topk_long_from
    mcfg = with_selection(
        mcfg, index_local_window=window, index_topk_long=long_k, index_topk_long_from=long_from
    )
    if src and src.kv_fp8_skip_layers and not mcfg.kv_fp8_skip_layers:
        # the layers an fp8 cache keeps exact go on with the weights too (--kv-fp8 trains them so, and
        # the saved model is served so)
        mcfg = dataclasses.replace(mcfg, kv_fp8_skip_layers=src.kv_fp8_skip_layers)
    check_config(cfg, mcfg)
    check_out_dir(cfg.out, cfg.resume)
    torch.manual_seed(generator_seed(cfg.seed))
    save_dtype = getattr(torch, cfg.save_dtype)
    model = TrainCausalLM(mcfg)
    model.sparse_attention = cfg.sparse_attention
    model.select_form = cfg.select
    model.select_dot = cfg.select_dot
    model.kv_fp8 = cfg.kv_fp8
    model.index_fp8 = cfg.index_fp8
    start, log_rows = 0, []
    state = None
    if cfg.resume:
        state = read_training(cfg.resume)
        start, log_rows = int(state["step"]), state["log"]
        load_model_weights(model, cfg.resume, torch.device("cpu"))
    elif cfg.init_from:  # the loader marks the weights trainable, as on resume
        load_model_weights(model, cfg.init_from, torch.device("cpu"))
        if cfg.capitals_from_lowercase:
            capitals_from_lowercase(model)
    else:
        model.init_weights(cfg.seed)
    if cfg.train_only == "indexer":
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and ".indexer." in name)
    model.to(device)
    eval_reserve = 60.0 if cfg.eval_samples else 0.0  # engine start + Triton compiles + decoding
    time_fitted = cfg.steps <= 0
    if cfg.steps <= 0:
        cfg = _auto_schedule(cfg, model, device, state, t_start, eval_reserve)
    model.measured_forms = dict(cfg.sparse_forms)
    model.measured_selects = dict(cfg.select_forms)
    opt = build_optimizer(model, cfg, device)
    if state is not None:
        restore_moments(model, opt, state["moments"], start)

    recipe = cfg.to_json()
    gated = cfg.advance_exact > 0
    nominal = cfg  # the schedule as planned; under the gate, `cfg` carries the realized warm-up end
    data = cfg.data
    realized = cfg.data.curriculum
    if gated:
        realized = realized_curriculum(cfg, state)
        data = dataclasses.replace(cfg.data, curriculum=realized)
        recipe["realized_curriculum"] = realized
        cfg = dataclasses.replace(cfg, dense_warmup_steps=gated_dense_warmup(nominal, realized))
    out = Path(cfg.out)
    deadline = None if cfg.max_minutes is None else t_start + 60 * cfg.max_minutes
    end = cfg.steps  # the last step the data runs to (an extension moves it, never the lr schedule)

    def make_loader(from_step: int) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            BatchDataset(data, from_step, max(from_step, end)),
            batch_size=None,
            shuffle=False,
            num_workers=cfg.num_workers if device.type == "cuda" else 0,
            collate_fn=collate,  # type: ignore[arg-type]
            pin_memory=device.type == "cuda",  # asynchronous host-to-device copies (Batch.pin_memory)
            prefetch_factor=4 if device.type == "cuda" and cfg.num_workers else None,
            persistent_workers=False,
            worker_init_fn=_ignore_sigint,
        )

    def step_or_none(batch: Batch, step: int) -> dict[str, torch.Tensor] | None:
        """`train_step` (with the loop's current cfg), or None when it ran out of device memory."""
        try:
            return train_step(model, opt, batch, cfg, step, device)
        except torch.OutOfMemoryError:
            return None

    bar = tqdm(total=cfg.steps, initial=start, desc="train", disable=not sys.stderr.isatty())
    step = start
    tokens = 0
    t_log, tok_log = _monotonic(), 0
    acc: dict[str, torch.Tensor] = {}
    n_acc = 0
    n_at_len = 0  # with replay: the window's steps at the curriculum's own length (acc[AT_LEN] sums them)
    # PoSE rows of the log window: rows, rows with skips, summed spans (read from the batches' host copies)
    pose = [0, 0, 0]
    stopped = "steps"
    model.train()
    stop.armed = True
    loader: torch.utils.data.DataLoader | None = make_loader(start)
    while loader is not None:
        advanced = False
        for batch in loader:
            if deadline is not None and _monotonic() + eval_reserve >= deadline:
                stopped = "deadline"
                break
            if stop.requested:
                stopped = "interrupted"
                break
            lr = lr_at(cfg, step)
            metrics = step_or_none(batch, step)
            if metrics is None and gather_instead(model, batch.ids.shape[1], step, device, recipe):
                metrics = step_or_none(batch, step)  # the same batch, gathered
            if metrics is None:  # keep what the run learned: stop here and save (below)
                stopped = f"out of memory at step {step} (rows {batch.ids.shape[0]} x {batch.ids.shape[1]})"
                break
            for k, v in metrics.items():
                acc[k] = acc.get(k, 0.0) + v.float()
            n_acc += 1
            if data.replay_fraction > 0.0 and batch.ids.shape[1] == data.curriculum_len(step):
                acc[AT_LEN] = acc.get(AT_LEN, 0.0) + metrics["answer_exact"].float()
                n_at_len += 1
            if batch.positions is not None:
                last = batch.positions[:, -1]  # a CPU tensor: no device sync
                pose[0] += last.numel()
                pose[1] += int((last != batch.positions.shape[1] - 1).sum())
                pose[2] += int(last.sum()) + last.numel()
            step += 1
            n_tok = batch.ids.numel()
            tokens += n_tok
            tok_log += n_tok
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                now = _monotonic()
                sums = dict(zip(acc, torch.stack(list(acc.values())).tolist()))  # the log cadence's one sync
                row: dict[str, Any] = {k: round(v / n_acc, 5) for k, v in sums.items()}
                row.update(
                    step=step,
                    lr=lr,
                    seq_len=batch.ids.shape[1],
                    batch=batch.ids.shape[0],
                    stage="sparse" if step - 1 >= cfg.dense_warmup_steps else "dense",
                    tokens_per_s=round(tok_log / max(now - t_log, 1e-9), 1),
                    elapsed_s=round(now - t_start, 1),
                )
                if data.replay_fraction > 0.0:  # None: every step of the window was replayed
                    row[AT_LEN] = round(sums[AT_LEN] / n_at_len, 5) if n_at_len else None
                    n_at_len = 0
                if pose[0]:  # the share of rows with skips; the mean span (last position + 1) of all rows
                    row.update(pose_rows=round(pose[1] / pose[0], 4), pose_span=round(pose[2] / pose[0], 1))
                    pose = [0, 0, 0]
                log_rows.append(row)
                bar.set_postfix(loss=row["loss"], acc=row["answer_acc"])
                if cfg.print_every and step % cfg.print_every == 0:
                    print(json.dumps(row), flush=True)
                acc, n_acc, t_log, tok_log = {}, 0, now, 0
                nxt = next_length(nominal, realized) if gated else None
                if nxt is not None and step < cfg.steps and gate_ready(log_rows, realized[-1][0], cfg):
                    realized = (*realized, (step, nxt))
                    data = dataclasses.replace(data, curriculum=realized)
                    recipe["realized_curriculum"] = realized
                    cfg = dataclasses.replace(cfg, dense_warmup_steps=gated_dense_warmup(nominal, realized))
                    sparse_from = cfg.dense_warmup_steps if cfg.dense_warmup_steps < NEVER else None
                    print(
                        json.dumps({"advance": {"step": step, "seq_len": nxt, "sparse_from": sparse_from}}),
                        flush=True,
                    )
                    advanced = True
            if step % cfg.save_every == 0 and step < end:
                save_training(out, model, opt, step, recipe, log_rows, save_dtype, cfg.save_momentum)
                print(f"saved step {step} to {out}", flush=True)
            if advanced:
                break  # the prefetched batches are at the old length: a new loader from this step
        del loader
        left = None if deadline is None else deadline - _monotonic() - eval_reserve
        if advanced:
            loader = make_loader(step)
        elif stopped == "steps" and gated and time_fitted and left is not None and left > EXTEND_MIN_S:
            end = step + NEVER // 2  # the deadline ends it
            extend = {"step": step, "seconds_left": round(left, 1), "lr": lr_at(cfg, step)}
            print(json.dumps({"extend": extend}), flush=True)
            recipe["extended_from"] = step
            loader = make_loader(step)
        else:
            loader = None  # a deadline stop never advances
    bar.close()
    if stopped.startswith("out of memory"):  # (outside the except: its frames are gone by now)
        print(json.dumps({"oom": stopped}), flush=True)
        free_after_oom(model, device)
    save_training(out, model, opt, step, recipe, log_rows, save_dtype, cfg.save_momentum)
    stop.armed = False
    if stop.requested:
        stopped = "interrupted"
    train_s = _monotonic() - t_start
    summary: dict[str, Any] = {
        "steps_done": step - start,
        "step": step,
        "stopped": stopped,
        "seconds": round(train_s, 1),
        "tokens": tokens,
        "tokens_per_s": round(tokens / max(train_s, 1e-9), 1),
        "last": log_rows[-1] if log_rows else None,
        "out": str(out),
        "device": str(device),
    }
    if cfg.eval_samples and not stop.requested:
        from longctx.train.evaluate import niah_eval

        del opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            summary["eval"] = niah_eval(
                out, lengths=cfg.eval_lengths, samples=cfg.eval_samples, device=str(device)
            )
        except Exception as e:  # the checkpoint is saved: report the eval failure, keep the run
            msg = str(e).splitlines()[0] if str(e) else ""
            summary["eval"] = {"error": f"{type(e).__name__}: {msg}"}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
