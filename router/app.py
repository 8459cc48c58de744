"""The OpenAI-compatible HTTP app: `create_app(settings)` builds it, with all state in its lifespan.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id},
POST /tokenize, POST /detokenize, GET /version, GET /health, GET /metrics.  Every error leaves as an OpenAI-shaped body (router/errors.py); a bad request never
changes server state.  This module must never import torch or ``engine/``, and never keep state at
module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.router_identity import INSTANCE_ENV, INSTANCE_HEADER
from router.admission import Admission
from router.background import BackgroundTasks
from router.body_limit import BodyLimitMiddleware
from router.body_parse import BodyParser, OffLoopBodyRoute, param_of
from router.dispatch import Dispatcher
from router.errors import ApiError, no_worker
from router.job import chat_job, completion_job
from router.metrics import RouterMetrics
from router.redis_registry import build_registry
from router.registry import WorkerRegistry
from router.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidText,
    UnsupportedPart,
)
from router.serving import RouterContext, as_api_error, error_response, serve_generation
from router.settings import RouterSettings
from router.tokenize_api import (
    DetokenizeRequest,
    TokenizeRequest,
    check_model,
    detokenize,
    json_body,
    model_card,
    tokenize,
    version,
)
from router.tokenizer_port import RouterTokenizer, load_tokenizer, with_chat_template_file
from router.worker_client import CallDeadlines

log = logging.getLogger("bulkhead.router")


# outside /v1 but behind the API key too: they run the tokenizer on client input
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})
def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    # A value that fits no member of a union gets one error per member; the deepest names the
    # place best (``stop[0]`` for a list holding a number, not the bare ``stop`` of the string
    # member). max() keeps the first of equally deep ones.
    first = max(errors, key=lambda e: len(param_of(tuple(e.get("loc", ()))))) if errors \
        else {"loc": (), "msg": "invalid body", "type": ""}
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidText):
        return ApiError(400, str(cause), "invalid_request_error", cause.param, "invalid_unicode")
    if isinstance(cause, UnsupportedPart):
        param = param_of(tuple(first.get("loc", ()))) + cause.where
        return ApiError(400, f"{param}: {cause}", "invalid_request_error", param,
                        "unsupported_content")
    if first.get("type") == "json_invalid":
        return ApiError(400, f"Malformed JSON body: {first.get('msg')}", "invalid_request_error",
                        "body", "invalid_json")
    param = param_of(tuple(first.get("loc", ())))
    if not param:
        return ApiError(400, f"Request body: {first.get('msg')}", "invalid_request_error",
                        "body", "invalid_body")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return ApiError(400, f"{param}: {first.get('msg')}{more}", "invalid_request_error", param,
                    "invalid_value")


def create_app(settings: RouterSettings, *, tokenizer: RouterTokenizer | None = None,
               registry: WorkerRegistry | None = None) -> FastAPI:
    """Build the app.  `tokenizer` / `registry` default to the ones the settings describe."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok = tokenizer if tokenizer is not None else await asyncio.to_thread(
            load_tokenizer, settings.model)
        if settings.chat_template:
            tok = with_chat_template_file(tok, settings.chat_template)
        # a registered worker whose tokenizer differs from ours is refused (it would answer
        # in token ids we decode wrongly)
        fingerprint = "" if registry is not None or not settings.registry_url else str(
            await asyncio.to_thread(getattr, tok, "fingerprint", "") or "")
        reg: WorkerRegistry = registry if registry is not None else build_registry(
            settings,
            CallDeadlines(settings.info_timeout_s, settings.prefill_timeout_s,
                          settings.first_token_timeout_s, settings.stream_idle_timeout_s),
            fingerprint)
        metrics = RouterMetrics(reg.loads, settings.model_name)
        background = BackgroundTasks()
        await reg.start()
        if not reg.loads():
            log.warning("no worker answered GetInfo yet; requests get 503 until one does")
        app.state.ctx = RouterContext(
            settings, tok, reg, metrics, background,
            Dispatcher(settings, tok, reg, metrics, background),
            Admission(settings.max_inflight_requests, settings.retry_after_s),
            asyncio.Semaphore(settings.max_concurrent_tokenizations))
        app.state.body_parser = BodyParser(settings.parse_off_loop_bytes)
        app.state.body_parser.start()
        log.info("serving model %r", settings.model_name)
        try:
            yield
        finally:
            app.state.body_parser.close()
            await background.close()
            await app.state.ctx.dispatcher.aclose()
            await reg.stop()

    app = FastAPI(title="Bulkhead router", lifespan=lifespan)
    # a large JSON body is parsed and validated in another process (router/body_parse.py)
    app.router.route_class = OffLoopBodyRoute
    if settings.api_keys:
        keys = [k.encode() for k in settings.api_keys]

        @app.middleware("http")
        async def _require_api_key(request: Request, call_next: Any) -> Response:
            if request.url.path.startswith("/v1/") or request.url.path in _KEYED_PATHS:
                auth = request.headers.get("authorization", "")
                scheme, _, token = auth.partition(" ")
                given = token.strip().encode() if scheme.lower() == "bearer" else b""
                # compare against every key, in constant time, so timing tells nothing
                if not any([hmac.compare_digest(given, k) for k in keys]) or not given:
                    return error_response(ApiError(
                        401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                        "invalid_request_error", None, "invalid_api_key"))
            return await call_next(request)
    else:
        log.warning("no API keys configured (BULKHEAD_API_KEYS): the /v1 API is open to anyone "
                    "who can reach this port")

    def ctx_of(request: Request) -> RouterContext:
        return request.app.state.ctx

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:   # FastAPI could not read the body (bytes, depth, digits)
            return error_response(ApiError(
                400, f"Request body: {exc.detail}; it must be one JSON object in UTF-8.",
                "invalid_request_error", "body", "invalid_body"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail),
                                       "invalid_request_error", None, code))

    @app.exception_handler(Exception)
    async def _on_any(request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_api_error(exc, ctx_of(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ctx = ctx_of(request)
        return await serve_generation(ctx, request,
                                      lambda limit: chat_job(body, ctx.settings, ctx.tokenizer,
                                                             limit))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx = ctx_of(request)
        return await serve_generation(ctx, request,
                                      lambda limit: completion_job(body, ctx.settings,
                                                                   ctx.tokenizer, limit))

    def max_model_len(ctx: RouterContext) -> int | None:
        decode = [w for w in ctx.registry.loads() if w.role == "decode" and w.healthy]
        return max(w.max_context for w in decode) if decode else None

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        ctx = ctx_of(request)
        card = model_card(ctx.settings.model_name, ctx.settings.model_name, max_model_len(ctx))
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request) -> JSONResponse:
        ctx = ctx_of(request)
        return JSONResponse(model_card(model_id, ctx.settings.model_name, max_model_len(ctx)))

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest, request: Request) -> Response:
        ctx = ctx_of(request)
        check_model(body.model, ctx.settings.model_name)
        return Response(await asyncio.to_thread(lambda: json_body(
            tokenize(body, ctx.tokenizer, max_model_len(ctx)))), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest, request: Request) -> Response:
        ctx = ctx_of(request)
        check_model(body.model, ctx.settings.model_name)
        return Response(await asyncio.to_thread(lambda: json_body(
            detokenize(body, ctx.tokenizer))), media_type="application/json")

    @app.get("/version")
    async def version_endpoint() -> JSONResponse:
        return JSONResponse(version())

    # the id `bulkhead up` started this router with, in every /health answer
    instance = {INSTANCE_HEADER: os.environ[INSTANCE_ENV]} if os.environ.get(INSTANCE_ENV) else {}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ctx = ctx_of(request)
        loads = ctx.registry.loads()
        workers = {w.address: {"role": w.role, "healthy": w.healthy} for w in loads}
        for addr, problem in ctx.registry.problems().items():
            workers.setdefault(addr, {"healthy": False})["problem"] = problem
        if any(w.role == "decode" and w.healthy for w in loads):
            return JSONResponse({"status": "ok", "workers": workers}, headers=instance)
        err = no_worker("decode", ctx.settings.retry_after_s)
        return JSONResponse({"status": "unavailable", "workers": workers},
                            status_code=503, headers={**err.headers(), **instance})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(ctx_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # outermost of our middleware: nothing, not even the API-key check, reads an oversized body
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app
