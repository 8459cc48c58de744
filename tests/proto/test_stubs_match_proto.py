"""The committed gRPC stubs are exactly what scripts/gen_proto.sh generates from the .proto, so
the wire contract and the code that speaks it cannot drift apart."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUBS = ("bulkhead_pb2.py", "bulkhead_pb2.pyi", "bulkhead_pb2_grpc.py")


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    (tmp_path / "proto").mkdir()
    shutil.copy(REPO / "proto" / "bulkhead.proto", tmp_path / "proto" / "bulkhead.proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--pyi_out=.", "--grpc_python_out=.", "proto/bulkhead.proto"],
                   cwd=tmp_path, check=True)
    for name in STUBS:
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (REPO / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run scripts/gen_proto.sh"
