"""``bulkhead up --model DIR --speculative-method mtp`` on a tiny DeepSeek-V4 checkpoint that
ships an MTP layer (``mtp.0.*``, DeepSeek's layout): the decode worker drafts with it, answers
to a short prompt (decode worker only) and to a long one (prefill worker, KV handed to the decode
worker, whose MTP window starts cold at the imported block end) are plain greedy decoding's,
and vLLM's spec_decode counters on /metrics show drafts verified."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from lab.bench.deepseek_v4.write_checkpoint import write_tokenizer
from launch.launcher import free_port
from tests.e2e.test_v4_served import PROMPT, _env
from tests.engine.deepseek_v4._mtp_ckpt import write_v4_with_mtp
from tests.helpers.default_model import default_model_or_skip
from tests.helpers.engine_greedy import engine_greedy
from tests.helpers.up_process import stop_up, up_process, wait_until_up

pytestmark = pytest.mark.slow  # two V4 workers warm up on 2 cores

NEW = 24


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(2)) for line in text.splitlines()
               if (m := re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)))


def test_v4_checkpoint_with_mtp_serves_with_mtp_drafts(tmp_path: Path) -> None:
    default_model_or_skip()  # the tokenizer written beside the weights is SmolLM2's
    from common.tokenizer import Tokenizer

    folder = tmp_path / "v4mtp"
    folder.mkdir()
    write_v4_with_mtp("s-csa-hca_yarn_hc2", folder, num_mtp=1)
    write_tokenizer(folder)
    engine = LLMEngine.from_config(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                                max_batch=8, chunk_tokens=512))
    want = engine_greedy(engine, PROMPT, NEW)
    # past the router's split threshold (256): prefilled on the prefill worker, its full block
    # imported by the decode worker, whose MTP window starts cold there (mtp_drafter.py)
    long_prompt = [2 + (7 * i) % 95 for i in range(300)]
    want_long = engine_greedy(engine, long_prompt, NEW, "ref-long")
    del engine
    port = free_port()
    out, logs = tmp_path / "up.out", tmp_path / "logs"
    env = {**_env(), "BULKHEAD_DTYPE": "float32"}
    with up_process(["--model", str(folder), "--port", str(port), "--log-dir", str(logs),
                     "--speculative-method", "mtp", "--num-speculative-tokens", "3"],
                    out, env) as proc:
        wait_until_up(proc, out, budget_s=600, poll_s=1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        resp, resp_long = (client.completions.create(
            model=model, prompt=p, max_tokens=NEW, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True}) for p in (PROMPT, long_prompt))
        drafts = 0.0
        for _ in range(60):  # the router's poll of the workers' GetInfo brings the counters
            drafts = _metric(port, "vllm:spec_decode_num_drafts_total")
            if drafts > 0:
                break
            time.sleep(0.5)
        stop_up(proc, out)
    tok = Tokenizer.from_path(str(folder))
    by_text = {tok.decode([i], skip_special_tokens=False): i for i in range(97)}
    assert [by_text[t] for t in resp.choices[0].logprobs.tokens] == want
    assert [by_text[t] for t in resp_long.choices[0].logprobs.tokens] == want_long
    assert drafts > 0
    # the long prompt did go prefill -> decode, its block imported, not recomputed
    assert "routes=split prompt_tokens=300" in (logs / "router.log").read_text()
    assert "KV import of" in (logs / "decode.log").read_text()
