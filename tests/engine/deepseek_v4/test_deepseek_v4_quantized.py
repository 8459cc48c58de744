"""Must-show of the quantized weights: a tiny V4 checkpoint with FP8 block-scaled projections
and MXFP4 experts, at awkward widths (hidden 160 and q_lora_rank 136 cut 128-blocks short; the
grouped output projection's 72-row groups straddle a block; 7 experts of which two never get a
token; two experts tied in score and weights), written to disk and read by the engine's loader,
keeps its payloads as stored and gives the same greedy tokens as the same model dequantized to
fp32 and run through transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.errors import CheckpointError
from engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4KVPool, DeepseekV4Model
from engine.models.deepseek_v4.weights.checkpoint_layout import to_hf_names
from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts
from engine.models.deepseek_v4.weights.quant_weights import resident_weight_bytes

from ._quantized_ckpt import dequantized, write_quantized

RAW: dict[str, Any] = {
    "vocab_size": 97, "hidden_size": 160, "moe_intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 136, "partial_rotary_factor": 0.5,
    "num_experts_per_tok": 2, "n_routed_experts": 7, "hc_sinkhorn_iters": 5, "o_lora_rank": 72,
    "index_head_dim": 16, "index_n_heads": 4, "max_position_embeddings": 512, "bos_token_id": 0,
    "eos_token_id": 1, "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "hc_mult": 2, "sliding_window": 6, "o_groups": 2, "index_topk": 3,
}
PROMPT = 23
NEW_TOKENS = 8


def _build_hf() -> torch.nn.Module:
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(HFConfig(**RAW)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "sinks" in name or "bias" in name else 0.05))
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.gate.weight[1] = mlp.gate.weight[0]  # experts 0 and 1 tie in score...
            mlp.experts.gate_up_proj[1] = mlp.experts.gate_up_proj[0]  # ...and in weights
            mlp.experts.down_proj[1] = mlp.experts.down_proj[0]
            if hasattr(mlp.gate, "e_score_correction_bias"):
                mlp.gate.e_score_correction_bias.zero_()
                mlp.gate.e_score_correction_bias[5:] = -100.0  # experts 5, 6 never chosen
            else:
                rows = [torch.randperm(5, generator=gen)[:2] for _ in range(RAW["vocab_size"])]
                mlp.gate.tid2eid.copy_(torch.stack(rows))
    return model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, dict[str, torch.Tensor]]:
    """(folder of the quantized checkpoint, transformers model holding its dequantized values,
    the quantized DeepSeek-layout tensors)."""
    folder = tmp_path_factory.mktemp("v4q")
    model = _build_hf()
    _, qsd = write_quantized(model, folder)
    model.load_state_dict(to_hf_names(dequantized(qsd), torch.float32), strict=True)
    return folder, model, qsd


def _greedy(ours: DeepseekV4Model, cfg: DeepseekV4Config, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    cache = DeepseekV4KVPool.for_slots(cfg, 1, 64, torch.float32, "cpu")
    logits = [ours.compute_logits(ours(ids, torch.arange(ids.numel()), [0, ids.numel()], [0], cache))[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        pos = cache.num_tokens[0]
        h = ours(torch.tensor([tokens[-1]]), torch.tensor([pos]), [0, 1], [0], cache)
        logits.append(ours.compute_logits(h)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def test_loader_keeps_payloads_as_stored(quantized) -> None:
    folder, _, qsd = quantized
    ck = load_checkpoint(folder, torch.float32, progress=False)
    assert ck.state_dict["model.layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert ck.state_dict["model.layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert ck.state_dict["model.layers.1.ffn.experts.3.w2.weight"].dtype == torch.int8
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32)
    attn = ours.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, Fp8Linear) and attn.q_a_proj.block == (128, 128)
    assert attn.q_a_proj.scale.shape == (2, 2)  # 136 x 160 in 128-blocks, both partial
    assert isinstance(attn.o_a_proj, Fp8Linear) and attn.o_a_proj.groups == 2
    assert isinstance(attn.compressor.kv_proj, torch.nn.Linear)  # bf16 in V4-Flash: untouched
    experts = ours.model.layers[2].mlp.experts
    assert isinstance(experts, Mxfp4Experts) and experts.gate_up_proj.dtype == torch.uint8
    assert experts.gate_up_proj.shape == (7, 192, 80) and experts.gate_up_proj_scale.shape == (7, 192, 5)
    assert ours.model.layers[0].mlp.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    # the plan counts what the model holds: quantized bytes, far below the fp32 model
    held = resident_weight_bytes(ck.state_dict, torch.float32, "checkpoint")
    upcast = resident_weight_bytes(ck.state_dict, torch.float32, "dequantize")
    dense = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in dequantized(qsd).values())
    assert upcast == dense and held < 0.5 * dense


def test_greedy_tokens_match_transformers_on_dequantized_weights(quantized) -> None:
    folder, model, _ = quantized
    ids = torch.randint(2, 97, (PROMPT,), generator=torch.Generator().manual_seed(4))
    g = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    want = g.sequences[0, PROMPT:].tolist()
    want_logits = torch.stack([lg[0] for lg in g.logits])
    ck = load_checkpoint(folder, torch.float32, progress=False)
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    for fmt in ("checkpoint", "dequantize"):
        ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32, weight_format=fmt)
        tokens, logits = _greedy(ours, cfg, ids)
        assert tokens == want, fmt
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4, msg=fmt)


def test_routing_really_skips_and_ties(quantized) -> None:
    """The fixture's routing claims hold: experts 5 and 6 get no token, 0 and 1 tie."""
    _, model, _ = quantized
    ck = load_checkpoint(quantized[0], torch.float32, progress=False)
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32)
    x = torch.randn(50, 160, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(2, 97, (50,))
    for layer in ours.model.layers:
        _, idx = layer.mlp.route(x, ids)
        assert not ((idx == 5) | (idx == 6)).any()
        scores = torch.nn.functional.linear(x, layer.mlp.gate.weight)
        assert torch.equal(scores[:, 0], scores[:, 1])


def test_non_power_of_two_expert_scales_are_refused(quantized) -> None:
    """fp32 expert scales are fine while they are powers of two (kept as e8m0 bytes); one that
    is not cannot be MXFP4, and the error says how to load the model anyway."""
    _, _, qsd = quantized
    bad = {k: (v.float() if re.match(r"model\.layers\.1\.ffn\.experts\.\d+\.w\d\.scale", k) else v)
           for k, v in qsd.items()}
    cfg = DeepseekV4Config.from_hf_dict(RAW)
    DeepseekV4Model.from_state_dict(cfg, bad, dtype=torch.float32)
    bad["model.layers.1.ffn.experts.0.w1.scale"] *= 1.5
    with pytest.raises(CheckpointError, match="powers of two.*weight_format=dequantize"):
        DeepseekV4Model.from_state_dict(cfg, bad, dtype=torch.float32)
    DeepseekV4Model.from_state_dict(cfg, bad, dtype=torch.float32, weight_format="dequantize")


def _interpreted(script: str, folder: Path, timeout_s: int) -> str:
    """Run a check script of this folder on ``folder`` under TRITON_INTERPRET; its stdout."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(folder)],
                          env=env, capture_output=True, text=True, timeout=timeout_s, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_kernels_path_under_triton_interpreter(quantized) -> None:
    """The same checkpoint through the Triton GEMMs (interpreter): the same greedy tokens."""
    out = _interpreted("_quantized_interp_check.py", quantized[0], 600)
    m = re.search(r"kernels=(\S+) torch=(\S+) ws_peak=(\d+) ws_cap=(\d+)", out)
    assert m, out
    assert m.group(1) == m.group(2)
    assert 0 < int(m.group(3)) <= int(m.group(4))
    fused = re.search(r"fused=(\S+) routers=(\d+) one_lane=(\S+) deferred=(\S+)", out)
    assert fused and fused.group(1) == m.group(2), out  # the fused decode path, side lane on
    assert int(fused.group(2)) > 0, out  # the router's linear ran fused into the routing
    # without the side lane, and with its work run at each join (the other schedule)
    assert fused.group(3) == fused.group(1) and fused.group(4) == fused.group(1), out
    forks = re.search(r"forks=(\d+) forks_one_lane=(\d+) forks_deferred=(\d+)", out)
    assert forks and int(forks.group(1)) > 0 and int(forks.group(2)) == 0, out
    assert forks.group(3) == forks.group(1), out
    # the same kernels on the same inputs whatever the schedule: the same bits
    diff = re.search(r"lane_hidden_maxdiff=(\S+)", out)
    assert diff and float(diff.group(1)) == 0.0, out


@pytest.mark.slow
def test_w8a8_prefill_under_triton_interpreter(quantized) -> None:
    """A prompt past the w8a8 row threshold (130 tokens: the FP8 linears quantize their
    activations per 1 x 128, K = 160 and 136 leaving partial groups) through the Triton GEMMs
    gives the greedy tokens and prefill logits of the torch references running the same
    prefill form, with its activation scratch inside the planned Workspace. Against the
    weight-only references this tiny random model moves (its prefill logits ~25% apart, a
    third of the rows' argmax differs): why the form runs only from ``W8A8_MIN_ROWS`` rows, so
    decode and the token-identity tests above keep the weight-only kernels."""
    out = _interpreted("_w8a8_interp_check.py", quantized[0], 900)
    m = re.search(r"kernels=(\S+) spec=(\S+) weight_only=\S+ kernels_vs_spec=([\d.]+)/([\d.]+) "
                  r"spec_vs_weight_only=\S+ ws_peak=(\d+) ws_cap=(\d+)", out)
    assert m, out
    assert m.group(1) == m.group(2), out
    assert float(m.group(3)) < 0.02 and float(m.group(4)) == 1.0, out
    assert 0 < int(m.group(5)) <= int(m.group(6))


@pytest.mark.parametrize("weight_format", ["checkpoint", "dequantize"])
def test_engine_serves_the_quantized_folder(quantized, weight_format) -> None:
    """LLMEngine.from_config on the folder: plan weights = what the model holds (quantized or
    explicitly dequantized), and the same greedy tokens as transformers."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    folder, model, qsd = quantized
    ec = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_context=64,
                      chunk_tokens=16, max_batch=2, weight_format=weight_format)
    engine = LLMEngine.from_config(ec)
    ours = engine.runner.model.model  # ModelRunner -> DeepseekV4Family -> DeepseekV4Model
    held = sum(t.numel() * t.element_size() for n, t in ours.state_dict().items() if "rotary" not in n)
    planned = engine.plan.term("weights")
    assert abs(planned - held) <= 0.01 * held, (planned, held)  # fp32-kept norms aside
    dense = sum(t.numel() * 4 for t in dequantized(qsd).values() if t.is_floating_point())
    assert (planned < 0.5 * dense) == (weight_format == "checkpoint")
    ids = torch.randint(2, 97, (PROMPT,), generator=torch.Generator().manual_seed(4)).tolist()
    engine.add_request("q", ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            got += o.new_token_ids
    want = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, PROMPT:].tolist()
    assert got == want


def test_plan_holds_the_fused_moe_scratch(quantized) -> None:
    """On CUDA the fused MoE takes tokens x top_k scratch from the Workspace: the plan's
    workspace term covers it whatever attention backend runs; not when dequantized."""
    from engine.config import EngineConfig
    from engine.memory_planner import make_plan
    from engine.model_config import ModelConfig
    from kernels.mxfp4_moe import moe_experts_workspace_bytes

    ck = load_checkpoint(quantized[0], torch.float32, progress=False)
    mc = ModelConfig.from_hf_dict(ck.config.hf_config)
    need = moe_experts_workspace_bytes(512, 2, 160, 96, 7, torch.bfloat16)
    for attention in ("triton", "torch"):
        ec = EngineConfig(model="x", device="cuda", dtype="bfloat16", chunk_tokens=512, max_batch=4,
                          attention_backend=attention)
        assert make_plan(mc, ec, 1 << 40).term("ws.indexer") >= need, attention
    ec = EngineConfig(model="x", device="cuda", dtype="bfloat16", chunk_tokens=512, max_batch=4,
                      attention_backend="torch", weight_format="dequantize")
    assert make_plan(mc, ec, 1 << 40).term("ws.indexer") == 0


def test_consumed_state_dict_gives_up_its_experts(quantized) -> None:
    """The engine's weights dict loses each per-expert tensor once it is stacked (so a real
    checkpoint's experts are not held twice); the model is the same."""
    _, _, qsd = quantized
    given = dict(qsd)
    cfg = DeepseekV4Config.from_hf_dict(RAW)
    a = DeepseekV4Model.from_state_dict(cfg, given, dtype=torch.float32, consume=True)
    assert not [k for k in given if ".experts." in k]
    assert any(".shared_experts." in k for k in given)  # only the routed experts were given up
    b = DeepseekV4Model.from_state_dict(cfg, qsd, dtype=torch.float32)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), name


@pytest.mark.gpu
def test_cuda_kernels_give_the_same_tokens(quantized) -> None:
    """On the GPU: the checkpoint on CUDA with the FP8 / MXFP4 Triton GEMMs (fp32 activations,
    so the comparison is about the kernels, not bf16) decodes transformers' greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from engine.models.deepseek_v4 import V4Backend

    folder, model, _ = quantized
    ids = torch.randint(2, 97, (PROMPT,), generator=torch.Generator().manual_seed(4))
    want = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, PROMPT:].tolist()
    ck = load_checkpoint(folder, torch.float32, device="cuda", progress=False)
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, torch.float32, "cuda",
                                           V4Backend("torch", "torch", "kernels"))
    assert ours.model.layers[1].mlp.experts.use_kernels
    cache = DeepseekV4KVPool.for_slots(cfg, 1, 64, torch.float32, "cuda")
    dev_ids = ids.cuda()
    h = ours(dev_ids, torch.arange(PROMPT, device="cuda"), [0, PROMPT], [0], cache)
    tokens = [int(ours.compute_logits(h)[-1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        pos = cache.num_tokens[0]
        h = ours(torch.tensor([tokens[-1]], device="cuda"), torch.tensor([pos], device="cuda"), [0, 1], [0], cache)
        tokens.append(int(ours.compute_logits(h)[0].argmax()))
    assert tokens == want
