"""Programmatic dependent launch (kernels/common.py `pdl`, `pdl_wait`).

A kernel launched with `pdl(device)`'s keywords may start before the kernel ahead of it finishes, so it
must wait (`pdl_wait(PDL)`) before touching memory. The GPU is the only place the overlap happens; here
the contract is checked statically over kernels/ (every launch that passes the keywords goes to a kernel
that takes PDL and waits first) and at run time under the interpreter (the keywords forced on give the
same engine output, so every launch site on the path accepts them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from longctx import Engine
from tests.conftest import rand_ids

pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _is_pdl_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pdl"


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body[0]


def _scan(path: Path) -> tuple[dict[str, bool], list[tuple[str, int]]]:
    """(kernel name -> whether it takes PDL, for every @jit def) and (kernel, line) for every launch
    `name[grid](...)` that passes pdl's keywords, directly or through a dict built with them."""
    tree = ast.parse(path.read_text())
    kernels: dict[str, bool] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "jit" for d in fn.decorator_list
        ):
            kernels[fn.name] = any(a.arg == "PDL" for a in fn.args.args)
    launches: list[tuple[str, int]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name in kernels:
            continue
        # names of dicts that carry the keywords: x = dict(..., **pdl(...)) or x.update(..., **pdl(...))
        carriers: set[str] = set()
        for node in ast.walk(fn):
            # x = dict(..., **pdl(...)), x = f(..., pdl(...), ...), x: T = ...: a pdl() call anywhere
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and any(_is_pdl_call(n) for n in ast.walk(node.value))
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                carriers |= {t.id for t in targets if isinstance(t, ast.Name)}
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name)
                and any(_is_pdl_call(k.value) for k in node.keywords if k.arg is None)
            ):
                carriers.add(node.func.value.id)
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            target = node.func.value
            spread = [k.value for k in node.keywords if k.arg is None]
            if any(_is_pdl_call(v) or (isinstance(v, ast.Name) and v.id in carriers) for v in spread):
                name = target.id if isinstance(target, ast.Name) else ast.unparse(target)
                launches.append((name, node.lineno))
            elif isinstance(target, ast.Name) and target.id == "kernel" and carriers:
                launches.append(("kernel", node.lineno))  # indexer's chosen decode kernel
    return kernels, launches


def test_every_pdl_launch_goes_to_a_kernel_that_waits_first():
    scans = {path: _scan(path) for path in sorted(KERNELS.glob("*.py"))}
    takes_pdl = {name: v for kernels, _ in scans.values() for name, v in kernels.items()}
    waits, launched = 0, 0
    for path, (kernels, launches) in scans.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and kernels.get(fn.name) and fn.name != "pdl_wait":
                first = _first_statement(fn)
                ok = (
                    isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Call)
                    and ast.unparse(first.value) == "pdl_wait(PDL)"
                )
                assert ok, f"{path.name}:{fn.name} takes PDL but does not start with pdl_wait(PDL)"
                waits += 1
        for name, line in launches:
            launched += 1
            if name == "kernel":  # indexer._launch_decode picks one of its two decode kernels
                assert takes_pdl["_indexer_decode_kernel"] and takes_pdl["_indexer_decode_tma_kernel"]
                continue
            assert takes_pdl.get(name), f"{path.name}:{line} launches {name} with pdl() but it takes no PDL"
    # the decode step's kernels: norms, rope, activation, KV writes, indexer, top-k, sparse MLA, MoE
    assert waits >= 20 and launched >= 18, (waits, launched)


def test_pdl_keywords(monkeypatch):
    from longctx.kernels import common

    assert common.pdl(torch.device("cpu")) == {}
    monkeypatch.setattr(common, "PDL_FORCE", True)
    assert common.pdl(torch.device("cpu")) == {"PDL": True, "launch_pdl": True}


def test_forced_pdl_keywords_change_nothing(tiny_dir, monkeypatch):
    """With the keywords passed on every launch (pdl_wait a no-op under the interpreter), the Triton engine's
    logits and greedy tokens are the same: each launch site on the prefill and decode paths takes them."""
    from longctx.kernels import common

    ids = rand_ids(36, 5)
    out = {}
    for force in (False, True):
        monkeypatch.setattr(common, "PDL_FORCE", force)
        with Engine(tiny_dir, device="cpu", backend="triton", chunk_size=24) as e:
            logits = e.score(ids)
            toks = e.generate([ids[:20], ids[5:30]], max_new_tokens=3, ignore_eos=True)
        out[force] = (logits, [c.token_ids for c in toks])
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1] == out[False][1]
