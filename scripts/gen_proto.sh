#!/usr/bin/env bash
# Regenerates proto/bulkhead_pb2*.py from proto/bulkhead.proto.
# The generated files are committed; tests/test_proto_stubs.py checks they match.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/bulkhead.proto
