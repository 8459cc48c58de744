"""DeepSeek-V4 as a user serves it: ``bulkhead up --model DIR`` and nothing else.

* A tiny V4 checkpoint stored as shipped (FP8 block-scaled projections, MXFP4 experts; rates 4
  and 8, not V4-Flash's 4 and 128), with a tokenizer beside it, starts on the defaults the model
  gives (block size 256, a multiple of its rates; max_context auto) and answers with
  transformers' greedy tokens on the dequantized weights.
* A config-only V4 folder (no weights) serves with ``--load-format dummy --kv-cache-dtype fp8``
  and answers with the tokens an in-process engine on the same settings gives (the dummy
  weights are the same for the same seed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v4.weights.checkpoint_layout import to_hf_names
from lab.bench.deepseek_v4.write_checkpoint import flash_hf_config, write_tokenizer
from launch.launcher import free_port
from tests.engine.deepseek_v4._quantized_ckpt import dequantized, write_quantized
from tests.engine.deepseek_v4.test_deepseek_v4_quantized import _build_hf
from tests.helpers.default_model import default_model_or_skip
from tests.helpers.engine_greedy import engine_greedy
from tests.helpers.up_process import stop_up, up_process, wait_until_up

pytestmark = pytest.mark.slow  # two V4 workers warm up on 2 cores

PROMPT = [int(t) for t in torch.randint(2, 97, (23,), generator=torch.Generator().manual_seed(4))]
NEW = 8


def _env() -> dict[str, str]:
    env = {**os.environ, "BULKHEAD_KV_STAGING_GB": "0.1", "BULKHEAD_NUM_THREADS": "1"}
    for name in ("BULKHEAD_MAX_CONTEXT", "BULKHEAD_BLOCK_SIZE", "BULKHEAD_CONFIG"):
        env.pop(name, None)
    return env


def _complete(port: int, **extra: object) -> object:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True}, **extra)


def _serve(folder: Path, tmp_path: Path, *flags: str, **extra: object) -> tuple[object, str]:
    """``bulkhead up --model folder FLAGS``, one greedy completion of PROMPT, Ctrl-C; returns
    the completion and the decode worker's log."""
    port = free_port()
    out, logs = tmp_path / f"up-{port}.out", tmp_path / f"logs-{port}"
    with up_process(["--model", str(folder), "--port", str(port), "--log-dir", str(logs),
                     *flags], out, _env()) as proc:
        wait_until_up(proc, out, budget_s=600, poll_s=1)
        resp = _complete(port, **extra)
        stop_up(proc, out)
    return resp, (logs / "decode.log").read_text()


def test_shipped_v4_checkpoint_serves_on_its_defaults(tmp_path: Path) -> None:
    default_model_or_skip()  # the tokenizer written beside the weights is SmolLM2's
    from common.tokenizer import Tokenizer

    folder = tmp_path / "v4q"
    model = _build_hf()
    _, qsd = write_quantized(model, folder)
    model.load_state_dict(to_hf_names(dequantized(qsd), torch.float32), strict=True)
    write_tokenizer(folder)
    ids = torch.tensor(PROMPT)
    want = model.generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, len(PROMPT):].tolist()
    resp, log = _serve(folder, tmp_path, logprobs=0)
    # the ids back from the logprobs' token strings: the tiny vocabulary's 97 ids are 97
    # distinct strings in this tokenizer (specials by name, then single printable bytes)
    tok = Tokenizer.from_path(str(folder))
    by_text = {tok.decode([i], skip_special_tokens=False): i for i in range(97)}
    assert len(by_text) == 97
    assert [by_text[t] for t in resp.choices[0].logprobs.tokens] == want
    # the defaults the model gave, as the worker printed them with its plan
    assert "blocks of 256 tokens" in log and "max_context 512" in log, log


def test_config_only_v4_folder_serves_dummy_weights_with_fp8_kv(tmp_path: Path) -> None:
    default_model_or_skip()
    from common.tokenizer import Tokenizer

    folder = tmp_path / "v4cfg"
    folder.mkdir()
    hf = flash_hf_config(3, 4, hidden=256, vocab=49152)
    hf["max_position_embeddings"] = 1024
    vocab, bos, eos = write_tokenizer(folder)
    hf.update(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    (folder / "config.json").write_text(json.dumps(hf))
    engine = LLMEngine.from_config(EngineConfig(
        model=str(folder), device="cpu", load_format="dummy", kv_dtype="fp8", max_batch=8,
        chunk_tokens=512, dtype="bfloat16"))  # the workers' CPU default
    want = engine_greedy(engine, PROMPT, NEW)
    del engine
    resp, log = _serve(folder, tmp_path, "--load-format", "dummy", "--kv-cache-dtype", "fp8")
    assert resp.choices[0].text == Tokenizer.from_path(str(folder)).decode(want)
    assert "kv_dtype fp8)" in log and "making dummy weights" in log, log


def test_config_only_dense_folder_serves_dummy_weights(tmp_path: Path) -> None:
    """The same for a dense family: a Llama config.json and a tokenizer, no weights."""
    default_model_or_skip()
    from common.tokenizer import Tokenizer

    folder = tmp_path / "llama-cfg"
    folder.mkdir()
    vocab, bos, eos = write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": bos, "eos_token_id": eos,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    engine = LLMEngine.from_config(EngineConfig(
        model=str(folder), device="cpu", load_format="dummy", max_batch=8, chunk_tokens=512,
        dtype="bfloat16"))  # the workers' CPU default
    assert engine.config.block_size == 16 and engine.config.max_context == 2048
    want = engine_greedy(engine, PROMPT, NEW)
    del engine
    resp, log = _serve(folder, tmp_path, "--load-format", "dummy")
    assert resp.choices[0].text == Tokenizer.from_path(str(folder)).decode(want)
    assert "making dummy weights" in log and "max_context 2,048" in log, log
