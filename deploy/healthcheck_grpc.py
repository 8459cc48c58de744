"""Container health check of a worker: exit 0 iff grpc.health.v1 says SERVING.

Usage: python healthcheck_grpc.py HOST:PORT [SERVICE].  Must never block longer than its timeout and
never import torch (it runs every few seconds next to the worker).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: healthcheck_grpc.py HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    service = argv[1] if len(argv) == 2 else ""
    with grpc.insecure_channel(argv[0]) as channel:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
