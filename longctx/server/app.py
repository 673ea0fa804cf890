"""The FastAPI app: lifespan (engine process up/down), auth, error shapes, small endpoints."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from longctx import __version__
from longctx.server import messages as m
from longctx.server.engine_client import RpcError
from longctx.server.protocol import ApiError, engine_error, error_body, retry_headers, validation_error
from longctx.server.routes_documents import router as documents_router
from longctx.server.routes_generate import router as generate_router
from longctx.server.state import ServerSettings, ServerState, get_state

log = logging.getLogger("longctx.server")


async def require_api_key(request: Request) -> None:
    key = get_state(request).settings.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(
            401,
            "invalid or missing API key (send `Authorization: Bearer KEY`)",
            "authentication_error",
            code="invalid_api_key",
        )


def route_leaves(routes: list[Any]) -> Iterator[Any]:
    """Every route of `routes`, included routers walked into: FastAPI keeps them whole (`original_router`)
    since 0.16x, as plain routes before."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        yield from route_leaves(inner.routes) if inner is not None else (r,)


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods some route of `request`'s path answers (Starlette's 405 names only the first route's,
    so GET /v1/documents/{id}'s DELETE went unsaid)."""
    methods: set[str] = set()
    for route in route_leaves(app.router.routes):
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


class OneTrailingSlash:
    """Every route served with or without one trailing slash (`POST /v1/documents/` is `POST /v1/documents`):
    Starlette answered a 307 redirect to the path without it, which many HTTP clients do not follow for a POST.
    One slash is dropped before routing (`/v1/models/x/` asks for the model `x`); a path that names no route
    either way stays a 404 as any other (the app's `redirect_slashes` is off: nothing is redirected)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path[:-1]}
            raw = scope.get("raw_path")
            if isinstance(raw, bytes) and raw.endswith(b"/"):
                scope["raw_path"] = raw[:-1]
        await self.app(scope, receive, send)


def create_app(
    settings: ServerSettings,
    on_ready: Callable[[], None] | None = None,
    on_start_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """An app that starts the engine process on startup and stops it on shutdown. An engine that fails
    to start (a bad flag combination, unloadable weights) goes to `on_start_failure(reason)` when given,
    which should stop the server: the app then serves nothing (503 while it stops) and raises nothing,
    so the CLI can say what went wrong in one line instead of a startup traceback."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            ready = await state.client.start(settings.engine_start_timeout_s)
        except Exception as e:
            if on_start_failure is None:
                raise
            on_start_failure(str(e))
            state.draining = True
            try:
                yield
            finally:
                await state.client.close()
            return
        setting = ready.info.get("max_context_setting", ready.max_context)
        st = state.settings
        log.info(
            "engine ready: max_context=%d%s vocab=%d kv=%s scheduling=%s tool calls=%s reasoning=%s %s",
            ready.max_context,
            f" (what the KV pool holds; --max-context {setting})" if setting > ready.max_context else "",
            ready.vocab_size,
            ready.info.get("kv", "-"),
            st.spec.scheduling_policy,
            st.tool_call_parser,  # (--tool-call-parser auto resolved: the format "auto" tool calls are read in)
            st.reasoning_parser,
            "(fake engine)" if ready.info.get("fake") else "",
        )
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            state.draining = True
            await state.client.close()

    app = FastAPI(
        title="longctx",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.add_middleware(OneTrailingSlash)
    app.state.longctx = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        headers = dict(e.headers or {})  # (the exception's headers: a 405's Allow says which methods)
        if e.status_code == 405:  # every route of this path, not only the first one the router tried
            headers["Allow"] = ", ".join(allowed_methods(app, request)) or headers.get("Allow", "")
        return JSONResponse(
            error_body(str(e.detail), kind, code=str(e.status_code)),
            status_code=e.status_code,
            headers=headers,
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500
        )

    auth = [Depends(require_api_key)]
    app.include_router(generate_router, dependencies=auth)
    app.include_router(documents_router, dependencies=auth)

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    async def health() -> Response:
        c = state.client
        if not c.healthy or state.draining:
            reason = "shutting down" if state.draining and c.healthy else c.dead_reason
            return JSONResponse(
                {"status": "unhealthy", "reason": reason}, status_code=503, headers=retry_headers(503)
            )
        return JSONResponse(
            {
                "status": "ok",
                "waiting": c.num_waiting,
                "running": c.num_running,
                "in_flight": c.num_in_flight(),
                "engine_pid": state.ready.info.get("pid"),
            }
        )

    @app.get("/version")
    async def version() -> dict[str, Any]:
        """vLLM's /version (open, as /health is)."""
        return {"version": __version__}

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "longctx",
            "max_model_len": state.max_context,
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict[str, Any]:
        """OpenAI's models.retrieve."""
        if model_id != settings.served_model_name:
            raise ApiError(
                404, f"no model {model_id!r}", "not_found_error", param="model", code="model_not_found"
            )
        return model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        state.refresh_metrics()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/stats", dependencies=auth)
    async def stats() -> dict[str, Any]:
        """Fresh engine stats (pages, prefix cache, host pool, HiSparse) straight from the engine."""
        try:
            return await state.client.call(lambda cid: m.StatsQuery(cid), timeout=30.0)
        except Exception as e:
            raise ApiError(503, f"engine unavailable: {e}", "server_error", code="engine_dead") from None

    async def reset_prefix_cache() -> dict[str, int]:
        """vLLM's POST /reset_prefix_cache, SGLang's POST /flush_cache: the prefix cache drops every page
        no running request or pinned document holds, so a benchmark's next run prefills cold; the engine
        does it between two steps, requests in flight go on. {"freed_pages", "kept_pages"}."""
        try:
            done = await state.client.call(lambda cid: m.ResetPrefixCache(cid), timeout=30.0)
        except RpcError as e:
            raise engine_error(str(e), e.code) from None
        except Exception as e:
            raise ApiError(503, f"engine unavailable: {e}", "server_error", code="engine_dead") from None
        state.metrics.prefix_cache_resets.inc()
        return {"freed_pages": int(done["freed_pages"]), "kept_pages": int(done["kept_pages"])}

    for path in ("/reset_prefix_cache", "/flush_cache"):
        app.add_api_route(path, reset_prefix_cache, methods=["POST"], dependencies=auth)

    return app
