"""What a byte-level retrieval model copies: induction by alphabet, and RULER's vt by chain length.

vt (variable tracking) has scored 0 for every trained run. This probe splits the task into the parts a
model needs, each scored apart on the CPU or the GPU through `longctx.Engine`:

- copy: rows of recurring random strings (`longctx.train.data._copy_row`) in three alphabets: lowercase
  letters and digits (the training's copy rows), capitals (vt's names), UUIDs; and pair rows of the first
  two (each string twice among random chunks, so that the row's byte statistics do not predict a repeat).
  The loss is taken only on the bytes a copy predicts (inside a string that occurred earlier in the row,
  after its first byte), against chance, ln(alphabet): near 0 where the model copies, near chance where it
  does not; the `by_offset` figures split it by the byte's place in the string (1: its second byte; 8:
  the eighth on), flat where the model does not copy.
- vt: RULER vt samples with chains of `--hops` hops: how many answers have the first name right, and the
  share of the chain's names anywhere in the answer.
- vt_continue: the same samples with the answer's first two letters given: whether greedy decoding writes
  the name's next three (plain induction once the name is found).

    python -m bench.copy_probe --model models-shipped/retrieval-wip --device cpu
        [--backend auto] [--rows 8] [--copy-length 1024] [--vt-length 2048] [--hops 1,2,4] [--samples 8] [--out DIR]

Writes copy-probe.json and copy-probe.md under --out (default .out/copy-probe).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import string
import sys
from pathlib import Path
from typing import Any

import torch

ALPHABETS = {  # name -> (copy_row's hex / upper / pairs fractions, the alphabet's size)
    "lower_digits": ((0.0, 0.0, 0.0), len(string.ascii_lowercase + string.digits)),
    "capitals": ((0.0, 1.0, 0.0), len(string.ascii_uppercase)),
    "uuid": ((1.0, 0.0, 0.0), 16),
    # each string twice among random chunks: only finding the earlier occurrence predicts the repeat
    "pairs_lower_digits": ((0.0, 0.0, 1.0), len(string.ascii_lowercase + string.digits)),
    "pairs_capitals": ((0.0, 1.0, 1.0), len(string.ascii_uppercase)),
}


def copied_offsets(text: str) -> list[tuple[int, int]]:
    """(index, place) of the bytes of `text` (space-separated strings) that a copy predicts: those after
    the first byte of a string that occurred earlier in the row; place 1 is a string's second byte."""
    seen: set[str] = set()
    out: list[tuple[int, int]] = []
    at = 0
    for w in text.split(" "):
        if w in seen:
            out += [(at + k, k) for k in range(1, len(w))]
        seen.add(w)
        at += len(w) + 1
    return out


def copied_bytes(text: str) -> list[int]:
    """Indices of the bytes of `text` that a copy predicts (`copied_offsets`)."""
    return [i for i, _ in copied_offsets(text)]


# by_offset's buckets by their first place: 1, 2-3, 4-7, 8 on (a string's 2nd byte is place 1)
OFFSETS = (1, 2, 4, 8)


def copy_loss(eng: Any, rows: int, length: int, seed: int) -> dict[str, dict[str, float]]:
    """Per alphabet: the mean loss on the copied bytes of `rows` fresh copy rows, chance, and their ratio."""
    from longctx.train.data import _copy_row

    out: dict[str, dict[str, Any]] = {}
    for name, ((hexf, upper, pairs), size) in ALPHABETS.items():
        nll, places = [], []
        for r in range(rows):
            ids = _copy_row(random.Random(f"{seed}:{name}:{r}"), length, hexf, upper, pairs)
            got = [(i, k) for i, k in copied_offsets(bytes(ids).decode()) if i < len(ids)]
            at = torch.tensor([i for i, _ in got], dtype=torch.long)
            logp = torch.log_softmax(eng.score(ids).float(), dim=-1)  # row i predicts token i + 1
            nll.append(-logp[at - 1, torch.tensor(ids)[at]])
            places.append(torch.tensor([k for _, k in got], dtype=torch.long))
        x, k = torch.cat(nll), torch.cat(places)
        loss = x.sum().item() / max(len(x), 1)
        # each byte under the largest OFFSETS entry not over its place
        bucket = torch.tensor(OFFSETS)[torch.bucketize(k, torch.tensor(OFFSETS), right=True) - 1]
        by_offset = {str(o): round(x[bucket == o].mean().item(), 3) for o in OFFSETS if (bucket == o).any()}
        out[name] = {"loss": round(loss, 4), "chance": round(math.log(size), 4), "bytes": len(x),
                     "of_chance": round(loss / math.log(size), 3), "by_offset": by_offset}  # fmt: skip
    return out


def vt_scores(eng: Any, length: int, hops: list[int], samples: int, seed: int) -> dict[str, dict[str, Any]]:
    """Per chain length: the first name right, the chain's names found, and the name's next three letters
    written given its first two (the answer's)."""
    from longctx.workloads.ruler_tasks import TASKS, RulerGenerator
    from longctx.workloads.tokens import ByteCounter

    gen = RulerGenerator(ByteCounter(), seed=seed, max_new_tokens_scale=0.5)
    items = []
    for h in hops:
        spec = dataclasses.replace(TASKS["vt"], num_hops=h)
        for i in range(samples):
            s = gen.sample("vt", length, i, spec=spec)
            prompt = s.input + s.answer_prefix
            items.append(
                (h, s.outputs, list(prompt.encode()), list((prompt + " " + s.outputs[0][:2]).encode()))
            )
    free = eng.generate([p for *_, p, _ in items], max_new_tokens=8 * (max(hops) + 1), temperature=0.0)
    cont = eng.generate([c for *_, c in items], max_new_tokens=3, temperature=0.0)
    out: dict[str, dict[str, Any]] = {}
    for (h, names, _, _), f, c in zip(items, free, cont):
        text = bytes(t for t in f.token_ids if t < 256).decode("utf-8", "replace")
        nxt = bytes(t for t in c.token_ids if t < 256).decode("utf-8", "replace")
        r = out.setdefault(
            str(h), {"samples": 0, "first_name": 0, "names_found": 0, "names": 0, "continues": 0}
        )
        r["samples"] += 1
        r["first_name"] += text.split()[:1] == [names[0]]
        r["names_found"] += sum(n in text for n in names)
        r["names"] += len(names)
        r["continues"] += nxt == names[0][2:5]
        r.setdefault("example", f"{' '.join(names)!r} -> {text.strip()[:40]!r}")
    return out


def table(d: dict[str, Any]) -> str:
    lines = [f"`{d['model']}` on {d['device']}", "", "| copy rows | loss on copied bytes | chance | of chance | by byte of the string: 2nd / 3rd-4th / 5th-8th / 9th on |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v['loss']} | {v['chance']} | {v['of_chance']} | "
              + " / ".join(str(v["by_offset"].get(str(o), "-")) for o in OFFSETS) + " |"
              for k, v in d["copy"].items()]  # fmt: skip
    lines += ["", f"| vt hops ({d['vt_length']} tokens) | first name | names found | next 3 letters given 2 |",
              "|---|---|---|---|"]  # fmt: skip
    for h, v in d["vt"].items():
        n = v["samples"]
        lines.append(
            f"| {h} | {v['first_name']} / {n} | {v['names_found']} / {v['names']} | {v['continues']} / {n} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.copy_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models-shipped/retrieval-wip")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "triton"),
        help="the engine's kernels (torch: nothing to compile on a fresh GPU machine)",
    )
    p.add_argument("--rows", type=int, default=8, help="copy rows per alphabet")
    p.add_argument("--copy-length", type=int, default=1024)
    p.add_argument("--vt-length", type=int, default=2048)
    p.add_argument("--hops", default="1,2,4")
    p.add_argument("--samples", type=int, default=8, help="vt samples per chain length")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=".out/copy-probe")
    a = p.parse_args(argv)
    command = "python -m bench.copy_probe " + " ".join(sys.argv[1:] if argv is None else argv)
    from longctx import Engine
    from longctx.errors import LongctxError

    try:
        hops = [int(h) for h in a.hops.split(",")]
        if a.rows < 1 or a.samples < 1 or a.copy_length < 64 or not hops or min(hops) < 1:
            raise ValueError
    except ValueError:
        print("copy_probe: --rows / --samples >= 1, --copy-length >= 64, --hops like 1,2,4", file=sys.stderr)
        return 2
    try:
        with Engine(
            a.model, device=a.device, backend=a.backend, max_context=max(a.copy_length, a.vt_length) + 128
        ) as eng:
            d = {"model": a.model, "device": str(eng.device), "vt_length": a.vt_length,
                 "copy": copy_loss(eng, a.rows, a.copy_length, a.seed),
                 "vt": vt_scores(eng, a.vt_length, hops, a.samples, a.seed)}  # fmt: skip
    except LongctxError as e:
        print(f"copy_probe: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "copy-probe.json").write_text(json.dumps({**d, "command": command}, indent=1) + "\n")
    md = table(d)
    (out / "copy-probe.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
