"""The user-facing docs name what the code serves: every HTTP route, metric and `serve` flag in
docs/server.md (its synopsis with the parser's defaults and choices), every subcommand in the README's CLI
block, and the model name its examples send is the one `make serve` serves. And what the docs name exists:
each flag of a `longctx SUB` / `python -m longctx.train` command they give, each bench module, each
module in docs/architecture.md's map (every module is in it), each LONGCTX_* variable (every one the code
reads is in them), the README's Engine keywords. (No engine starts: the app is built, never run.)"""

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


# ---- commands, modules and environment variables the docs name -------------------------------------------

DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text()
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
ARCH = DOCS["docs/architecture.md"]
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _command_lines(text: str) -> list[str]:
    """The doc's code as one line per command: a code block's lines, a line indented or after a trailing
    backslash joined to the command it continues, and every inline code span (wrapped ones joined)."""
    lines: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            cont = line.startswith(" ") and not re.match(r"\s*(longctx|python|curl|make|torchrun|#)\b", line)
            if lines and (cont or lines[-1].endswith("\\")):
                lines[-1] = lines[-1].rstrip("\\") + " " + line.strip()
            else:
                lines.append(line)
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    lines += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    lines += [line for line in prose.splitlines() if line.startswith("    ")]  # indented code
    return lines


def _subcommand_flags() -> dict[str, set[str]]:
    import argparse

    from longctx.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


def test_docs_commands_use_flags_their_parser_has() -> None:
    """Every `longctx SUB ... --flag` and `python -m longctx.train ... --flag` in README.md and docs/*.md
    names a flag that parser has (a command's flags end at `|`, `;` or a `#` comment)."""
    from longctx.train.__main__ import build_parser as train_parser

    flags = _subcommand_flags()
    flags["longctx.train"] = {s for a in train_parser()._actions for s in a.option_strings}
    command_re = re.compile(
        r"(?<![\w/.-])(?:longctx ([a-z-]+)|python -m (longctx\.train))((?: (?:[^|;#]|\| (?=--))*)?)"
    )  # (` | --flag`: the synopsis' alternative, not a pipe)
    wrong, checked = [], 0
    for doc, text in DOCS.items():
        for line in _command_lines(text):
            for m in command_re.finditer(line):
                command = m.group(1) or m.group(2)
                if command not in flags:  # ("longctx model setting", ...: prose, not a command)
                    continue
                given = _FLAG.findall(m.group(3))
                checked += len(given)
                wrong += [f"{doc}: {command} {f}" for f in given if f not in flags[command]]
    assert checked >= 100, f"only {checked} flags found in the docs' commands: the pattern is wrong"
    assert not wrong, f"flags the docs give that the parser does not have: {wrong}"


def test_docs_name_bench_modules_that_exist() -> None:
    """Every `python -m bench.X`, `bench.X` and `bench/X.py|.sh` the docs name is a file in bench/."""
    missing = set()
    for doc, text in DOCS.items():
        for name in re.findall(r"(?<![\w/])bench[./]([a-z_0-9]+)(?:\.(py|sh))?\b", text):
            stem, ext = name
            if stem in ("results", "rounds"):
                continue
            if not any((ROOT / "bench" / f"{stem}.{e}").exists() for e in ((ext,) if ext else ("py", "sh"))):
                missing.add(f"{doc}: bench/{stem}")
    assert not missing, sorted(missing)


def _arch_row(module: str) -> str:
    row = re.search(rf"^\| `{re.escape(module)}`[^|]*\|(.*)\|$", ARCH, re.M)
    assert row is not None, f"docs/architecture.md has no row for {module}"
    return row.group(1)


def test_architecture_md_names_every_module() -> None:
    """Each package's row of docs/architecture.md's module table names every module in it (`stem`, or a
    `prefix_*` pattern), longctx/server's modules are in docs/server.md's code map, and every top-level
    longctx module has a row of its own: a module added without a word in the map fails here."""
    missing = [
        f"longctx/{p.name}"
        for p in sorted((ROOT / "longctx").glob("*.py"))
        if p.stem != "__init__" and f"| `longctx/{p.name}` |" not in ARCH
    ]
    code_map = SERVER_MD[SERVER_MD.index("### Code map") :]
    missing += [
        f"longctx/server/{p.name} (docs/server.md's code map)"
        for p in sorted((ROOT / "longctx" / "server").glob("*.py"))
        if p.stem != "__init__" and f"`{p.name}`" not in code_map
    ]
    packages = ["checkpoint", "model", "kvstore", "engine", "stages", "hisparse", "workloads", "train"]
    rows = {f"longctx/{p}/": ROOT / "longctx" / p for p in packages} | {
        "kernels/": ROOT / "kernels",
        "bench/": ROOT / "bench",
    }
    for module, path in rows.items():
        row = _arch_row(module)
        named = set(re.findall(r"`([a-z_0-9]+)(?:\.sh)?`", row))
        patterns = re.findall(r"`([a-z_0-9]+_)\*`", row)
        for f in sorted([*path.glob("*.py"), *path.glob("*.sh")]):
            if (
                f.stem != "__init__"
                and f.stem not in named
                and not any(f.stem.startswith(p) for p in patterns)
            ):
                missing.append(f"{module}{f.name}")
    assert not missing, f"modules docs/architecture.md's module table does not name: {missing}"


def _code(*dirs: str) -> str:
    return "\n".join(p.read_text() for d in dirs for p in sorted((ROOT / d).rglob("*.py")))


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    """Each LONGCTX_* variable longctx/ and kernels/ name (as a whole string literal) is named in README.md
    or docs/*.md, and each one the docs name is still read by longctx/, kernels/ or bench/."""
    var = r"LONGCTX_[A-Z0-9_]*[A-Z0-9]"
    read = set(re.findall(rf"""["']({var})["']""", _code("longctx", "kernels")))
    docs = "\n".join(DOCS.values())
    documented = set(re.findall(rf"{var}(?![A-Z0-9_])", docs))
    assert read, "no LONGCTX_ variable found in the code: the pattern is wrong"
    assert not sorted(read - documented), f"read by the code, named in no doc: {sorted(read - documented)}"
    known = read | set(re.findall(rf"{var}(?![A-Z0-9_])", _code("bench") + (ROOT / "Makefile").read_text()))
    for sh in (ROOT / "bench").glob("*.sh"):
        known |= set(re.findall(rf"{var}(?![A-Z0-9_])", sh.read_text()))
    assert not sorted(documented - known), f"named in the docs, read nowhere: {sorted(documented - known)}"


def test_server_md_serve_synopsis_gives_the_parser_defaults_and_choices() -> None:
    """In docs/server.md's `longctx serve` synopsis, `[--flag VALUE]` gives the flag's default and
    `--flag a|b|c` its choices, the default first."""
    import argparse

    from longctx.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {s: a for a in sub.choices["serve"]._actions for s in a.option_strings}
    block = re.search(r"```sh\n(make serve.*?)```", SERVER_MD, re.S)
    assert block is not None
    synopsis = " ".join(block.group(1).split())
    checked, wrong = 0, []
    for flag, value in re.findall(r"(--[a-z][a-z0-9-]*) ([^\s\[\]]+)", synopsis):
        if flag not in actions or value.startswith("--"):
            continue
        a = actions[flag]
        if "|" in value:
            if "," in value:  # (`L,..|none`: a list or a word, no choices)
                continue
            listed = value.split("|")
            if a.choices is None or sorted(listed) != sorted(a.choices) or listed[0] != a.default:
                wrong.append(f"{flag} {value}: choices {a.choices}, default {a.default!r}")
        elif value[0].isdigit() or value[0].islower():
            same = str(a.default) == value or (
                isinstance(a.default, int | float) and float(value) == a.default
            )
            if not same:
                wrong.append(f"{flag} {value}: default {a.default!r}")
        else:
            continue  # a metavar (N, K, NAME, ...)
        checked += 1
    assert checked >= 8 and not wrong, (checked, wrong)


def test_readme_python_api_example_keywords() -> None:
    """The README's `Engine(...)` example passes every argument by its name with its default, and its
    `eng.generate(...)` call names only parameters `generate` has."""
    import ast
    import inspect

    from longctx import Engine

    example = README[README.index("## Python API") : README.index("## CLI")]
    ctor = re.search(r'Engine\("[^"]+",(.*?)\) as eng:', example, re.S)
    gen = re.search(r"eng\.generate\(\[.*?\],(.*?)\)\n", example, re.S)
    assert ctor is not None and gen is not None
    params = inspect.signature(Engine.__init__).parameters
    wrong = []
    for name, value in re.findall(r"(\w+)=([^,]+)", ctor.group(1)):
        if name not in params:
            wrong.append(f"Engine({name}=): no such parameter")
        elif ast.literal_eval(value.strip()) != params[name].default:
            wrong.append(f"Engine({name}={value.strip()}): the default is {params[name].default!r}")
    gparams = inspect.signature(Engine.generate).parameters
    wrong += [
        f"generate({n}=): no such parameter" for n in re.findall(r"(\w+)=", gen.group(1)) if n not in gparams
    ]
    assert not wrong, wrong
