"""`longctx` command line. Each subcommand lives beside the code it drives and registers itself.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets `func`
(a callable taking the parsed args and returning an exit code). Modules are imported lazily so
`longctx --help` stays fast; torch is imported only by the commands that need it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import NoReturn

from longctx.errors import LongctxError, os_error_line

# name -> module that registers it
COMMANDS: dict[str, str] = {
    "serve": "longctx.server.cli",
    "generate": "longctx.engine.cli",
    "score": "longctx.engine.cli",
    "plan": "longctx.stages.plan",
    "init-model": "longctx.checkpoint.init_random",
    "ruler": "longctx.workloads.ruler_cli",
    "retrieve": "longctx.workloads.retrieve_cli",
}


class CLIError(LongctxError):
    """Raised by a subcommand for bad input: printed as one line, exit code 2."""


def said_as(parser: argparse.ArgumentParser, told: Mapping[str, str] | None = None) -> Callable[[str], str]:
    """How a command line names a setting (an Engine keyword, a config field) in an error
    (`LongctxError.named`): as `told` says, else by the flag whose dest is the setting (`--kl-rows`), else by
    the setting itself. Each flag's dest is thus the name of the setting it sets."""
    # (argparse has no public list of a parser's actions; an `add_argument` override would miss the flags
    # added through argument groups, ruler's --model among them, which add through the private _add_action)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    told = told or {}
    return lambda name: told.get(name) or flags.get(name, name)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors (`--max-new-tokens x`, a missing or unknown flag) one line as every other
    error of the CLI: `longctx generate: error: argument --max-new-tokens: invalid int value: 'x'` (argparse
    printed the whole usage first, a dozen lines for `generate`). Its subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """The `longctx` parser; each subcommand's parser is its default `parser` (`said_as` reads its flags)."""
    parser = _Parser(prog="longctx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    done: set[str] = set()
    for module in dict.fromkeys(COMMANDS.values()):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("longctx"):
                continue  # a subcommand not built yet
            raise
        mod.register(sub)
        done.add(module)
    for p in (parser, *sub.choices.values()):
        # a flag is named in full: `generate --prompt TEXT` would otherwise read as --prompt-file TEXT
        p.allow_abbrev = False
    for p in sub.choices.values():
        p.set_defaults(parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LongctxError as e:
        print(f"longctx {args.command}: error: {e.named(said_as(args.parser))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except OSError as e:  # a path the command was given: missing, not a directory, not writable, ...
        print(f"longctx {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
