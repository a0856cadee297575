"""GPU benchmarks: ``replayssm bench`` (``cli``), the measurements (``measure``), timing and the
traffic model (``suite``), and the conventional baseline kernels (``conventional``).

This module itself needs no GPU and no triton: it names the real model geometries and the problem
shape shared by the others.
"""
from __future__ import annotations

from dataclasses import dataclass

GEOMETRIES = {
    # name: (arch, dims)   mamba2 dims = (H, P, N, G); gdn dims = (HK, HV, K, V)
    "nemotron3-super": ("mamba2", (128, 64, 128, 8)),
    "nemotron3-nano": ("mamba2", (64, 64, 128, 8)),
    "mamba2-2.7b": ("mamba2", (80, 64, 128, 1)),
    "qwen35-122b": ("gdn", (16, 64, 128, 128)),
    "qwen3-next": ("gdn", (16, 32, 128, 128)),
}


@dataclass
class Problem:
    """One benchmarked shape: architecture, dims, batch, tokens per step (T = 1: decode)."""

    arch: str
    dims: tuple
    batch: int
    T: int

    @property
    def state_elems(self) -> int:
        if self.arch == "mamba2":
            H, P, N, _ = self.dims
            return H * P * N
        _, HV, K, V = self.dims
        return HV * V * K
