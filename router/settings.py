"""The router's settings: one frozen dataclass built once at the entry point.

Sources, later ones win: defaults < YAML file (``--config`` / ``BULKHEAD_CONFIG``; its ``router:``
section, or the whole file when it has no sections) < environment variables ``BULKHEAD_<FIELD>``
< command-line flags; the loader is the workers' too (common/settings_loader.py). Every field is
documented below; the README and ``bulkhead router --help`` are generated from the same
descriptions.

This module must never import torch, ``engine/`` or anything that talks to the network.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common import settings_loader
from common.settings_loader import ENV_PREFIX, SettingsError
from common.settings_loader import doc as _doc
from common.worker_registry import url_problem
from router.tool_calls import PARSERS

__all__ = ["ENV_PREFIX", "RouterSettings", "SettingsError", "build_parser", "load_settings",
           "settings_table"]


@dataclass(frozen=True)
class RouterSettings:
    """Settings of the OpenAI-compatible router.  Env var: ``BULKHEAD_`` + the upper-case name."""

    model: str = field(default="", metadata=_doc(
        "Path of the model (HF folder or .gguf file); the tokenizer and chat template load from it."))
    served_model_name: str = field(default="", metadata=_doc(
        "Name clients use in the `model` field; default: the model path's stem."))
    host: str = field(default="127.0.0.1", metadata=_doc("Address the HTTP server binds."))
    port: int = field(default=8000, metadata=_doc("Port the HTTP server binds."))
    prefill_workers: tuple[str, ...] = field(default=(), metadata=_doc(
        "host:port of each prefill worker (env: comma-separated list)."))
    decode_workers: tuple[str, ...] = field(default=(), metadata=_doc(
        "host:port of each decode worker (env: comma-separated list)."))
    registry_url: str = field(default="", repr=False, metadata=_doc(
        "Redis worker registry, redis://[:password@]host:port[/db] or rediss://: workers that "
        "register there are discovered, incompatible ones refused, expired ones dropped; merged "
        "with the static worker lists; '' = static lists only."))
    split_threshold_tokens: int = field(default=256, metadata=_doc(
        "Uncached prompt tokens from which a request is prefilled on a prefill worker."))
    poll_interval_s: float = field(default=2.0, metadata=_doc(
        "Seconds between GetInfo polls of every worker."))
    stall_timeout_s: float = field(default=120.0, metadata=_doc(
        "A worker with work whose engine progress counters did not advance for this long is "
        "not routed to (a slow GetInfo alone is not a dead worker)."))
    info_timeout_s: float = field(default=2.0, metadata=_doc(
        "Deadline of the small RPCs: GetInfo, Lookup, Abort."))
    prefill_timeout_s: float = field(default=300.0, metadata=_doc(
        "Deadline of one Prefill RPC (prompt computed and KV stored)."))
    first_token_timeout_s: float = field(default=120.0, metadata=_doc(
        "Longest wait for the first token of a Generate stream."))
    stream_idle_timeout_s: float = field(default=60.0, metadata=_doc(
        "Longest wait between two chunks of a Generate stream."))
    sse_keepalive_s: float = field(default=5.0, metadata=_doc(
        "A stream whose first token takes longer opens anyway and sends an SSE comment "
        "(`: keep-alive`) this often until it comes, so proxies do not cut a long prefill."))
    request_timeout_s: float = field(default=0.0, metadata=_doc(
        "Whole-request deadline sent to the workers (deadline_unix_s); 0 = none."))
    retry_after_s: int = field(default=1, metadata=_doc(
        "Value of the Retry-After header on 429 and 503 answers."))
    max_inflight_requests: int = field(default=0, metadata=_doc(
        "Requests the router serves at once; past it new ones get 429 (0 = no bound)."))
    max_body_bytes: int = field(default=8 * 1024 * 1024, metadata=_doc(
        "Largest request body accepted, in bytes; a larger one is answered 413 before it is "
        "read or parsed (Content-Length, or counted as it arrives when chunked)."))
    max_header_bytes: int = field(default=64 * 1024, metadata=_doc(
        "Largest request head (request line and headers) accepted, in bytes; past it the "
        "HTTP server answers 431 without buffering more."))
    parse_off_loop_bytes: int = field(default=256 * 1024, metadata=_doc(
        "A JSON body of at least this many bytes (and 10,000 values) is parsed and validated in "
        "a child process, off the event loop (json.loads and validation hold the GIL for "
        "seconds on millions of values); 0 = always on the loop."))
    max_concurrent_tokenizations: int = field(default=2, metadata=_doc(
        "Prompts tokenized at once (each off the event loop, without the GIL); more wait."))
    max_n: int = field(default=16, metadata=_doc("Largest `n` (choices per request) accepted."))
    max_stop_strings: int = field(default=16, metadata=_doc("Most `stop` strings per request."))
    max_prompts: int = field(default=64, metadata=_doc(
        "Most prompts in one /v1/completions request (a list of prompts)."))
    chat_template: str = field(default="", metadata=_doc(
        "A jinja chat template file used instead of the model's own (vLLM's --chat-template); "
        "'' = the model's."))
    tool_call_parser: str = field(default="", metadata=_doc(
        "The tool-call syntax tool_choice auto reads (vLLM's names: hermes, qwen3, llama3_json, "
        "llama4_json, deepseek_v4); '' = the one the chat template teaches, if any. Named and "
        "required tool_choice work without one."))
    log_level: str = field(default="info", metadata=_doc("Python log level of the router."))
    quarantine_ttl_s: float = field(default=600.0, metadata=_doc(
        "Seconds a request blamed for a worker's death (the only request running on it, or "
        "running at two worker deaths within this window) is refused (500) before it may be "
        "tried again."))
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata=_doc(
        "Keys accepted as `Authorization: Bearer <key>` on /v1 (env: comma-separated list); "
        "none = open, with a warning at start-up. Never logged."))
    internal_token: str = field(default="", repr=False, metadata=_doc(
        "Shared token sent as `authorization: Bearer <token>` on every worker call; must "
        "equal the workers' internal_token. Never logged."))
    worker_tls_ca_file: str = field(default="", metadata=_doc(
        "PEM CA bundle that signed the workers' TLS certificates; set = TLS to every worker "
        "(the certificate must name the host in the worker address)."))

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise SettingsError(f"port: {self.port} is not in 1..65535")
        if self.split_threshold_tokens < 1:
            raise SettingsError(f"split_threshold_tokens: {self.split_threshold_tokens} must be >= 1")
        for name in ("poll_interval_s", "stall_timeout_s", "info_timeout_s", "prefill_timeout_s",
                     "first_token_timeout_s", "stream_idle_timeout_s", "sse_keepalive_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name}: {getattr(self, name)} must be > 0")
        if self.request_timeout_s < 0:
            raise SettingsError(f"request_timeout_s: {self.request_timeout_s} must be >= 0")
        if self.parse_off_loop_bytes < 0:
            raise SettingsError(f"parse_off_loop_bytes: {self.parse_off_loop_bytes} must be >= 0")
        if self.max_inflight_requests < 0:
            raise SettingsError(f"max_inflight_requests: {self.max_inflight_requests} must be >= 0")
        if self.retry_after_s < 0:
            raise SettingsError(f"retry_after_s: {self.retry_after_s} must be >= 0")
        for name in ("max_n", "max_stop_strings", "max_prompts", "max_body_bytes",
                     "max_header_bytes", "max_concurrent_tokenizations"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.tool_call_parser and self.tool_call_parser not in PARSERS:
            raise SettingsError(f"tool_call_parser: {self.tool_call_parser!r} is not one of "
                                f"{', '.join(PARSERS)}")
        if self.registry_url and url_problem(self.registry_url):
            raise SettingsError(f"registry_url: {url_problem(self.registry_url)}")
        for name in ("prefill_workers", "decode_workers"):
            for addr in getattr(self, name):
                host, sep, port = addr.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise SettingsError(f"{name}: {addr!r} is not host:port")

    @property
    def model_name(self) -> str:
        """The name served on /v1/models and accepted in requests."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).stem if self.model else "bulkhead"


def build_parser() -> argparse.ArgumentParser:
    """The `bulkhead router` flags; every flag defaults to None so unset flags do not override.
    ``--prefill`` / ``--decode`` are short for the worker lists (repeat or comma-separate)."""
    return settings_loader.build_parser(
        RouterSettings, "bulkhead router", "OpenAI-compatible router in front of Bulkhead workers.",
        aliases={"prefill_workers": "--prefill", "decode_workers": "--decode"})


def load_settings(argv: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None) -> RouterSettings:
    """Build the settings from defaults, YAML (its ``router:`` section), environment and flags."""
    return settings_loader.load(RouterSettings, build_parser(), argv, env, ("router",), "router")


def settings_table() -> str:
    """Markdown table of every router setting (for the README)."""
    return settings_loader.settings_table(RouterSettings)
