"""What the prefill and decode workers share: start-up (engine, KV store, compatibility
fingerprints), the RPCs both serve (GetInfo, Abort, Lookup), the LMCache import hook, and
``serve_worker``: a grpc.aio server with grpc.health.v1 that stops gracefully on SIGINT/SIGTERM
or when the engine loop dies.

Each role subclasses ``WorkerServicerBase`` and implements its own RPC (Prefill or Generate).
Nothing here calls the engine outside the engine thread (``EngineLoop``), and nothing blocks the
asyncio loop on the network or the device once the server is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from common.ports import port_in_use
from common.settings import WorkerSettings
from common.startup_progress import StartupProgress
from engine.device_info import describe_device
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.staged_kv import StagedKV
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from worker.auth import AccessError, server_credentials, server_interceptors, warn_if_open
from worker.codec import abort_with, unary_rpc
from worker.engine_loop import EngineLoop, RequestStream, build_on_a_passing_thread
from worker.errors import DeadlinePassed, KVStoreUnavailable, WrongRole
from worker.grammar_cache import GrammarCache
from worker.grammar_pool import GrammarPool, GrammarPoolConfig
from worker.heap_trim import trim_heap
from worker.kv_import import fetch_import
from worker.kv_store import KVStore
from worker.kv_store_config import auto_chunk_tokens, layout_fingerprint
from worker.registration import registration_publisher
from worker.worker_config import WorkerConfig, staging_gb

log = logging.getLogger(__name__)
SERVICE_NAME = "bulkhead.v1.Worker"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class WorkerRuntime:
    """Everything a worker built at start-up; handed to its servicer."""

    settings: WorkerSettings
    engine: LLMEngine
    loop: EngineLoop
    kv_store: KVStore | None
    compat: pb.Compatibility
    model_name: str
    # constrained decoding: compiles on its own pool (the compiler is built on first use)
    grammars: GrammarPool | None = None

    def close(self) -> None:
        self.loop.stop()
        if self.kv_store is not None:
            self.kv_store.close()
        self.engine.close()  # the other tensor-parallel ranks, if any


def _tokenizer_fingerprint(model: str) -> str:
    from common.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.from_path(model).fingerprint
    except (TokenizerError, OSError) as exc:
        log.warning("no tokenizer fingerprint for %s: %s", model, exc)
        return ""


def build_runtime(settings: WorkerSettings,
                  progress: Callable[[str], None] | None = None) -> WorkerRuntime:
    """Load the model, plan and lock memory, connect the KV store. Blocking (seconds).
    ``progress`` is told each step (``StartupProgress`` prints them for ``bulkhead up``)."""
    config = WorkerConfig.from_settings(settings)
    settings, store = config.settings, config.store
    device = describe_device(config.engine)  # CPU or which card, and the kernels chosen
    log.info("%s worker %s: %s", settings.role, settings.name, device)
    if progress is not None:
        progress(device)
    engine = build_on_a_passing_thread(lambda: LLMEngine.from_config(config.engine, progress))
    mc = engine.model_config
    kv_dtype = engine.config.torch_dtype
    layout = engine.kv_layout
    # LMCache keys include the model name: both sides derive it from the weights they loaded.
    store_model_name = f"{mc.name}-{engine.model_fingerprint[:16]}"
    # One store for every family: whole blocks of the engine's layout, whose fingerprint the
    # store's covers (two workers exchange bytes only if their layouts agree).
    chunk_size = settings.lmcache_chunk_size or auto_chunk_tokens(layout.block_size,
                                                                  layout.bytes_per_block)
    kv_layout = layout_fingerprint(store_model_name, layout.fingerprint, layout.block_size,
                                   layout.bytes_per_block, chunk_size)
    kv_store: KVStore | None = None
    if progress is not None:
        progress("warm-up done" + (", connecting the KV store through LMCache"
                                   if settings.kv_store_url else ""))
    if store is not None:
        kv_store = KVStore(store.url, store_model_name, layout, chunk_size=chunk_size,
                           staging_gb=staging_gb(store, engine.config, layout.bytes_per_token,
                                                 chunk_size),
                           ttl_s=store.ttl_s,
                           writes=settings.role == "prefill",  # only prefill puts
                           pin_staging=store.staging_pinned,
                           fetch_connections=store.fetch_connections)
    assert kv_store is None or kv_store.layout_fingerprint == kv_layout
    trim_heap()  # the load's freed temporaries (worker/heap_trim.py)
    if progress is not None and kv_store is not None:
        progress(f"KV store connected: {kv_store.public_url}, LMCache pool "
                 f"{kv_store.pool_bytes / 2**20:,.0f} MiB")
    compat = pb.Compatibility(
        model_fingerprint=engine.model_fingerprint,
        tokenizer_fingerprint=_tokenizer_fingerprint(settings.model),
        dtype=str(kv_dtype).removeprefix("torch."),
        block_size=engine.config.block_size,
        lmcache_chunk_size=chunk_size,
        kv_layout_fingerprint=kv_layout,
    )
    grammars = GrammarPool(
        GrammarCache(settings.model, mc.vocab_size, tuple(mc.eos_token_ids)),
        GrammarPoolConfig(settings.max_concurrent_grammar_compiles,
                          settings.max_waiting_grammar_compiles,
                          settings.grammar_compile_timeout_s))
    return WorkerRuntime(settings, engine, EngineLoop(engine), kv_store, compat, mc.name,
                         grammars)


def remaining_s(deadline_unix_s: float) -> float | None:
    """Seconds left before a request's deadline (None = no deadline)."""
    if deadline_unix_s <= 0:
        return None
    return deadline_unix_s - time.time()


def time_left(deadline_unix_s: float, what: str) -> float | None:
    """``remaining_s``, or DeadlinePassed naming ``what`` had not started yet."""
    left = remaining_s(deadline_unix_s)
    if left is not None and left <= 0:
        raise DeadlinePassed(f"the request's deadline passed before {what} started")
    return left


class WorkerServicerBase(pb_grpc.WorkerServicer):
    """GetInfo, Abort and Lookup; the role's subclass adds Prefill or Generate."""

    role = ""

    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.loop = rt.loop

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def request_id(given: str) -> str:
        return given or f"req-{uuid.uuid4().hex}"

    @staticmethod
    async def fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        await abort_with(context, exc)

    async def submit(self, rid: str, prompt: list[int], sampling: SamplingParams,
                     **kwargs: Any) -> RequestStream:
        """Add the request on the engine thread (engine errors raise here); if the RPC is
        cancelled meanwhile, the add may still land, so it is taken back."""
        try:
            return await self.loop.submit(rid, prompt, sampling, **kwargs)
        except asyncio.CancelledError:
            self.loop.post(lambda engine: engine.abort(rid))
            raise

    async def grammar(self, sampling: pb.SamplingParams) -> Any:
        """The compiled grammar a request's sampling names (None: unconstrained), compiled on
        the worker's grammar pool (cached, bounded, timed; worker/grammar_pool.py): the engine
        thread never compiles. Raises InvalidRequest or QueueFull."""
        if not sampling.grammar_kind:
            return None
        if self.rt.grammars is None:
            raise InvalidRequest("this worker has no grammar engine", "response_format")
        return await self.rt.grammars.compile(sampling.grammar_kind, sampling.grammar_spec)

    async def prepare_import(self, prompt: Sequence[int]) -> StagedKV | None:
        """The stored prefix of ``prompt`` fetched into host memory, for the engine to import
        (worker/kv_import.py)."""
        return await fetch_import(self.rt.kv_store, prompt)

    # ------------------------------------------------------------------ RPCs
    @unary_rpc
    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        """Served by the prefill role; every other role refuses it (UNIMPLEMENTED)."""
        raise WrongRole(f"this is a {self.role} worker: send Prefill to a prefill worker")

    @unary_rpc
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateChunk:
        """Served by the decode role; every other role refuses it (UNIMPLEMENTED)."""
        raise WrongRole(f"this is a {self.role} worker: send Generate to a decode worker")

    async def GetInfo(self, request: pb.WorkerInfoRequest,
                      context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        """Static description, compatibility fingerprints, live load and progress counters.
        Reads the engine loop's last snapshot: never waits behind a running step."""
        return self.info()

    def info(self) -> pb.WorkerInfo:
        """This worker's WorkerInfo now (GetInfo's answer and the registry heartbeat's value)."""
        s, ec, plan = self.loop.stats, self.rt.engine.config, self.rt.engine.plan
        return pb.WorkerInfo(
            worker_id=self.rt.settings.name, role=self.role, model_name=self.rt.model_name,
            compat=self.rt.compat, max_context=ec.max_context, chunk_tokens=ec.chunk_tokens,
            max_batch=ec.max_batch, num_running=s.num_running, num_waiting=s.num_waiting,
            max_queue=ec.max_queue, free_kv_tokens=s.free_kv_tokens,
            memory_planned_bytes=plan.total_bytes,
            memory_headroom_bytes=max(plan.headroom_bytes, 0),
            steps_completed=s.steps_completed, tokens_advanced=s.tokens_advanced,
            address=self.rt.settings.address,
            total_kv_tokens=self.rt.engine.block_manager.num_usable_blocks * ec.block_size,
            tensor_parallel_size=ec.tensor_parallel_size, num_preemptions=s.num_preemptions,
            spec_num_drafts=s.spec_num_drafts, spec_num_draft_tokens=s.spec_num_draft_tokens,
            spec_num_accepted_tokens=s.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(s.spec_accepted_per_pos))

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Abort a running request (frees its blocks); found=False if it is not here."""
        rid = request.request_id
        found = await self.loop.call(lambda engine: engine.abort(rid))
        return pb.AbortResponse(found=bool(found))

    @unary_rpc
    async def Lookup(self, request: pb.LookupRequest,
                     context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """Leading prompt tokens whose KV this worker could load from the store."""
        store = self.rt.kv_store
        if store is None or not request.prompt_token_ids:
            return pb.LookupResponse(num_cached_tokens=0)
        try:
            n = await asyncio.to_thread(store.lookup, list(request.prompt_token_ids))
        except Exception as exc:
            raise KVStoreUnavailable(f"KV store lookup failed: {exc}") from exc
        return pb.LookupResponse(num_cached_tokens=n)


@dataclass
class RunningServer:
    """A started gRPC server with its health service (``port`` is the bound port)."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    servicer: WorkerServicerBase
    port: int

    async def stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(rt: WorkerRuntime,
                       make_servicer: Callable[[WorkerRuntime], WorkerServicerBase],
                       host: str, port: int) -> RunningServer:
    """Start the engine loop and a grpc.aio server (Worker + Health) on ``host:port`` (0 = any
    free port); health is SERVING once this returns. With ``internal_token`` set every Worker
    call must carry it, with ``tls_cert_file``/``tls_key_file`` the port is TLS (worker/auth.py;
    an unreadable file raises AccessError before anything starts)."""
    settings = rt.settings
    credentials = server_credentials(settings.tls_cert_file, settings.tls_key_file)
    rt.loop.start()
    server = grpc.aio.server(interceptors=server_interceptors(settings.internal_token),
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    servicer = make_servicer(rt)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    # both raise RuntimeError if they cannot bind
    bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
             else server.add_insecure_port(f"{host}:{port}"))
    warn_if_open(host, settings.internal_token, credentials is not None)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health, servicer, bound)


async def serve_worker(settings: WorkerSettings,
                       make_servicer: Callable[[WorkerRuntime], WorkerServicerBase]) -> int:
    """Build the runtime, serve until SIGINT/SIGTERM (or the engine loop dies), stop gracefully.
    Returns the process exit code."""
    progress = StartupProgress()
    bind = f"{settings.host}:{settings.bind_port}"
    if settings.bind_port and port_in_use(settings.host, settings.bind_port):
        # now, not after loading the weights and the warm-up (minutes on a large model)
        log.error("cannot serve on %s: the port is already in use (another worker or server)",
                  bind)
        return 2
    rt = build_runtime(settings, progress)  # blocking on purpose: nothing else runs yet
    try:
        running = await start_server(rt, make_servicer, settings.host, settings.bind_port)
    except (RuntimeError, AccessError) as exc:
        rt.close()
        log.error("cannot serve on %s: %s", bind, exc)
        return 2
    stopping = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio_loop.add_signal_handler(sig, stopping.set)
    role = running.servicer.role
    progress(f"serving on {settings.address}")
    log.info("%s worker %s serving on %s (model %s, kv store %s)", role, settings.name, bind,
             rt.model_name, rt.kv_store.public_url if rt.kv_store else "none")
    print(f"bulkhead {role} worker ready on {settings.address}", flush=True)
    publisher = registration_publisher(settings, role, running.servicer.info)
    if publisher is not None:
        await publisher.start()  # Redis down only logs: the worker serves either way
    assert rt.loop.failed is not None
    waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(rt.loop.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    failed = rt.loop.failed.is_set()
    if failed:
        log.error("engine loop failed; shutting down: %s", rt.loop.failure)
    else:
        log.info("shutting down: running RPCs get %.0f s", settings.grace_s)
    if publisher is not None:
        await publisher.stop()  # routers stop sending new requests before the grace period
    await running.stop(0 if failed else settings.grace_s)
    rt.close()
    with contextlib.suppress(Exception):
        for sig in (signal.SIGINT, signal.SIGTERM):
            aio_loop.remove_signal_handler(sig)
    return 1 if failed else 0


def run_worker(role: str, argv: Sequence[str] | None,
               make_servicer: Callable[[WorkerRuntime], WorkerServicerBase]) -> int:
    """Entry point shared by ``bulkhead prefill`` and ``bulkhead decode``."""
    import sys

    import uvloop

    from common.settings import SettingsError, load_worker_settings

    try:
        settings = load_worker_settings(role, sys.argv[1:] if argv is None else argv)
    except SettingsError as exc:
        print(f"bulkhead {role}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    try:
        return uvloop.run(serve_worker(settings, make_servicer))
    except Exception as exc:  # start-up errors (plan does not fit, bad checkpoint, store down)
        log.debug("start-up failed", exc_info=True)
        print(f"bulkhead {role}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
