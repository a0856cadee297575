"""Layer geometries: the one table of named shapes that the runner, the benchmarks and the tests use.

A geometry is four numbers read the same way for every layer kind:

| field | Mamba-2  | Gated DeltaNet / Kimi Delta Attention |
|-------|----------|----------------|
| ``H`` | nheads   | num_v_heads    |
| ``P`` | headdim  | head_v_dim (d_v) |
| ``N`` | dstate   | head_k_dim (d_k) |
| ``G`` | ngroups  | num_k_heads    |

so the state of a sequence is ``[H, P, N]`` (``[heads, d_v, d_k]``) in all, and ``G`` divides ``H``.

Kimi-Linear-48B-A3B: transformers' ``KimiLinearConfig`` defaults (its checkpoint is
moonshotai/Kimi-Linear-48B-A3B-Instruct) give ``linear_num_heads = 32`` and
``linear_head_dim = 128``, the same number of query, key and value heads, and the same head size
for keys and values: H = G = 32, P = N = 128.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Geometry(NamedTuple):
    """(H, P, N, G): heads, d_v, d_k, key groups (see the module docstring)."""

    H: int
    P: int
    N: int
    G: int

    @property
    def state_elems(self) -> int:
        """Elements of one sequence's state, H * P * N."""
        return self.H * self.P * self.N

    def describe(self, arch: str) -> dict:
        """The four numbers under the layer kind's own argument names."""
        if arch == "mamba2":
            return {"nheads": self.H, "headdim": self.P, "dstate": self.N, "ngroups": self.G}
        return {"num_v_heads": self.H, "head_v_dim": self.P, "head_k_dim": self.N, "num_k_heads": self.G}


@dataclass(frozen=True)
class Named:
    """A named geometry: the shape, the layer kind it belongs to (None: a test shape for both
    kinds) and the model it comes from."""

    geometry: Geometry
    arch: str | None
    model: str


#: Every named geometry. Model shapes are those of one state-space layer of the model.
GEOMETRIES: dict[str, Named] = {
    "tiny": Named(Geometry(4, 8, 16, 2), None, "unit-test shape"),
    "small": Named(Geometry(4, 16, 32, 2), None, "the runner's default shape"),
    "nemotron3-super": Named(Geometry(128, 64, 128, 8), "mamba2", "Nemotron-3-Super (Mamba-2)"),
    "nemotron3-nano": Named(Geometry(64, 64, 128, 8), "mamba2", "Nemotron-3-Nano (Mamba-2)"),
    "mamba2-2.7b": Named(Geometry(80, 64, 128, 1), "mamba2", "Mamba-2 2.7B"),
    "qwen35-122b": Named(Geometry(64, 128, 128, 16), "gdn", "Qwen3.5-122B (Gated DeltaNet)"),
    "qwen3-next": Named(Geometry(32, 128, 128, 16), "gdn", "Qwen3-Next (Gated DeltaNet)"),
    "kimi-linear-48b": Named(Geometry(32, 128, 128, 32), "kda", "Kimi-Linear-48B-A3B (Kimi Delta Attention)"),
}

#: The geometry each layer kind is benchmarked at unless told otherwise.
DEFAULT_MODEL = {"mamba2": "nemotron3-super", "gdn": "qwen35-122b", "kda": "kimi-linear-48b"}


def parse_geometry(text: str, arch: str = "all") -> tuple[str | None, Geometry]:
    """A name from ``GEOMETRIES`` or ``H,P,N,G``; returns (layer kind or None, geometry).

    ``arch`` ("mamba2", "gdn", "kda" or "all") is the layer kind asked for: a model geometry of the other
    kind is refused. Raises ValueError with a one-line message on anything else.
    """
    if text in GEOMETRIES:
        named = GEOMETRIES[text]
        if named.arch is not None and arch not in ("all", named.arch):
            raise ValueError(f"geometry {text} is a {named.arch} geometry, not {arch}")
        return named.arch, named.geometry
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 4 or min(vals) < 1 or vals[0] % vals[3]:
        raise ValueError(f"geometry must be one of {', '.join(GEOMETRIES)} or H,P,N,G "
                         f"(positive integers, G divides H), got {text!r}")
    return None, Geometry(*vals)


def name_of(arch: str, geometry) -> str:
    """The table's name for (arch, geometry), else ``arch H,P,N,G``."""
    geo = Geometry(*geometry)
    for name, named in GEOMETRIES.items():
        if named.arch in (arch, None) and named.geometry == geo:
            return name
    return f"{arch} {','.join(map(str, geo))}"
