"""The router's side of the bulkhead.v1 edge: the one place where router dataclasses become
proto messages and back. ``worker_client.py`` calls it; nothing else in the router builds or
reads a Prefill/Generate message, so dispatch and the choice runner deal in plain data.

It never touches the network (the client does) and never imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from proto import bulkhead_pb2 as pb


@dataclass(frozen=True)
class LogitShaping:
    """What reshapes the logits before sampling: penalties, biases, floors.  One value travels
    from the validated request (router/job.py) into every choice's Sampling unchanged."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0


@dataclass(frozen=True)
class Sampling:
    """How one choice samples; the worker checks the ranges (InvalidRequest -> 400)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # None: the worker's own seed
    shaping: LogitShaping = LogitShaping()
    logprobs: int | None = None  # None: none; k: each token's logprob and the top k
    grammar_kind: str = ""       # constrained decoding (worker/grammar_cache.py), "" = none
    grammar_spec: str = ""
    # None: none; k: each prompt token's logprob and top k (completions echo with logprobs);
    # with it max_tokens may be 0
    prompt_logprobs: int | None = None
    # speculative decoding: most draft tokens per step (None: the worker's setting, 0: none)
    num_speculative_tokens: int | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's logprob and the top alternatives (router/logprobs_format.py)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class WorkItem:
    """One choice as the workers see it: the same for Prefill and Generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    deadline_unix_s: float = 0.0  # 0 = no deadline


@dataclass(frozen=True)
class KVHandle:
    """Where a prefill left the prompt's KV: how many tokens the store shows, in which layout."""

    num_tokens_stored: int
    kv_layout_fingerprint: str
    store_url: str = field(repr=False)


@dataclass(frozen=True)
class Prefilled:
    """A finished Prefill: the first token and the KV handed over with it."""

    first_token_id: int | None  # None: max_tokens was 0, the prompt was only scored
    finish_reason: str | None  # set when the first token already ends the choice
    num_cached_tokens: int
    num_computed_tokens: int
    kv: KVHandle
    first_token_logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # entry i scores prompt token i + 1
    queue_time_s: float = 0.0     # on the prefill worker: arrival to admission
    prefill_time_s: float = 0.0   # admission to the first token


@dataclass(frozen=True)
class Usage:
    """A finished Generate's prompt accounting (the decode worker's view)."""

    cached_tokens: int
    loaded_kv_tokens: int
    recomputed_tokens: int
    queue_time_s: float = 0.0     # on the decode worker: arrival to admission
    prefill_time_s: float = 0.0   # admission to the first token it computed


@dataclass(frozen=True)
class Chunk:
    """The tokens of one engine step; the last chunk carries the finish reason and usage."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # entry i scores prompt token i + 1


def sampling_to_proto(s: Sampling) -> pb.SamplingParams:
    sh = s.shaping
    msg = pb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                            top_k=s.top_k, stop_token_ids=list(s.stop_token_ids),
                            ignore_eos=s.ignore_eos, presence_penalty=sh.presence_penalty,
                            frequency_penalty=sh.frequency_penalty,
                            repetition_penalty=sh.repetition_penalty,
                            logit_bias=dict(sh.logit_bias), min_p=sh.min_p,
                            min_tokens=sh.min_tokens)
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.grammar_kind:
        msg.grammar_kind, msg.grammar_spec = s.grammar_kind, s.grammar_spec
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.num_speculative_tokens is not None:
        msg.num_speculative_tokens = s.num_speculative_tokens
    return msg


def logprobs_from_proto(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(int(msg.token_id), float(msg.logprob), tuple(int(t) for t in msg.top_ids),
                         tuple(float(v) for v in msg.top_logprobs))


def prefill_request(item: WorkItem) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=item.request_id,
                             prompt_token_ids=list(item.prompt_token_ids),
                             sampling=sampling_to_proto(item.sampling),
                             deadline_unix_s=item.deadline_unix_s)


def generate_request(item: WorkItem, after: Prefilled | None = None) -> pb.GenerateRequest:
    """A Generate of ``item``; ``after``: the prefill it continues (the stream then starts
    after ``after.first_token_id``)."""
    sampling = item.sampling
    if after is not None:  # the prefill worker scored the prompt already
        sampling = dataclasses.replace(sampling, prompt_logprobs=None)
    msg = pb.GenerateRequest(request_id=item.request_id,
                             prompt_token_ids=list(item.prompt_token_ids),
                             sampling=sampling_to_proto(sampling),
                             deadline_unix_s=item.deadline_unix_s)
    if after is not None:
        assert after.first_token_id is not None, "a scoring-only prefill has nothing to continue"
        msg.has_prefill = True
        msg.first_token_id = after.first_token_id
        msg.kv.CopyFrom(pb.KVHandle(num_tokens_stored=after.kv.num_tokens_stored,
                                    kv_layout_fingerprint=after.kv.kv_layout_fingerprint,
                                    store_url=after.kv.store_url))
    return msg


def prefilled_from_proto(msg: pb.PrefillResponse) -> Prefilled:
    kv = KVHandle(int(msg.kv.num_tokens_stored), msg.kv.kv_layout_fingerprint, msg.kv.store_url)
    first_lp = (logprobs_from_proto(msg.first_token_logprobs)
                if msg.HasField("first_token_logprobs") else None)
    first = int(msg.first_token_id) if msg.HasField("first_token_id") else None
    return Prefilled(first, msg.finish_reason or None,
                     int(msg.num_cached_tokens), int(msg.num_computed_tokens), kv, first_lp,
                     tuple(logprobs_from_proto(lp) for lp in msg.prompt_logprobs),
                     float(msg.queue_time_s), float(msg.prefill_time_s))


def chunk_from_proto(msg: pb.GenerateChunk) -> Chunk:
    usage = None
    if msg.HasField("usage"):
        usage = Usage(int(msg.usage.cached_tokens), int(msg.usage.loaded_kv_tokens),
                      int(msg.usage.recomputed_tokens), float(msg.usage.queue_time_s),
                      float(msg.usage.prefill_time_s))
    return Chunk(tuple(int(t) for t in msg.token_ids), msg.finish_reason or None, usage,
                 tuple(logprobs_from_proto(lp) for lp in msg.logprobs),
                 tuple(logprobs_from_proto(lp) for lp in msg.prompt_logprobs))
