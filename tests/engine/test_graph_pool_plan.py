"""The decode graphs' pool term counts the capture stream's cuBLAS workspaces.

On the H200 (2026-12-03) Llama-3-8B at max_batch 20 captured a 58.0 MiB pool against 51.9 MiB
planned: cuBLAS keeps a workspace per (handle, stream) and the graphs are captured on a stream of
their own, so its workspace (32 MiB on Hopper) is allocated inside the pool at the first capture.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.memory_planner import make_plan
from engine.model_config import ModelConfig

DATA = Path(__file__).resolve().parents[1] / "data"


def _plan(library_bytes: int, device: str = "cuda"):
    cfg = ModelConfig.from_json_file(DATA / "qwen3-8b-config.json")
    ec = EngineConfig(model="unused", device=device, max_context=32768, chunk_tokens=2048,
                      max_batch=20, dtype="bfloat16" if device == "cuda" else "float32")
    return make_plan(cfg, ec, 140 << 30, 16 << 30, library_bytes=library_bytes)


def test_graph_pool_holds_the_capture_streams_library_workspaces() -> None:
    without, with_ws = _plan(0), _plan(32 << 20)
    assert with_ws.term("cuda_graph_pool") - without.term("cuda_graph_pool") == 32 << 20
    assert with_ws.term("library_workspaces") == 32 << 20
    row = next(t for t in with_ws.to_json()["terms"] if t["name"] == "cuda_graph_pool")
    assert "capture stream's cuBLAS workspaces (33,554,432 B" in row["formula"]


def test_no_pool_and_no_workspace_without_graphs() -> None:
    names = {t["name"] for t in _plan(0, device="cpu").to_json()["terms"]}
    assert "cuda_graph_pool" not in names and "library_workspaces" not in names
