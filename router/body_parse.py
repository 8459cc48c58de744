"""Large request bodies parsed and validated in another process, so the router's event loop
never spends seconds inside one C call.

``json.loads`` and pydantic's validation each hold the GIL for their whole run: 2.6M token ids
took 5.5 s and 230k chat messages 3.4 s on the loop (issue 39), and a thread does not help,
since the loop cannot run until the call returns. A body of at least ``threshold_bytes`` made
of at least ``MIN_VALUES`` JSON values (commas) is sent to a one-process pool that parses it exactly as FastAPI does (``json.loads`` of the bytes, then
the model's validation) and sends back the model or the errors; the loop only awaits. Smaller
bodies take FastAPI's own path: there the process round trip would cost more than the parse.

``OffLoopBodyRoute`` is the route class of the JSON POST routes: it keeps their declared body
model (the OpenAPI schema is unchanged) and takes the large-body path before FastAPI's own.
This module never runs a parse of a large body on the loop and never imports torch.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import multiprocessing
import os
import threading
import time
import typing
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from router.schemas import InvalidText, RequestBody, UnsupportedPart

MAX_ERRORS = 20  # validation errors sent back from the child
MIN_VALUES = 10_000  # commas in a large body from which it goes to the child


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def param_of(loc: tuple[Any, ...]) -> str:
    """'messages[0].content' from pydantic's loc, without the union member tags it inserts."""
    parts = [p for p in loc if p != "body" and not (
        isinstance(p, str) and (p in _TYPE_TAGS or not p.isidentifier()))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _parse(model_path: str, raw: bytes) -> tuple[str, Any]:
    """In the child: ("ok", model) or ("errors", FastAPI-shaped errors, picklable)."""
    module, _, name = model_path.partition(":")
    model: type[BaseModel] = getattr(importlib.import_module(module), name)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return "errors", [{"type": "json_invalid", "loc": ("body", exc.pos),
                           "msg": "JSON decode error", "ctx": {"error": exc.msg}}]
    except UnicodeDecodeError:
        return "errors", [{"type": "json_invalid", "loc": ("body",),
                           "msg": "JSON decode error", "ctx": {"error": "not UTF-8/16/32"}}]
    try:
        return "ok", model.model_validate(value)
    except ValidationError as exc:
        # A million-id list of the wrong type has an error per id (per union member): only
        # the deepest few come back, the ones the answer is chosen from (router/app.py).
        errors = sorted(exc.errors(include_url=False, include_input=False),
                        key=lambda e: -len(param_of(("body", *e.get("loc", ())))))[:MAX_ERRORS]
        return "errors", [_portable(e) for e in errors]


def _portable(err: Any) -> dict[str, Any]:
    """An error without the objects pickling would lose (the cause is rebuilt in the parent)."""
    out = {k: v for k, v in err.items() if k != "ctx"}
    out["loc"] = ("body", *err.get("loc", ()))
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidText):
        out["cause"] = ("InvalidText", cause.param, str(cause).removeprefix(f"{cause.param}: "))
    elif isinstance(cause, UnsupportedPart):
        out["cause"] = ("UnsupportedPart", cause.where, str(cause))
    elif cause is not None:
        out["ctx"] = {"error": str(cause)}
    return out


def _restored(err: dict[str, Any]) -> dict[str, Any]:
    cause = err.pop("cause", None)
    if cause is not None:
        kind, where, detail = cause
        err["ctx"] = {"error": InvalidText(where, detail) if kind == "InvalidText"
                      else UnsupportedPart(where, detail)}
    return err


def _exit_with_parent() -> None:
    """In the child: exit as soon as the router is gone (a router killed by a signal never
    runs the pool's shutdown, and an orphaned child would hold the router's stdout open)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class BodyParser:
    """Parses large bodies in a child process (started on first use, spawned: no fork of a
    process with threads and a running loop)."""

    def __init__(self, threshold_bytes: int) -> None:
        self.threshold_bytes = threshold_bytes
        self._pool: ProcessPoolExecutor | None = None

    @staticmethod
    def _new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_exit_with_parent)

    def start(self) -> None:
        """Start the child now (it imports the request models, seconds on a busy host), so the
        first large body does not wait for it; the warm-up parse is not awaited."""
        if self.threshold_bytes > 0 and self._pool is None:
            self._pool = self._new_pool()
            self._pool.submit(_parse, f"{RequestBody.__module__}:{RequestBody.__qualname__}",
                              b"{}")

    def wants(self, num_bytes: int) -> bool:
        return 0 < self.threshold_bytes <= num_bytes

    def wants_body(self, raw: bytes) -> bool:
        """Large and made of many values: parsing costs per value (a 4 MB string parses in
        milliseconds, 2.6M ids in seconds), and counting commas is a memchr-speed scan."""
        return self.wants(len(raw)) and raw.count(b",") >= MIN_VALUES

    async def parse(self, model: type[BaseModel], raw: bytes) -> BaseModel:
        """The validated ``model`` of ``raw``; RequestValidationError as FastAPI raises it."""
        if self._pool is None:
            self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        kind, value = await loop.run_in_executor(
            self._pool, _parse, f"{model.__module__}:{model.__qualname__}", raw)
        if kind == "errors":
            raise RequestValidationError([_restored(e) for e in value])
        return value

    def close(self) -> None:
        """Stop the child now, whatever it is doing (a parse in flight has no one to answer)."""
        if self._pool is not None:
            children = list(getattr(self._pool, "_processes", {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for child in children:
                child.terminate()
            self._pool = None


class OffLoopBodyRoute(APIRoute):
    """A JSON POST route whose large bodies are parsed by ``request.app.state.body_parser``
    (a BodyParser) off the loop; its endpoint takes ``body`` (the model) and ``request``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        original = super().get_route_handler()
        model = typing.get_type_hints(self.endpoint).get("body")
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            parser: BodyParser | None = getattr(request.app.state, "body_parser", None)
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if parser is None or model is None or kind != "application/json":
                return await original(request)
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and not parser.wants(int(declared)):
                return await original(request)
            raw = await request.body()  # bounded by the body limit; kept for FastAPI's path
            if not parser.wants_body(raw):
                return await original(request)
            body = await parser.parse(model, raw)
            return await endpoint(body=body, request=request)

        return handler
