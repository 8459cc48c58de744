"""Router settings: defaults < YAML < env < flags, and errors that name the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.settings import RouterSettings, SettingsError, build_parser, load_settings


def test_precedence_yaml_env_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("router:\n  port: 9000\n  split_threshold_tokens: 100\n"
                   "  decode_workers: [a:1, b:2]\n  model: /m\n")
    env = {"BULKHEAD_CONFIG": str(cfg), "BULKHEAD_SPLIT_THRESHOLD_TOKENS": "300",
           "BULKHEAD_PREFILL_WORKERS": "p:1, p:2"}
    s = load_settings(["--port", "9100", "--decode", "c:3", "--decode", "d:4"], env)
    assert s.port == 9100                              # flag over YAML
    assert s.split_threshold_tokens == 300             # env over YAML
    assert s.prefill_workers == ("p:1", "p:2")         # env comma list
    assert s.decode_workers == ("c:3", "d:4")          # repeated flag
    assert s.model == "/m" and s.model_name == "m"     # YAML, name from the path stem
    assert load_settings([], {}) == RouterSettings()


@pytest.mark.parametrize(("argv", "env", "field"), [
    (["--port", "0"], {}, "port"),
    ([], {"BULKHEAD_SPLIT_THRESHOLD_TOKENS": "zero"}, "split_threshold_tokens"),
    (["--decode", "nohost"], {}, "decode_workers"),
    ([], {"BULKHEAD_STREAM_IDLE_TIMEOUT_S": "-1"}, "stream_idle_timeout_s"),
])
def test_bad_values_name_the_setting(argv: list[str], env: dict[str, str], field: str) -> None:
    with pytest.raises(SettingsError, match=field):
        load_settings(argv, env)


def test_unknown_yaml_key_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "r.yaml"
    cfg.write_text("prot: 1\n")
    with pytest.raises(SettingsError, match="prot"):
        load_settings(["--config", str(cfg)], {})


def test_every_setting_is_documented() -> None:
    text = build_parser().format_help()
    for name in RouterSettings.__dataclass_fields__:
        assert f"BULKHEAD_{name.upper()}" in text


def test_router_never_imports_torch() -> None:
    code = ("import router.app, router.server, bench.load, sys; "
            "assert 'torch' not in sys.modules and 'engine' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2],
                   timeout=60)
