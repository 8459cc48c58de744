"""kernels._launch_configs (the small decode kernels' warps and tiles) and the bench that sweeps
them, lab.bench.deepseek_v4.decode_kernel_configs, on the CPU (interpreter, tiny shapes): every
setting's outputs equal the default's (window tiles narrower than the window and than the
channels included), overrides nest and unwind, bad settings are refused with the knob named."""

from __future__ import annotations

import json

import pytest

from kernels._launch_configs import KNOBS, launch_config, overridden
from lab.bench.deepseek_v4 import decode_kernel_configs as dkc


def test_overrides_nest_and_unwind() -> None:
    base = launch_config("compress_window", 1)
    with overridden("compress_window", BLOCK_C=16):
        with overridden("compress_window", num_warps=1):
            assert launch_config("compress_window", 1) == {**base, "BLOCK_C": 16, "num_warps": 1}
        assert launch_config("compress_window", 8) == {**base, "BLOCK_C": 16}
    assert launch_config("compress_window", 1) == base
    with pytest.raises(RuntimeError), overridden("moe_route", num_warps=2):
        raise RuntimeError("unwinds on error too")
    assert launch_config("moe_route", 1) == {"num_warps": 1}


@pytest.mark.parametrize("kernel,settings,match", [
    ("moe_route", dict(num_warps=3), "power of two"),
    ("compress_window", dict(BLOCK_C=1), "BLOCK_C"),
    ("rope_norm", dict(BLOCK_C=16), "takes"),
])
def test_bad_settings_are_refused(kernel, settings, match) -> None:
    with pytest.raises(ValueError, match=match), overridden(kernel, **settings):
        pass
    with pytest.raises(KeyError, match="no launch settings"):
        launch_config("nope", 1)


def test_every_kernel_has_defaults() -> None:
    for kernel, knobs in KNOBS.items():
        for rows in (1, 8, 32):
            for size in (0, 8, 128, 1024):
                cfg = launch_config(kernel, rows, size)
                assert set(cfg) == set(knobs)
                with overridden(kernel, **cfg):  # every default is a valid setting
                    pass
    # the measured choices: the compressor's tiles follow its window, rope_norm its width
    assert launch_config("compress_window", 1, 128)["BLOCK_C"] == 32
    assert launch_config("compress_window", 1, 8)["num_warps"] == 1
    assert launch_config("rope_norm", 1, 512)["num_warps"] == 1
    assert launch_config("rope_norm", 1, 1024)["num_warps"] == 4


def test_sweep_outputs_agree(interpret, tmp_path) -> None:
    out = tmp_path / "c.json"
    # window loops of 4 rows over 8- and 4-row windows, 16-channel slices of 24 and 20
    rc = dkc.main(["--settings", "compress=16,4,1,1;64,2,4,4;32,128,2,2",
                   "--settings", "moe_route=1;8", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert {r["sweep"] for r in rows} == set(dkc.SWEEPS)
    # exact but where the window loop's tiles reorder its fp32 sums
    assert all(r["max_diff"] <= (1e-5 if r["sweep"] == "compress" else 0.0) for r in rows), rows
    assert any(r["max_diff"] for r in rows if r["sweep"] == "compress")  # the tiles did change
    windows = {r["launch"]["compress_window"]["BLOCK_W"] for r in rows
               if r["sweep"] == "compress" and r["setting"] != "default"}
    assert {4, 2, 128} <= windows
    assert {r["batch"] for r in rows} == {1, 3}


def test_sweep_refuses_bad_settings() -> None:
    with pytest.raises(SystemExit):
        dkc.main(["--settings", "compress=16,4"])
    with pytest.raises(SystemExit):
        dkc.main(["--kernels", "moe_route", "--settings", "compress=default"])
    with pytest.raises(SystemExit):
        dkc.main(["--settings", "moe_route=3"])


def test_environment_settings(monkeypatch) -> None:
    base = launch_config("compress_window", 1)
    monkeypatch.setenv("BULKHEAD_LAUNCH", "compress_window:BLOCK_C=16,num_warps=2; moe_route:num_warps=2")
    assert launch_config("compress_window", 1) == {**base, "BLOCK_C": 16, "num_warps": 2}
    assert launch_config("moe_route", 1) == {"num_warps": 2}
    with overridden("moe_route", num_warps=8):  # a bench's override beats the environment
        assert launch_config("moe_route", 1) == {"num_warps": 8}
    for bad, match in (("moe_route:num_warps=3", "power of two"), ("route:num_warps=1", "route"),
                       ("moe_route", "kernel:knob"), ("moe_route:num_warps=x", "knob=integer"),
                       ("rope_norm:BLOCK_C=16", "takes")):
        monkeypatch.setenv("BULKHEAD_LAUNCH", bad)
        with pytest.raises((ValueError, KeyError), match=match):
            launch_config("moe_route", 1)


def test_best_settings_as_environment() -> None:
    def row(sweep, case, setting, us, launch, batch=1):
        return dict(sweep=sweep, case=case, batch=batch, setting=setting, us=us, launch=launch)

    cw = {"compress_window": {"BLOCK_C": 16, "BLOCK_W": 128, "num_warps": 2},
          "compress_entry": {"num_warps": 1}}
    rows = [row("compress", "a", "default", 5.0, {}), row("compress", "b", "default", 3.0, {}),
            row("compress", "a", "16,128,2,1", 3.0, cw), row("compress", "b", "16,128,2,1", 4.0, cw),
            row("moe_route", "r", "default", 2.0, {}), row("moe_route", "r", "1", 2.5, {}),
            row("rope_norm", "q", "2", 1.0, {"rope_norm": {"num_warps": 2}}, batch=8)]
    env = dkc.best_env(rows, 1)
    assert env == "compress_window:BLOCK_C=16,BLOCK_W=128,num_warps=2;compress_entry:num_warps=1"
    assert dkc.best_env(rows, 8) == ""  # no default timed at 8: nothing to beat
