"""Host memory of a running `bulkhead up`: starts it as a user would (extra arguments pass
through), waits until it is healthy, asks the README's example question, then reads
/proc/PID/smaps_rollup of `up` and every process under it and prints each one's RSS and PSS
(shared pages counted once across the processes) and their sums. Stops it with Ctrl-C's SIGINT.

    python lab/scripts/up_footprint.py [--port P] [--json OUT] [-- up's own flags ...]

A lab script: it reads the product from outside and changes nothing in it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MiB = 1 << 20
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0}


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def tree(pid: int) -> list[tuple[int, int]]:
    """``pid`` and every process below it, each with its parent (0 for ``pid``)."""
    todo, seen = [(pid, 0)], []
    while todo:
        p, parent = todo.pop()
        seen.append((p, parent))
        todo += [(c, p) for c in children(p)]
    return seen


def rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of one process, in bytes."""
    got = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            got[key.lower()] = int(rest.split()[0]) * 1024
    return got


def label(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [a.decode(errors="replace") for a in argv if a]
    if "launch.cli" in words:  # python -m launch.cli ROLE ...
        return words[words.index("launch.cli") + 1]
    if words and words[0].endswith("bulkhead"):
        return "bulkhead " + (words[1] if len(words) > 1 else "")
    return Path(words[0]).name if words else "?"


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bulkhead up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"not healthy at {url} after {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("up_args", nargs="*", help="after --: flags for bulkhead up")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "launch.cli", "up", "--port", str(args.port), *args.up_args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc, args.timeout_s)
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(QUESTION).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)["choices"][0]["message"]["content"]
        time.sleep(2)
        rows, names = [], {}
        for pid, parent in tree(proc.pid):
            try:
                name = label(pid)
                if name == "python" and parent in names:  # e.g. the router's parser child
                    name = f"{names[parent]} child"
                names[pid] = name
                rows.append({"pid": pid, "process": name, **rollup(pid)})
            except OSError:  # exited meanwhile
                continue
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    plan_lines = [ln for ln in out.decode(errors="replace").splitlines()
                  if "memory" in ln and "MiB" in ln]
    total = {k: sum(r[k] for r in rows) for k in ("rss", "pss")}
    print("\n".join(plan_lines))
    print(f"answer: {answer!r}")
    print(f"{'process':<16}{'pid':>8}{'RSS MiB':>10}{'PSS MiB':>10}")
    for r in rows:
        print(f"{r['process'][:15]:<16}{r['pid']:>8}{r['rss'] / MiB:>10,.0f}"
              f"{r['pss'] / MiB:>10,.0f}")
    print(f"{'total':<24}{total['rss'] / MiB:>10,.0f}{total['pss'] / MiB:>10,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": argv[3:], "answer": answer,
                                               "processes": rows, "total": total}, indent=1))


if __name__ == "__main__":
    main()
