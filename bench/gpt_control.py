"""A control for induction: a plain GPT trained on the retrieval training's own copy rows.

The retrieval model (`configs/retrieval.json`) has never formed induction in 32 runs (`bench.copy_probe`:
the loss on a repeated string's bytes stays flat by the byte's place). This trains a plain decoder of
the same width and depth on the same rows (`longctx.train.data.make_row`, e.g. pair rows only) with
nothing of the engine's: full causal attention (`scaled_dot_product_attention`), rotary keys per head,
SwiGLU MLPs, no MLA, MoE or indexer. Every `--probe-every` seconds it scores the copy probe's rows
(`bench.copy_probe.copy_loss`, the same rows and seeds the retrieval models are probed on), so the curve
says after how many tokens of these rows a transformer copies by induction, if at all:

    python -m bench.gpt_control --minutes 6 --device cuda --out .out/gpt-control
        [--copy-pairs-fraction 1.0] [--seq 1024] [--batch 32] [--layers 6] [--hidden 384] [--heads 8]

Writes gpt-control.json (the settings, the training loss and every probe) and gpt-control.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.copy_probe import OFFSETS, copy_loss

VOCAB = 320  # the retrieval config's byte vocabulary (bytes, specials, padding)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, D // self.heads).unbind(2)
        q, k = (rotate(t.transpose(1, 2), cos, sin) for t in (q, k))
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, S, D))
        g, u = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves layout: x [B, H, S, d], cos/sin [S, d/2]."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).type_as(x)


class PlainGPT(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, rope_theta: float) -> None:
        super().__init__()
        if hidden % heads or (hidden // heads) % 2:
            raise ValueError("--hidden must split into --heads heads of an even size")
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        d = hidden // heads
        self.register_buffer("inv_freq", rope_theta ** (-torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        ang = torch.outer(t, self.inv_freq)
        cos, sin = ang.cos(), ang.sin()
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))

    @torch.no_grad()
    def score(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), VOCAB] logits of one row (what `copy_loss` reads from an engine)."""
        dev = self.head.weight.device
        with autocast(dev):
            return self(torch.tensor([ids], device=dev))[0].float().cpu()


def autocast(dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()


def probe(model: PlainGPT, rows: int, length: int) -> dict[str, Any]:
    model.eval()
    try:
        return copy_loss(model, rows, length, seed=7)  # bench.copy_probe's default rows
    finally:
        model.train()


def table(d: dict[str, Any]) -> str:
    names = list(d["probes"][-1]["copy"]) if d["probes"] else []
    lines = [
        f"Plain GPT ({d['layers']} layers, {d['hidden']} wide, {d['heads']} heads), copy rows "
        f"(pairs {d['copy_pairs_fraction']}) at {d['seq']}, lr {d['lr']}: loss on the copied bytes by the "
        "byte's place (2nd / 3rd-4th / 5th-8th / 9th on), nats",
        "",
        "| step | tokens | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for p in d["probes"]:
        cells = [" / ".join(str(p["copy"][n]["by_offset"].get(str(o), "-")) for o in OFFSETS) for n in names]
        lines.append(f"| {p['step']} | {p['tokens'] / 1e6:.1f}M | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpt_control", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=6.0, help="wall time of the training")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: time)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--copy-pairs-fraction", type=float, default=1.0)
    p.add_argument("--copy-upper-fraction", type=float, default=0.0)
    p.add_argument("--probe-every", type=float, default=60.0, help="seconds between copy probes")
    p.add_argument("--probe-rows", type=int, default=8)
    p.add_argument("--probe-length", type=int, default=1024)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--out", default=".out/gpt-control")
    a = p.parse_args(argv)
    from longctx.train.data import BatchDataset, DataConfig, collate
    from longctx.train.loop import resolve_device

    try:
        if min(a.seq, a.batch, a.layers, a.probe_rows) < 1 or a.probe_length < 64 or a.minutes <= 0:
            raise ValueError(
                "--seq / --batch / --layers / --probe-rows >= 1, --probe-length >= 64, --minutes > 0"
            )
        data = DataConfig(
            seed=a.seed, tokens_per_step=a.seq * a.batch, curriculum=((0, a.seq),), text_fraction=0.0,
            copy_fraction=1.0, copy_pairs_fraction=a.copy_pairs_fraction,
            copy_upper_fraction=a.copy_upper_fraction,
        )  # fmt: skip
        dev = resolve_device(a.device)
        torch.manual_seed(a.seed)
        model = PlainGPT(a.layers, a.hidden, a.heads, a.ffn, a.rope_theta).to(dev)
    except (ValueError, RuntimeError) as e:
        print(f"gpt_control: {e}", file=sys.stderr)
        return 2
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    loader = torch.utils.data.DataLoader(
        BatchDataset(data, 0, a.steps if a.steps is not None else 1 << 30),
        batch_size=None,
        num_workers=a.num_workers if dev.type == "cuda" else 0,
        collate_fn=collate,  # type: ignore[arg-type]
        pin_memory=dev.type == "cuda",
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    d: dict[str, Any] = {**vars(a), "command": "python -m bench.gpt_control " + " ".join(sys.argv[1:] if argv is None else argv),
                         "params": sum(x.numel() for x in model.parameters()), "losses": [], "probes": []}  # fmt: skip
    t0 = time.monotonic()
    deadline, next_probe = t0 + 60 * a.minutes, t0 + a.probe_every
    tokens = 0
    run_loss = torch.zeros((), device=dev)
    for step, batch in enumerate(loader, start=1):
        lr = a.lr * min(1.0, step / a.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, tgt = batch.ids.to(dev, non_blocking=True), batch.targets.to(dev, non_blocking=True)
        with autocast(dev):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tgt.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss += loss.detach()
        tokens += ids.numel()
        now = time.monotonic()
        last = now >= deadline or (a.steps is not None and step >= a.steps)
        if now >= next_probe or last:
            loss_avg = run_loss.item() / max(1, step - (d["losses"][-1]["step"] if d["losses"] else 0))
            run_loss.zero_()
            d["losses"].append({"step": step, "tokens": tokens, "loss": round(loss_avg, 4)})
            d["probes"].append({"step": step, "tokens": tokens, "elapsed_s": round(now - t0, 1),
                                "copy": probe(model, a.probe_rows, a.probe_length)})  # fmt: skip
            pl = d["probes"][-1]["copy"]["pairs_lower_digits"]["by_offset"]
            print(f"step {step} tokens {tokens / 1e6:.1f}M loss {loss_avg:.3f} pairs_lower_digits by place {pl}",
                  flush=True)  # fmt: skip
            (out / "gpt-control.json").write_text(json.dumps(d, indent=1) + "\n")
            next_probe = time.monotonic() + a.probe_every
        if last:
            break
    d["elapsed_s"] = round(time.monotonic() - t0, 1)
    d["tokens_per_s"] = round(tokens / max(d["elapsed_s"], 1e-9))
    (out / "gpt-control.json").write_text(json.dumps(d, indent=1) + "\n")
    md = table(d)
    (out / "gpt-control.md").write_text(md + "\n")
    print(md)
    return 0 if all(math.isfinite(x["loss"]) for x in d["losses"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
