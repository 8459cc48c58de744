"""DeepSeek-V4's MTP layers (engine/models/deepseek_v4/mtp.py): read from a checkpoint in
DeepSeek's layout (``mtp.{i}.*``), their forward equals a plain reference built on
transformers' own V4 layer (chunked and one token at a time, through the layer's window ring),
and a checkpoint without them refuses ``speculative_method=mtp``."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint import load_checkpoint
from engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4KVPool, DeepseekV4Model
from engine.models.deepseek_v4.mtp import V4MTPLayer, mtp_config, mtp_layer_count, split_mtp_weights
from tests.engine.deepseek_v4._mtp_ckpt import main_streams, reference_mtp_logits, write_v4_with_mtp


def test_mtp_layer_matches_reference(tmp_path: Path) -> None:
    main, auxes, glues = write_v4_with_mtp("s-csa-hca_yarn_hc2", tmp_path, num_mtp=2)
    ck = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert mtp_layer_count(ck.state_dict) == 2
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    layers = split_mtp_weights(ck.state_dict, cfg.num_layers, torch.float32)
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32)
    ids = torch.randint(2, 97, (23,), generator=torch.Generator().manual_seed(4))
    h = main_streams(main, ids)[:-1]  # position p: the main model's streams at p ...
    nxt = ids[1:]  # ... and the token at p + 1
    n = nxt.numel()
    for i, (aux, glue) in enumerate(zip(auxes, glues, strict=True)):
        mtp = V4MTPLayer.build(cfg, layers[i], ours, torch.float32, "cpu")
        want, want_streams = reference_mtp_logits(aux, glue, h, nxt, aux.config.rms_norm_eps)
        pool = DeepseekV4KVPool.for_slots(mtp_config(cfg), 1, 32, torch.float32, "cpu")
        split = 13  # a chunk, then one token at a time through the window ring
        got = []
        with torch.no_grad():
            mtp.h_in = h[:split]
            got.append(mtp.compute_logits(mtp(nxt[:split], torch.arange(split), [0, split], [0], pool)))
            for p in range(split, n):
                mtp.h_in = h[p:p + 1]
                got.append(mtp.compute_logits(mtp(nxt[p:p + 1], torch.tensor([p]), [0, 1], [0], pool)))
        torch.testing.assert_close(torch.cat(got), want, atol=2e-5, rtol=1e-4)
        assert mtp.streams_out is not None
        torch.testing.assert_close(mtp.streams_out[0], want_streams[-1], atol=2e-5, rtol=1e-4)
