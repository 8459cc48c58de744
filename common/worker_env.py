"""The environment every worker process starts with, defined once for all who start one.

LMCache names a chunk by Python's ``hash()`` of its tokens, so a prefill and a decode worker only
find each other's KV when both run with the same ``PYTHONHASHSEED``; it must be set before the
interpreter starts, so a launcher passes it in the child's environment. The rest quiets LMCache
(no usage reporting, warnings only) and the tokenizers thread pool. Nothing here reads or sets
``os.environ``: callers merge it into the environment they hand a child.
"""

from __future__ import annotations

from types import MappingProxyType

WORKER_ENV = MappingProxyType({
    "PYTHONHASHSEED": "0",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_LOG_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
})
