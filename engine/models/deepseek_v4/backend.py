"""Which implementation runs V4's two context-sized operations: the indexer's top-k and the
sparse attention core.

* ``torch``: this package's tiled PyTorch code (CPU default; bounded scratch, any device).
* ``kernels``: the kernels package's Triton kernels (CUDA default), scratch taken from the
  engine's Workspace when one is given.
* ``kernels_ref``: the kernels package's PyTorch references (the specification; slow).
* ``naive`` (indexer only): transformers' formulation, one ``[S, H, T]`` fp32 score tensor; it
  exists to show the memory growth the tiled versions remove and must never be the default.

``gemm`` picks how FP8 / MXFP4 weights kept in checkpoint format are multiplied: ``kernels``
(the kernels package's Triton GEMMs and fused MoE; CUDA default) or ``torch`` (their PyTorch
references, which dequantize per call; CPU default).

``mhc`` picks how the mHC stream passes run (Sinkhorn, the collapse before a block, the merge
after it): ``kernels`` (``kernels.sinkhorn`` and ``kernels.hc_streams``) or ``torch`` (their
references, transformers' formulation); ``auto`` follows the attention's choice. They are the
largest count of small kernels in a decode step and, in PyTorch, a tenth of a prefill chunk.

``decode`` picks the decode step's layer loop (step/decode_step.py's ``DecodeLoop``): ``fused``
(the mHC passes and the attention's norms and RoPE as a few Triton kernels a layer,
step/fused_ops.py) or ``unfused`` (the loop prefill shares, one PyTorch op per step of the
formula); ``auto`` is ``fused`` where the attention
resolves to ``kernels`` (CUDA) and ``unfused`` elsewhere. On the H200 (2026-12-03, bf16,
43 layers x 128 experts, CUDA graphs) the fused loop's GPU tests passed and it decoded 52.1 /
216.4 / 468.5 tok/s at batch 1 / 8 / 32 against the unfused loop's 27.7 / 145.6 / 363.6, with
no device allocation after warm-up (lab/results/notebook.md).

Never decides anything from mutable global state: the choice is a frozen value handed down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import KernelChoices


@dataclass(frozen=True)
class V4Backend(KernelChoices):
    """The engine's ``KernelChoices`` (engine/config.py, where the allowed values live and are
    checked) as this family reads them; ``EngineConfig.kernels`` is the one way to set them."""

    @classmethod
    def of(cls, choices: KernelChoices) -> V4Backend:
        return cls(**dataclasses.asdict(choices))

    def resolved(self, device: torch.device) -> V4Backend:
        """'auto' -> 'kernels' on CUDA, 'torch' elsewhere (mhc: as the attention resolves;
        decode: fused with the kernels' attention, else unfused)."""
        default = "kernels" if device.type == "cuda" else "torch"
        attention = default if self.attention == "auto" else self.attention
        mhc = ("kernels" if attention == "kernels" else "torch") if self.mhc == "auto" else self.mhc
        return V4Backend(
            indexer=default if self.indexer == "auto" else self.indexer,
            attention=attention,
            gemm=default if self.gemm == "auto" else self.gemm,
            mhc=mhc,
            decode=(("fused" if attention == "kernels" else "unfused") if self.decode == "auto"
                    else self.decode),
            lanes=self.lanes,
        )
