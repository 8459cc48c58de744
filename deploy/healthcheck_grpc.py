"""Container health check of a worker: exit 0 iff grpc.health.v1 says SERVING.

Usage: python healthcheck_grpc.py HOST:PORT [SERVICE].  With BULKHEAD_WORKER_TLS_CA_FILE set (the
CA that signed the worker's certificate, the router's setting of the same name) it speaks TLS;
BULKHEAD_HEALTHCHECK_SERVER_NAME overrides the name checked against the certificate (default: the
host).  Must never block longer than its timeout and never import torch (it runs every few seconds
next to the worker).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: healthcheck_grpc.py HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    service = argv[1] if len(argv) == 2 else ""
    with _channel(argv[0]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            print(f"{argv[0]}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{argv[0]}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}",
              file=sys.stderr)
    return 0 if serving else 1


def _channel(address: str) -> grpc.Channel:
    ca_file = os.environ.get("BULKHEAD_WORKER_TLS_CA_FILE", "")
    if not ca_file:
        return grpc.insecure_channel(address)
    with open(ca_file, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    name = os.environ.get("BULKHEAD_HEALTHCHECK_SERVER_NAME", "")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, creds, options=options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
