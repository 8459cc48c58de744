"""Whether a child of ``bulkhead up`` is serving: grpc.health.v1 of a worker, /health of the
router (ours, told apart from another server's on the port by its instance id).

Probes only: they never start, stop or restart anything (launch/supervisor.py decides that).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from email.message import Message

from common.router_identity import INSTANCE_HEADER


def grpc_serving(address: str, timeout_s: float = 1.0) -> bool:
    """True when ``address`` answers grpc.health.v1 Check with SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _ours(headers: Message, instance: str) -> bool:
    """Whether an answer comes from the router started with ``instance`` (common/router_identity;
    "" accepts any)."""
    return not instance or headers.get(INSTANCE_HEADER, "") == instance


def router_ready(url: str, num_workers: int, instance: str = "") -> bool:
    """True when the router's /health is 200 and it sees ``num_workers`` healthy workers.
    ``instance``: the id our router was started with; an answer without it is another
    server's on the same port, not ours."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
            body = json.loads(resp.read())
            if not _ours(resp.headers, instance):
                return False
    except (urllib.error.URLError, OSError, ValueError):
        return False
    workers = body.get("workers", {})
    return sum(1 for w in workers.values() if w.get("healthy")) >= num_workers


def http_answers(url: str, instance: str = "") -> bool:
    """True when our router answers /health at all (200, or 503 while it has no worker)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
            return _ours(resp.headers, instance)
    except urllib.error.HTTPError as err:
        return _ours(err.headers, instance)
    except (urllib.error.URLError, OSError):
        return False


def served_model_name(url: str) -> str:
    """The model id the router serves (first entry of /v1/models)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=5.0) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])

