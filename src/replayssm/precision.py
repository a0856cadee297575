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

from .formats import Format, get_format

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


def _preset(name, anchor, anchor_rounding="nearest", read=None, read_rounding="nearest"):
    return Precision(name, get_format(anchor), anchor_rounding,
                     None if read is None else get_format(read), read_rounding)


PRESETS: dict[str, Precision] = {p.name: p for p in (
    _preset("s32_rs", "fp32"),
    _preset("fp16_rs", "fp16"),
    _preset("bf16_rs", "bf16"),
    _preset("tp16_hi32", "fp32", read="fp16"),
    _preset("tpbf16_hi32", "fp32", read="bf16"),
    _preset("tp8_hi32", "fp32", read="fp8_e4m3"),
    _preset("tp4_hi32", "fp32", read="nvfp4"),
    _preset("tp4_hi16_sr", "fp16", "stochastic", read="nvfp4"),
    _preset("f4_sr_rs", "nvfp4", "stochastic"),
)}

#: The four presets of the seed's reproduction table.
SEED_PRESETS = ("s32_rs", "tp8_hi32", "tp4_hi16_sr", "f4_sr_rs")


def get_precision(precision: str | Precision) -> Precision:
    """Look up a preset by name, or pass a ``Precision`` through."""
    if isinstance(precision, Precision):
        return precision
    if precision not in PRESETS:
        raise ValueError(f"precision must be a Precision or one of {sorted(PRESETS)}, got {precision!r}")
    return PRESETS[precision]
