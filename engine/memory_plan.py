"""The memory plan's vocabulary: a ``PlanTerm`` (one named amount of device memory with its
formula) and the ``MemoryPlan`` they add up to, with its budget and the error that names what
to change when it does not fit.

A leaf of the engine: the families write terms, the planner (engine/memory_planner.py) builds
the plan, the runner, the engine and ``bulkhead plan`` read it; none of them needs the others
for that. Computes nothing from a model or a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.kv_layout import KVLayout

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class PlanTerm:
    name: str
    bytes: int
    formula: str
    in_workspace: bool = False  # a slice of the workspace arena, not a separate allocation
    # memory another process owns and this one maps (shared weights): listed, not in the total
    mapped: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    terms: tuple[PlanTerm, ...]
    device: str
    device_memory_bytes: int
    kv_layout: KVLayout
    num_blocks: int
    # the resolved configuration planned: its limits (max_context, max_batch, chunk_tokens) and
    # budget (memory_utilization, memory_share) are read from it, not copied into the plan
    config: EngineConfig

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV extent holds, all sequences together (the null block excluded)."""
        return (self.num_blocks - 1) * self.kv_layout.block_size

    @property
    def kv_tokens_per_gib(self) -> float:
        return GiB / self.kv_layout.bytes_per_token

    def term(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.name == name)

    @property
    def workspace_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.in_workspace)

    @property
    def total_bytes(self) -> int:
        """What this process owns on the device (mapped terms excluded)."""
        return sum(t.bytes for t in self.terms if not t.mapped)

    @property
    def mapped_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.mapped)

    @property
    def budget_bytes(self) -> int:
        """``memory_utilization`` of the device; with a ``memory_share`` below 1 (the roles of
        one card), that share of what the one copy of the weights leaves, plus the weights
        when this process owns them."""
        whole = int(self.device_memory_bytes * self.config.memory_utilization)
        if self.config.memory_share >= 1:
            return whole
        owned = self.term("weights")
        return int(self.config.memory_share * max(0, whole - owned - self.mapped_bytes)) + owned

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def check(self) -> None:
        if self.fits:
            return
        c = self.config
        weights = self.term("weights")
        if weights >= self.budget_bytes:
            raise PlanError(
                f"memory plan does not fit: the weights alone are {weights / GiB:.2f} GiB, the "
                f"budget {self.budget_bytes / GiB:.2f} GiB ({c.memory_utilization:.0%} of "
                f"{self.device_memory_bytes / GiB:.2f} GiB on {self.device}): split the model "
                "over more devices (tensor_parallel_size) or use a quantized checkpoint")
        kv = self.term("kv_cache")
        raise PlanError(
            f"memory plan does not fit: needs {self.total_bytes / GiB:.2f} GiB, budget is "
            f"{self.budget_bytes / GiB:.2f} GiB ({c.memory_utilization:.0%} of "
            f"{self.device_memory_bytes / GiB:.2f} GiB on {self.device}"
            + (f", {c.memory_share:g} of what the weights leave" if c.memory_share < 1 else "")
            + "). Largest terms: "
            + ", ".join(f"{t.name}={t.bytes / GiB:.2f} GiB"
                        for t in sorted(self.terms, key=lambda t: -t.bytes)[:3])
            + f". Lower max_context ({c.max_context}), max_batch ({c.max_batch}) or "
            f"num_blocks (KV is {kv / GiB:.2f} GiB), lower chunk_tokens ({c.chunk_tokens}), "
            "or use a smaller dtype.")

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "memory_utilization": self.config.memory_utilization,
            "memory_share": self.config.memory_share,
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.total_bytes,
            "headroom_bytes": self.headroom_bytes,
            "mapped_bytes": self.mapped_bytes,
            "max_context": self.config.max_context,
            "chunk_tokens": self.config.chunk_tokens,
            "max_batch": self.config.max_batch,
            "num_blocks": self.num_blocks,
            "block_size": self.kv_layout.block_size,
            "kv_bytes_per_block": self.kv_layout.bytes_per_block,
            "kv_bytes_per_token": self.kv_layout.bytes_per_token,
            "kv_tokens": self.kv_tokens,
            "kv_tokens_per_gib": self.kv_tokens_per_gib,
            "kv_layout_fingerprint": self.kv_layout.fingerprint,
            "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula,
                       "in_workspace": t.in_workspace, "mapped": t.mapped}
                      for t in self.terms],
        }

    def summary(self) -> str:
        """One line for the start-up log: the total against the budget and the KV extent."""
        c = self.config
        return (f"{self.total_bytes / 2**20:,.0f} MiB of a {self.budget_bytes / 2**20:,.0f} MiB "
                f"budget, max_context {c.max_context:,}, max_batch {c.max_batch}, KV "
                f"extent {self.num_blocks} blocks of {self.kv_layout.block_size} tokens "
                f"({self.kv_tokens:,} tokens, {self.kv_layout.bytes_per_token:,.0f} B a token, "
                f"kv_dtype {c.kv_dtype})")

    def table(self) -> str:
        rows = [f"{'term':<22}{'bytes':>16}{'GiB':>10}  formula"]
        for t in self.terms:
            note = "  [mapped: another process owns it; not in the total]" if t.mapped else ""
            rows.append(f"{t.name:<22}{t.bytes:>16,}{t.bytes / GiB:>10.3f}  {t.formula}{note}")
        rows.append(f"{'total':<22}{self.total_bytes:>16,}{self.total_bytes / GiB:>10.3f}")
        c = self.config
        share = f", {c.memory_share:g} of what the weights leave" if c.memory_share < 1 else ""
        rows.append(f"{'budget':<22}{self.budget_bytes:>16,}{self.budget_bytes / GiB:>10.3f}  "
                    f"{c.memory_utilization} x {self.device_memory_bytes:,} ({self.device})"
                    + share)
        rows.append(f"{'kv tokens':<22}{self.kv_tokens:>16,}  in {self.num_blocks - 1:,} blocks of "
                    f"{self.kv_layout.block_size} ({self.kv_layout.bytes_per_token:,.1f} B a token, "
                    f"{self.kv_tokens_per_gib:,.0f} tokens per GiB)")
        rows.append(f"{'headroom':<22}{self.headroom_bytes:>16,}{self.headroom_bytes / GiB:>10.3f}")
        return "\n".join(rows)
