"""GPU benchmarks: ``replayssm bench`` (``cli``), the measurements (``measure``), timing and the
traffic model (``suite``), the conventional baseline kernels (``conventional``), and the report
that turns bench JSON into BENCHMARKS.md, the README's headline table and the plots (``report``).

This module itself needs no GPU, no triton and no torch: it names the problem shape shared by the
others. Geometries come from ``replayssm.geometry`` (H, P, N, G for both layer kinds).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..geometry import Geometry


@dataclass
class Problem:
    """One benchmarked shape: layer kind, geometry (H, P, N, G), batch, tokens per step (T = 1: decode)."""

    arch: str
    dims: Geometry
    batch: int
    T: int

    def __post_init__(self):
        self.dims = Geometry(*self.dims)

    @property
    def state_elems(self) -> int:
        return self.dims.state_elems
