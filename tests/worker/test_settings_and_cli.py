"""Worker settings (defaults < YAML < env < flags), the `bulkhead` entry point, and the process
supervision `bulkhead up` relies on (no orphans)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.settings import SettingsError, WorkerSettings, load_worker_settings, settings_table
from launch.cli import SUBCOMMANDS
from launch.cli import main as cli_main
from launch.launcher import ProcessGroup, spawn, tcp_open
from tests.helpers.startup_budget import startup_budget_s
from worker.worker_config import StoreSettings, WorkerConfig


def test_sources_override_in_order(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("router:\n  port: 9\nworker:\n  max_context: 7\n  num_threads: 2\n"
                   "decode:\n  max_context: 1000\n  max_batch: 3\n  block_size: 32\n"
                   "prefill:\n  max_context: 9\n")
    env = {"BULKHEAD_MAX_BATCH": "5", "BULKHEAD_BLOCK_SIZE": "8", "BULKHEAD_PORT": "7000"}
    s = load_worker_settings("decode", ["--config", str(cfg), "--block-size", "64",
                                        "--no-enable-prefix-cache"], env=env)
    assert (s.role, s.max_context, s.max_batch, s.block_size) == ("decode", "1000", 5, 64)
    assert s.enable_prefix_cache is False and s.bind_port == 7000 and s.num_threads == 2
    assert s.address == "127.0.0.1:7000"
    default = load_worker_settings("decode", [], env={})
    assert default.bind_port == 50052 and default.max_context == "auto"
    assert StoreSettings.from_settings(default) is None
    engine = WorkerConfig.from_settings(dataclasses.replace(default, model="/m")).engine
    assert engine.num_blocks is None and engine.device_memory_bytes is None  # 0 = derived
    # 0: from the model when it is loaded (engine/config_resolve.py)
    assert (engine.model, engine.max_context, engine.block_size) == ("/m", 0, 0)
    store = StoreSettings.from_settings(load_worker_settings(
        "decode", ["--kv-store-url", "redis://h:1", "--kv-ttl-s", "5"], env={}))
    # chunk 0: chosen from the model's KV layout at start-up (worker/kv_store_config.py)
    assert store is not None and (store.url, store.ttl_s, store.chunk_size) == ("redis://h:1",
                                                                                5, 0)
    assert "redis://h:1" not in repr(store)  # the URL may hold a password


@pytest.mark.parametrize("argv, env, needle", [
    ([], {}, "kv_store_url"),  # prefill without a store
    (["--kv-store-url", "http://x:1"], {}, "kv_store_url"),
    (["--kv-store-url", "redis://h:1", "--max-batch", "zero"], {}, "max_batch"),
    (["--kv-store-url", "redis://h:1"], {"BULKHEAD_MAX_CONTEXT": "0"}, "max_context"),
    (["--kv-store-url", "redis://h:1", "--dtype", "int8"], {}, "dtype"),
    (["--kv-store-url", "redis://h:1", "--advertise-address", "nohost"], {}, "advertise_address"),
])
def test_bad_settings_name_the_field(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load_worker_settings("prefill", argv, env=env)


@pytest.mark.parametrize("field, value, message", [
    ("max_batch", 0, "max_batch: 0 must be >= 1"),
    ("tensor_parallel_size", -1, "tensor_parallel_size: -1 must be >= 1"),
    ("memory_utilization", 0.0, "memory_utilization: 0.0 must be > 0"),
    ("heartbeat_ttl_s", -2.0, "heartbeat_ttl_s: -2.0 must be > 0"),
    ("num_blocks", -1, "num_blocks: -1 must be >= 0"),
    ("kv_ttl_s", -5, "kv_ttl_s: -5 must be >= 0"),
    ("role", "router", "role: 'router' is not one of prefill, decode"),
    ("decode_loop", "fast", "decode_loop: 'fast' is not one of auto, fused, unfused"),
    ("decode_lanes", 3, "decode_lanes: 3 is not one of 1, 2"),
])
def test_each_field_keeps_the_limit_its_metadata_names(field: str, value: object,
                                                        message: str) -> None:
    with pytest.raises(SettingsError) as info:
        WorkerSettings(**{field: value})
    assert str(info.value) == message
    WorkerSettings(**{field: WorkerSettings.__dataclass_fields__[field].default})  # default: fine


def test_yaml_unknown_key_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("worker:\n  max_contxt: 5\n")
    with pytest.raises(SettingsError, match="max_contxt"):
        load_worker_settings("decode", ["--config", str(cfg)], env={})


def test_every_setting_is_documented() -> None:
    table = settings_table()
    for name in WorkerSettings.__dataclass_fields__:
        if name != "role":
            assert f"`BULKHEAD_{name.upper()}`" in table


def test_cli_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    assert "up" in capsys.readouterr().out
    assert cli_main(["nope"]) == 2
    assert cli_main([]) == 2
    assert set(SUBCOMMANDS) == {"up", "router", "prefill", "decode", "plan", "bench",
                                "export-tokenizer"}


def test_launcher_modules_stay_torch_free() -> None:
    code = ("import sys, launch.cli, launch.up, launch.launcher, common.settings; "
            "assert 'torch' not in sys.modules and 'lmcache' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_stop_leaves_no_orphans(tmp_path: Path) -> None:
    # A child that starts a grandchild: stopping the group must end both.
    script = "sleep 120 & echo $! > grandchild.pid; wait"
    with ProcessGroup() as group:
        proc = group.add(spawn("sh", ["sh", "-c", script], log_dir=tmp_path,
                               cwd=str(tmp_path)))
        pid_file = tmp_path / "grandchild.pid"
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while _running(grandchild):
        assert time.monotonic() < deadline, f"grandchild {grandchild} still running"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap, or never reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_tcp_open_on_a_closed_port() -> None:
    from launch.launcher import free_port

    assert not tcp_open("127.0.0.1", free_port())


def test_kv_server_falls_back_to_lmcache_without_redis(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from launch import launcher

    monkeypatch.setattr(launcher, "redis_server_path", lambda: None)
    proc, url = launcher.start_kv_server(log_dir=tmp_path)
    try:
        assert url.startswith("lm://127.0.0.1:")
        host, port = url.removeprefix("lm://").split(":")
        assert tcp_open(host, int(port))
    finally:
        proc.stop(grace_s=5.0)
    assert not proc.alive()


def test_worker_process_stops_gracefully_on_sigterm(tiny_llama: Path, tmp_path: Path) -> None:
    import signal

    from common.worker_env import WORKER_ENV
    from launch.health import grpc_serving
    from launch.launcher import free_port, wait_until

    port = free_port()
    argv = [sys.executable, "-m", "launch.cli", "decode", "--model", str(tiny_llama),
            "--port", str(port), "--device", "cpu", "--max-context", "128", "--max-batch", "2",
            "--num-threads", "1", "--grace-s", "5"]
    proc = spawn("decode", argv, env=WORKER_ENV, log_dir=tmp_path)
    try:
        wait_until(proc, lambda: grpc_serving(f"127.0.0.1:{port}"), startup_budget_s(2 / 3),
                   "serving")
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0, proc.log_tail()
        assert "shutting down" in proc.log_tail()
        assert not tcp_open("127.0.0.1", port)
    finally:
        proc.stop(grace_s=1.0)


def test_worker_with_an_impossible_plan_exits_with_the_reason(tiny_llama: Path,
                                                              tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "launch.cli", "decode", "--model", str(tiny_llama),
            "--device", "cpu", "--max-context", "4096", "--device-memory-gb", "0.001"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 1
    assert "memory plan does not fit" in proc.stderr


@pytest.mark.parametrize("text, router_port, decode_context", [
    ("decode:\n  max_context: 64\n", 8000, "64"),  # worker sections only: the router's defaults
    ("router:\n  port: 5000\ndecode: {max_context: 64}\n", 5000, "64"),
    ("worker:\n  max_context: 32\ndecode:\n  max_context: 64\n", 8000, "64"),  # role wins
    ("log_level: debug\n", 8000, "auto"),  # flat: every process reads it
])
def test_one_deployment_yaml_serves_router_and_workers(
        tmp_path: Path, text: str, router_port: int, decode_context: str) -> None:
    from router.settings import load_settings

    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    router = load_settings(["--config", str(cfg)], {})
    decode = load_worker_settings("decode", ["--config", str(cfg)], {})
    assert router.port == router_port and decode.max_context == decode_context
    if "log_level" in text:
        assert router.log_level == decode.log_level == "debug"
