"""How long a killed decode worker takes to serve again under `bulkhead up`, and where it goes.

    python -m lab.bench.restart [--runs N] [--gap S] [--out FILE] [-- ARGS FOR bulkhead up]

Starts `bulkhead up` (the default model unless ARGS name another) on a free port, waits for its
banner and one answered chat, then per run: SIGKILLs the decode worker and times, from the kill,
what each part of the way back takes:

- ``restarted``: the supervisor noticed the death and started the new process (its poll plus its
  back-off, launch/supervisor.py);
- ``first progress``: the new worker's first start-up line (interpreter and imports);
- every start-up step the worker prints (weights, memory plan, warm-up steps, KV store);
- ``grpc serving``: its gRPC health check answers SERVING;
- ``router routes``: the router's /health shows it healthy again (its poll of the workers);
- ``chat answered``: a new chat request answered 200 (polled every 0.2 s from the kill).

Runs are ``--gap`` seconds apart (default 65: more than the supervisor's ``stable_after_s``, so
each kill is a first death with the first back-off). Prints one table per run and writes them
as JSON with the command and date to ``--out`` if given. Lab code: it imports the product's
launcher helpers, the product never imports this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from common.startup_progress import PREFIX
from launch.health import grpc_serving
from launch.launcher import free_port

READY_LINE = "Ctrl-C stops everything"


def _chat(url: str, model: str, timeout_s: float = 30.0) -> bool:
    body = json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hello again"}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def _routed(url: str, address: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except OSError:
        return False
    return bool(json.loads(body).get("workers", {}).get(address, {}).get("healthy"))


def _decode_child(up_pid: int) -> tuple[int, str]:
    """The decode worker's pid and address, from the process table."""
    import psutil

    for p in psutil.Process(up_pid).children():
        cmd = p.cmdline()
        if "decode" in cmd[3:4]:
            port = cmd[cmd.index("--port") + 1]
            return p.pid, f"127.0.0.1:{port}"
    raise RuntimeError("bulkhead up has no decode worker child")


class LineWatch(threading.Thread):
    """Timestamps (seconds since ``t0``) the new lines of some files as they appear."""

    def __init__(self, paths: list[Path], t0: float) -> None:
        super().__init__(daemon=True)
        self.paths, self.t0 = paths, t0
        self.offsets = {p: p.stat().st_size if p.exists() else 0 for p in paths}
        self.lines: list[tuple[Path, float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for p in self.paths:
                if not p.exists():
                    continue
                with p.open("rb") as f:
                    f.seek(self.offsets[p])
                    data = f.read()
                end = data.rfind(b"\n") + 1
                self.offsets[p] += end
                now = time.monotonic() - self.t0
                for line in data[:end].decode(errors="replace").splitlines():
                    self.lines.append((p, now, line))
            time.sleep(0.05)


def one_run(up_pid: int, url: str, model: str, log_dir: Path, up_out: Path,
            timeout_s: float) -> list[tuple[str, float]]:
    pid, address = _decode_child(up_pid)
    t0 = time.monotonic()
    watch = LineWatch([up_out, *sorted(log_dir.glob("decode*.log"))], t0)
    watch.start()
    import os

    os.kill(pid, signal.SIGKILL)
    marks: dict[str, float] = {}
    while "chat answered" not in marks:
        now = time.monotonic() - t0
        if now > timeout_s:
            raise RuntimeError(f"no chat answered within {timeout_s} s of the kill")
        if "grpc serving" not in marks and grpc_serving(address, timeout_s=0.2):
            marks["grpc serving"] = time.monotonic() - t0
        if "router routes" not in marks and "grpc serving" in marks and _routed(url, address):
            marks["router routes"] = time.monotonic() - t0
        if _chat(url, model, timeout_s=10.0):
            marks["chat answered"] = time.monotonic() - t0
        time.sleep(0.2)
    time.sleep(0.2)
    watch.stop.set()
    watch.join()
    events: list[tuple[str, float]] = []
    for path, at, line in watch.lines:
        if re.search(r"decode \(pid \d+\) exited", line):
            events.append(("death noticed", at))
        elif "decode restarted" in line:
            events.append(("restarted", at))
        elif line.startswith(PREFIX) and path != up_out:  # up.out repeats the old log's tail
            if not any(name == "first progress" for name, _ in events):
                events.append(("first progress", at))
            events.append((line[len(PREFIX):].strip(), at))
    events += list(marks.items())
    return sorted(events, key=lambda e: e[1])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    up_args = args[args.index("--") + 1:] if "--" in args else []
    own = args[:args.index("--")] if "--" in args else args
    p = argparse.ArgumentParser(prog="python -m lab.bench.restart", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--gap", type=float, default=65.0, help="seconds between runs")
    p.add_argument("--timeout", type=float, default=180.0, help="per run, from the kill")
    p.add_argument("--out", default="", help="write the runs as JSON here")
    opts = p.parse_args(own)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up_out = log_dir / "up.out"
    command = [sys.executable, "-m", "launch.cli", "up", "--port", str(port),
               "--log-dir", str(log_dir), *up_args]
    runs: list[list[tuple[str, float]]] = []
    with up_out.open("wb") as out:
        up = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        started = time.monotonic()
        while READY_LINE not in up_out.read_text(errors="replace"):
            if up.poll() is not None or time.monotonic() - started > 900:
                raise RuntimeError(f"bulkhead up did not start:\n{up_out.read_text()}")
            time.sleep(0.5)
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        assert _chat(url, model, 120.0), "the first chat was not answered"
        for i in range(opts.runs):
            if i:
                time.sleep(opts.gap)
            events = one_run(up.pid, url, model, log_dir, up_out, opts.timeout)
            runs.append(events)
            print(f"run {i + 1}: seconds from the SIGKILL of the decode worker")
            for name, at in events:
                print(f"  {at:6.1f}  {name}")
    finally:
        import os

        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    if opts.out:
        record: dict[str, Any] = {
            "command": "python -m lab.bench.restart " + " ".join(args),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "runs": [[{"event": n, "s": round(s, 2)} for n, s in r] for r in runs],
        }
        Path(opts.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
