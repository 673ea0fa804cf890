"""The user-facing docs name what the code serves: every HTTP route, metric and `serve` flag in
docs/server.md, every subcommand in the README's CLI block, and the model name its examples send is the
one `make serve` serves. (No engine starts: the app is built, never run.)"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.routing import APIRoute

ROOT = Path(__file__).resolve().parents[1]
SERVER_MD = (ROOT / "docs" / "server.md").read_text()
README = (ROOT / "README.md").read_text()


def _app():
    from longctx.server.app import create_app
    from longctx.server.engine_proc import EngineSpec
    from longctx.server.state import ServerSettings

    spec = EngineSpec(model_dir=str(ROOT / "models-shipped" / "retrieval-wip"))
    return create_app(ServerSettings(spec=spec, served_model_name="retrieval-wip"))


def _documented(table: str, method: str, path: str) -> bool:
    """`METHOD /path` in the table, or "`GET` / `DELETE /path`" (several methods of one path)."""
    p = re.escape(path)
    return bool(re.search(rf"`{method} {p}`|`{method}`(?: / `[A-Z]+`)* / `[A-Z]+ {p}`", table))


def test_server_md_lists_every_route() -> None:
    table = SERVER_MD[SERVER_MD.index("### Endpoints") : SERVER_MD.index("### Examples")]
    missing = []
    for route in _app().routes:
        if isinstance(route, APIRoute):
            path = re.sub(r"\{[^}]*\}", "{id}", route.path)  # (the table writes every path parameter `{id}`)
            missing += [f"{m} {path}" for m in sorted(route.methods) if not _documented(table, m, path)]
    assert not missing, f"routes not in docs/server.md's endpoint table: {missing}"


def test_server_md_lists_every_metric() -> None:
    from longctx.server.metrics import Metrics

    named = set(re.findall(r"`(longctx_\w+)", SERVER_MD))
    if "`longctx_kv_pages_used` / `_total`" in SERVER_MD:  # (the pair, named once)
        named.add("longctx_kv_pages_total")
    missing = []
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        if name not in named:
            missing.append(name)
    assert not missing, f"metrics not in docs/server.md: {missing}"


def test_server_md_names_every_serve_flag() -> None:
    import argparse

    from longctx.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [
        s
        for a in sub.choices["serve"]._actions
        if a.help != argparse.SUPPRESS
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    ]
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", SERVER_MD)]
    assert not missing, f"`longctx serve` flags not in docs/server.md: {missing}"


def test_readme_cli_block_names_every_subcommand() -> None:
    from longctx.cli import COMMANDS

    block = README[README.index("## CLI") : README.index("Every subcommand has `--help`")]
    missing = [c for c in COMMANDS if f"longctx {c} " not in block]
    assert not missing, f"subcommands not in the README's CLI block: {missing}"


def test_server_md_examples_name_the_model_make_serve_serves() -> None:
    shipped = re.search(r"^SHIPPED := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert shipped is not None
    name = Path(shipped.group(1)).name
    examples = SERVER_MD[SERVER_MD.index("### Examples") : SERVER_MD.index("### Load test")]
    sent = re.findall(r"""model["']?\s*[:=]\s*["']([^"']+)["']""", examples)
    assert sent and set(sent) == {name}, sent
