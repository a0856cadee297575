"""Precision presets: which format holds the recurrence anchor and which the read copy.

A preset is (anchor format + its rounding, read format + its rounding, or shared). At every
refresh the new unrounded fp32 state S is cast *independently* into Q_anchor(S) and Q_read(S); the
read copy is never derived from the already-rounded anchor. In a shared preset there is one copy,
the anchor, and outputs read it.

| preset        | anchor (rounding)            | read copy                        |
|---------------|------------------------------|----------------------------------|
| `s32_rs`      | fp32                         | shared (the reference config)    |
| `fp16_rs`     | fp16, nearest-even           | shared                           |
| `bf16_rs`     | bf16, nearest-even           | shared                           |
| `tp16_hi32`   | fp32                         | fp16, nearest-even               |
| `tpbf16_hi32` | fp32                         | bf16, nearest-even               |
| `tp8_hi32`    | fp32                         | fp8-e4m3, 32-element block scale |
| `tp4_hi32`    | fp32                         | NVFP4, nearest-even              |
| `tp4_hi16_sr` | fp16, stochastic rounding    | NVFP4, nearest-even              |
| `f4_sr_rs`    | NVFP4, stochastic rounding   | shared                           |

"rs" = read shared; "tpX_hiY" = two precisions, X-bit read, Y-bit anchor; "sr" = stochastic
rounding of the anchor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # formats imports torch; the preset names and tolerances below do not need it
    from .formats import Format

ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class Precision:
    """A checkpoint precision configuration.

    anchor: format of the recurrence anchor (read only at refresh, materialize).
    anchor_rounding: "nearest" or "stochastic".
    read: format of the read copy that outputs use, or None when it is shared with the anchor.
    read_rounding: rounding of the read copy.
    """

    name: str
    anchor: Format
    anchor_rounding: str = "nearest"
    read: Format | None = None
    read_rounding: str = "nearest"

    def __post_init__(self):
        for arg in ("anchor_rounding", "read_rounding"):
            if getattr(self, arg) not in ROUNDINGS:
                raise ValueError(f"{arg} must be one of {ROUNDINGS}, got {getattr(self, arg)!r}")

    @property
    def shared(self) -> bool:
        return self.read is None

    @property
    def read_format(self) -> Format:
        return self.anchor if self.read is None else self.read

    @property
    def read_rounding_used(self) -> str:
        return self.anchor_rounding if self.read is None else self.read_rounding


#: Every preset: name -> (anchor format, anchor rounding, read format or None = shared, read rounding).
PRESET_TABLE: dict[str, tuple] = {
    "s32_rs": ("fp32", "nearest", None, "nearest"),
    "fp16_rs": ("fp16", "nearest", None, "nearest"),
    "bf16_rs": ("bf16", "nearest", None, "nearest"),
    "tp16_hi32": ("fp32", "nearest", "fp16", "nearest"),
    "tpbf16_hi32": ("fp32", "nearest", "bf16", "nearest"),
    "tp8_hi32": ("fp32", "nearest", "fp8_e4m3", "nearest"),
    "tp4_hi32": ("fp32", "nearest", "nvfp4", "nearest"),
    "tp4_hi16_sr": ("fp16", "stochastic", "nvfp4", "nearest"),
    "f4_sr_rs": ("nvfp4", "stochastic", None, "nearest"),
}
PRESET_NAMES = tuple(PRESET_TABLE)
_PRESETS: dict = {}


def _presets() -> dict:
    """``PRESETS``, built on first use (the formats need torch)."""
    if not _PRESETS:
        from .formats import get_format
        for name, (anchor, anchor_rounding, read, read_rounding) in PRESET_TABLE.items():
            _PRESETS[name] = Precision(name, get_format(anchor), anchor_rounding,
                                       None if read is None else get_format(read), read_rounding)
    return _PRESETS


def __getattr__(name):
    if name == "PRESETS":  # name -> Precision, every preset of PRESET_TABLE
        return _presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The presets ``replayssm run`` reports by default: the reference configuration, an fp8 read copy
#: over an fp32 anchor, an NVFP4 read copy over an fp16 stochastic-rounding anchor, and one shared
#: NVFP4 copy.
REPRODUCTION_PRESETS = ("s32_rs", "tp8_hi32", "tp4_hi16_sr", "f4_sr_rs")

# ------------------------------------------------------------------------------------------------
# Tolerances: the one table of error bounds that the runner, the benchmarks' gate and the tests use
# ------------------------------------------------------------------------------------------------
#: Max abs output error of ``s32_rs`` against the float64 recurrence, fp32 inputs and buffers,
#: unit-scale inputs, the small geometries (a large geometry has a longer fp32 rounding tail).
S32_MAX_ABS = 1e-5

#: Relative output error ||y - y_ref|| / ||y_ref|| allowed per storage format, with bf16 inputs
#: and buffers (the benchmarks' correctness gate); a preset gets the larger of its two formats'.
RELATIVE_TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.5e-2, "fp8_e4m3": 0.05, "nvfp4": 0.25}


def relative_tolerance(precision: "str | Precision") -> float:
    """The bound on the relative output error of ``precision`` (see ``RELATIVE_TOLERANCE``)."""
    p = get_precision(precision)
    return max(RELATIVE_TOLERANCE[p.read_format.name], RELATIVE_TOLERANCE[p.anchor.name])


def get_precision(precision: str | Precision) -> Precision:
    """Look up a preset by name, or pass a ``Precision`` through."""
    if isinstance(precision, Precision):
        return precision
    presets = _presets()
    if precision not in presets:
        raise ValueError(f"precision must be a Precision or one of {sorted(presets)}, got {precision!r}")
    return presets[precision]
