"""Guided decoding's host costs (CPU only, no GPU needed): compiling a guide's automaton, and one state's
allowed-token mask, over a vocabulary of a given size (random byte tokens: the 256 single bytes, then pieces
of 1-12 bytes drawn from JSON-ish text, then a few of any byte), for a regex, a JSON schema and JSON mode.

    python -m bench.guided_cost [--vocab 154880] [--states 20] [--out DIR]   # writes guided-cost-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "page": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "page"],
}
# a schema with a free value: objects and arrays nested in it to any depth (a pushdown guide)
FREE = {"type": "object", "properties": {"answer": {"type": "string"}, "data": {}}, "required": ["answer"]}
GUIDES = (
    ("regex", "[a-z ]{1,200}"),
    ("json", json.dumps(SCHEMA)),
    ("json", json.dumps(FREE)),
    ("json_object", ""),
)


def vocabulary(size: int, seed: int = 0) -> list[bytes | None]:
    rng = random.Random(seed)
    text = b'abcdefghijklmnopqrstuvwxyz {}":,0123456789'
    pieces: list[bytes | None] = [bytes([b]) for b in range(256)]
    while len(pieces) < size - 20:
        if rng.random() < 0.99:
            pieces.append(bytes(rng.choice(text) for _ in range(rng.randint(1, 12))))
        else:
            pieces.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))))
    return pieces + [None] * (size - len(pieces))  # (specials: never allowed but EOS)


def measure(vocab_size: int, states: int) -> list[dict]:
    from longctx.engine.guided import Guide, GuideCache, NestedGuide, VocabBytes

    t = time.perf_counter()
    vocab = VocabBytes.build(vocabulary(vocab_size), eos=[vocab_size - 1])
    build_s = time.perf_counter() - t
    rows = []
    for kind, spec in GUIDES:
        t = time.perf_counter()
        dfa, nested = GuideCache._compile(kind, spec)
        compile_s = time.perf_counter() - t
        g = (NestedGuide if nested else Guide)(dfa, vocab)
        t = time.perf_counter()
        g.warm()
        warm_s = time.perf_counter() - t
        reach = g.reachable(states)
        t = time.perf_counter()
        for s in reach:
            g.allowed(s)
        mask_ms = (time.perf_counter() - t) / len(reach) * 1e3
        name = kind + (" (nested)" if nested else "")
        rows.append(
            dict(guide=name, states=dfa.num_states, compile_s=compile_s, warm_s=warm_s, mask_ms=mask_ms)
        )
        print(rows[-1], flush=True)
    for r in rows:
        r["vocab_build_s"] = build_s
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=154_880)
    ap.add_argument("--states", type=int, default=20, help="states whose masks are timed (the first ones)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    rows = measure(a.vocab, a.states)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    (out / "guided-cost-cpu.json").write_text(
        json.dumps({"env": env, "vocab": a.vocab, "rows": rows}, indent=1)
    )
    lines = [
        f"# Guided decoding's host costs, {a.vocab:,}-token vocabulary (`python -m bench.guided_cost`)",
        "",
        "| guide | DFA states | compile s | first 64 masks s | one mask ms |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['guide']} | {r['states']} | {r['compile_s']:.3f} | {r['warm_s']:.3f} | {r['mask_ms']:.2f} |"
        for r in rows
    ]
    (out / "guided-cost-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
