"""`longctx serve`: the OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from longctx.engine.args import add_engine_args, engine_kwargs, selection_kwargs
from longctx.server.reasoning import PARSERS as REASONING_PARSERS
from longctx.server.tools import FORMATS as TOOL_CALL_PARSERS
from longctx.server.tools import tool_call_parser

if TYPE_CHECKING:
    from longctx.config import ModelConfig

log = logging.getLogger("longctx.server")
DRAIN_MARGIN_S = 5.0  # uvicorn's own shutdown deadline, past --drain-timeout


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/documents, "
        "/v1/models, /health, /metrics. SIGTERM drains running requests and exits.",
    )
    add_engine_args(p, model_help="model directory (config.json, safetensors, tokenizer.json)", choices=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (the URL is logged)")
    p.add_argument(
        "--served-model-name", default=None, help="name clients send as `model` (default: dir name)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("LONGCTX_API_KEY"),
        help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
        "(default: $LONGCTX_API_KEY)",
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="429 when more requests than this wait for admission"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for running requests"
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a jinja chat template file, or the template itself, instead of the model directory's",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "none"],
        help="auto: the sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens) take the model's generation_config.json values (vLLM's default); "
        "none: longctx's own defaults",
    )
    p.add_argument(
        "--reasoning-parser",
        default="none",
        choices=list(REASONING_PARSERS),
        help="glm / deepseek_v3: a chat answer's <think> block goes to message.reasoning_content (GLM-4.5 and "
        "later; DeepSeek-V3.1 and V3.2)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *TOOL_CALL_PARSERS],
        help="the format a chat's tool calls are read in under tool_choice auto (vLLM's names): glm "
        "(<tool_call>, GLM-4.5 and later), deepseek_v31 (DeepSeek-V3.1's tool-call tokens) or deepseek_v32 "
        "(DeepSeek-V3.2's DSML); auto: the model's own by its config.json's model_type (deepseek_v32 for "
        "deepseek_v32, glm for glm_moe_dsa)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # Hidden: a compute-free engine for tests and load benches; optional JSON of FakeEngineOptions.
    p.add_argument("--fake-engine", nargs="?", const="{}", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _check_selection(args: argparse.Namespace, cfg: ModelConfig | None) -> None:
    """The selection flags (SELECTION_FIELDS), for the real engine and the fake one alike: each in range, with
    one message whichever engine serves; then, given the model's config (the fake engine has none), as
    `with_selection` takes them over the checkpoint's, and --hisparse-device-tokens against the top-k that
    leaves."""
    from longctx.config import SELECTION_FIELDS, check_device_tokens, check_selection_min, with_selection

    for name in SELECTION_FIELDS:
        if (value := getattr(args, name)) is not None:
            check_selection_min(name, value)
    if cfg is not None:
        check_device_tokens(with_selection(cfg, **selection_kwargs(args)), args.hisparse_device_tokens)


def _preflight(args: argparse.Namespace) -> ModelConfig:
    """What the engine process would refuse at once, refused before the server binds its port: one
    line instead of uvicorn's start and stop around it. The engine checks again (and the rest).
    Returns the model's config."""
    from longctx.checkpoint.generation_config import load_generation_config
    from longctx.config import ModelConfig, check_kv_fp8_skip_layers, check_layout

    # (`run` has checked that the model dir holds a config.json)
    cfg = ModelConfig.from_json(Path(args.model))
    load_generation_config(args.model)  # (a file a request could not follow: refused now)
    check_layout(cfg, args.pp, args.tp)
    _check_selection(args, cfg)
    skip = engine_kwargs(args)["kv_fp8_skip_layers"]
    if skip is not None:
        check_kv_fp8_skip_layers(skip, cfg.num_hidden_layers)
    return cfg


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the template given inline (vLLM's rule: a value with jinja tags);
    a CLIError (one line) for neither, a file not UTF-8, or a template jinja cannot parse."""
    from longctx.cli import CLIError

    if value is None:
        return None
    p = Path(value)
    if p.is_file():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CLIError.about("chat_template", value, f"is not UTF-8 (byte {e.start})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise CLIError.about("chat_template", value, "is neither a file nor a jinja template")
    from longctx.checkpoint.chat_template import check_chat_template
    from longctx.errors import RequestError

    try:
        check_chat_template(text)
    except RequestError as e:
        raise CLIError.about("chat_template", None, str(e)) from None
    return text


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from longctx.cli import CLIError
    from longctx.server.app import create_app
    from longctx.server.engine_proc import EngineSpec
    from longctx.server.state import ServerSettings

    class _Server(uvicorn.Server):
        """uvicorn's server, telling `on_exit_signal` when SIGTERM / SIGINT start the drain."""

        def __init__(self, config: uvicorn.Config, on_exit_signal: Callable[[], None]) -> None:
            super().__init__(config)
            self._on_exit_signal = on_exit_signal

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            self._on_exit_signal()

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fake = None
    if args.fake_engine is not None:
        try:
            fake = json.loads(args.fake_engine)
        except ValueError as e:
            raise CLIError(f"--fake-engine: not JSON: {e}") from None
        if not isinstance(fake, dict):
            raise CLIError("--fake-engine: expected a JSON object")
        from longctx.errors import LongctxError
        from longctx.server.fake_engine import fake_options

        try:
            fake_options(fake)
        except LongctxError as e:
            raise CLIError(f"--fake-engine: {e}") from None
    elif not (Path(args.model) / "config.json").is_file():
        raise CLIError(f"--model {args.model}: no config.json there")
    for name in ("pp", "tp", "max_queue", "max_context", "max_running", "hisparse_device_tokens", "kv_pages",
                 "chunk_size"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value < 1:  # (the last three are optional)
            raise CLIError.about(name, value, "must be >= 1")
    if not 0 <= args.port <= 65535:
        raise CLIError.about("port", args.port, "must be in [0, 65535] (0 picks a free port)")
    if not math.isfinite(args.drain_timeout) or args.drain_timeout < 0:
        raise CLIError.about("drain_timeout", args.drain_timeout, "must be a number of seconds >= 0")
    if args.api_key and not args.api_key.isascii():  # (no HTTP client sends it: every request a 401)
        raise CLIError.about("api_key", None, "must be ASCII")
    cfg = _preflight(args) if fake is None else None
    if cfg is None:
        _check_selection(args, None)
    spec = EngineSpec(
        model_dir=args.model,
        **engine_kwargs(args),
        fake=fake,
        term_grace_s=args.drain_timeout + 2 * DRAIN_MARGIN_S,  # (the frontend's whole shutdown)
    )
    name = args.served_model_name or (Path(args.model).resolve().name or "longctx")
    settings = ServerSettings(
        spec=spec,
        served_model_name=name,
        api_key=args.api_key or None,
        max_queue=args.max_queue,
        drain_timeout_s=args.drain_timeout,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=tool_call_parser(args.tool_call_parser, cfg.model_type if cfg else None),
        generation_config=args.generation_config,
        chat_template=read_chat_template(args.chat_template),
    )
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    except (UnicodeError, TypeError):  # (a name that does not encode: a byte not UTF-8, a label too long)
        raise CLIError.about("host", repr(args.host), "is not a host name or address") from None
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    failed: list[str] = []

    def on_start_failure(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    server_loop: list[asyncio.AbstractEventLoop] = []  # the server's, once the engine is ready
    drain_timer: list[asyncio.Task[None]] = []

    async def end_the_drain_on_time() -> None:
        # past its own deadline uvicorn cancels the requests still running mid-response (a bare
        # 500 and a traceback each): end them at --drain-timeout instead, with a 503 (a stream: an
        # error event), and give uvicorn's deadline DRAIN_MARGIN_S more for those to go out
        await asyncio.sleep(args.drain_timeout)
        app.state.longctx.client.end_all(
            f"server is shutting down: still running after the {args.drain_timeout:g} s drain"
        )

    def start_the_drain_timer() -> None:
        if not drain_timer:
            drain_timer.append(server_loop[0].create_task(end_the_drain_on_time()))

    def on_exit_signal() -> None:
        # runs in the signal handler: hand the timer's start to the loop (before the engine is
        # ready no request can be running, so there is nothing to time)
        if server_loop:
            server_loop[0].call_soon_threadsafe(start_the_drain_timer)

    def on_ready() -> None:
        log.info("longctx serving %s at %s (OpenAI API: %s/v1)", name, url, url)
        server_loop.append(asyncio.get_running_loop())

    app = create_app(settings, on_ready=on_ready, on_start_failure=on_start_failure)

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    config = uvicorn.Config(
        app,
        loop=loop,
        log_level=args.log_level,
        timeout_graceful_shutdown=math.ceil(args.drain_timeout + DRAIN_MARGIN_S),
        access_log=level <= logging.DEBUG,
    )
    server = _Server(config, on_exit_signal)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal with the handlers it found at
    # start; a no-op handler here turns a drained shutdown into a clean exit code 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if failed:  # the engine did not start: one line, exit 2
        raise CLIError(f"the engine did not start: {failed[0].removeprefix('engine failed: ')}")
    # uvicorn swallows any other failed startup into a non-zero exit of its own; report it as one.
    return 0 if server.started else 1
