"""Workers killed with SIGKILL (real processes, real redis-server). A prefill worker in the middle
of a prefill: the request, the only one running there, is blamed for the death (router/
crash_blame.py) and quarantined; it is not replayed on the other prefill worker nor prefilled by a
decode worker, and is refused at once when sent again, while other prompts are served. A decode
worker in the middle of a stream: the client gets an error and the stream ends; new requests go
to the other decode worker. Nothing hangs."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from common.default_model import default_model_path
from common.worker_env import WORKER_ENV
from launch.launcher import ProcessGroup, redis_server_path
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.static_cluster import start_static_cluster

pytestmark = pytest.mark.slow

# SmolLM2 on CPU in 16-token chunks: a 1000-token prefill takes seconds, long enough to kill.
FLAGS = ("--device", "cpu", "--max-context", "1200", "--chunk-tokens", "16", "--max-batch", "2",
         "--lmcache-chunk-size", "64", "--kv-staging-gb", "0.2", "--num-threads", "1")


def _info(address: str) -> pb.WorkerInfo | None:
    with grpc.insecure_channel(address) as ch:
        try:
            return pb_grpc.WorkerStub(ch).GetInfo(pb.WorkerInfoRequest(), timeout=1.0)
        except grpc.RpcError:
            return None


@pytest.fixture(scope="module")
def two_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    try:
        model = str(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    log_dir: Path = tmp_path_factory.mktemp("kill-logs")
    with ProcessGroup() as group:
        url, procs, addr = start_static_cluster(
            group, log_dir, model, worker_module="launch.cli", worker_flags=FLAGS,
            env=WORKER_ENV, router_flags=("--split-threshold-tokens", "64",
                                          "--poll-interval-s", "0.5"),
            worker_timeout_s=startup_budget_s(5 / 3), router_timeout_s=startup_budget_s(2 / 3))
        yield {"url": url, "procs": procs, "addr": addr}


def _complete(url: str, prompt: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    return list(r.choices[0].token_ids)


def test_prefill_worker_sigkilled_mid_prefill(two_prefill: dict) -> None:
    url, procs, addr = two_prefill["url"], two_prefill["procs"], two_prefill["addr"]
    prompt = [(37 * i) % 40000 + 100 for i in range(1000)]
    result: dict = {}

    def run() -> None:
        try:
            result["ids"] = _complete(url, prompt)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=run)
    started = time.monotonic()
    t.start()
    victim = None
    while victim is None and time.monotonic() - started < 60 and t.is_alive():
        for name in ("p1", "p2"):
            info = _info(addr[name])
            if info is not None and info.num_running > 0:
                victim = name
                break
        time.sleep(0.05)
    assert victim is not None, f"no prefill worker picked the request up: {result}"
    time.sleep(0.3)  # well inside the prefill
    procs[victim].popen.send_signal(signal.SIGKILL)
    t.join(timeout=180)
    assert not t.is_alive(), "the request hung after its prefill worker died"
    err = result.get("error")
    assert isinstance(err, openai.InternalServerError), result
    assert err.body["code"] == "request_quarantined", err.body
    survivor = "p2" if victim == "p1" else "p1"
    # not replayed: neither the other prefill worker nor a decode worker computed it
    assert _info(addr[survivor]).tokens_advanced == 0
    assert all(_info(addr[d]).tokens_advanced == 0 for d in ("d1", "d2"))
    # the same request again: refused at once; another prompt is served by the survivors
    with pytest.raises(openai.InternalServerError) as again:
        _complete(url, prompt)
    assert again.value.body["code"] == "request_quarantined"
    assert _info(addr[survivor]).tokens_advanced == 0
    assert len(_complete(url, prompt[:-1])) == 8


def test_decode_worker_sigkilled_mid_stream(two_prefill: dict) -> None:
    url, procs, addr = two_prefill["url"], two_prefill["procs"], two_prefill["addr"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    prompt = [(53 * i) % 30000 + 200 for i in range(40)]  # short: the decode worker alone
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=400, temperature=0,
                                       stream=True)
    started = time.monotonic()
    got = 0
    victim = None
    with pytest.raises(openai.APIError):  # the error event of the broken stream
        for chunk in stream:
            got += 1
            if got == 3:
                victim = next(n for n in ("d1", "d2")
                              if (i := _info(addr[n])) is not None and i.num_running > 0)
                procs[victim].popen.send_signal(signal.SIGKILL)
            assert chunk.choices[0].finish_reason in (None, "length"), chunk
            assert time.monotonic() - started < 60
    assert victim is not None and time.monotonic() - started < 60
    # new requests go to the remaining decode worker
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text is not None
