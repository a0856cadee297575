"""Protocol v1 of ``replayssm run``: the configuration, the step/accept/pad schedule, the input
distributions and the presets to run. Nothing here touches a cache; ``checks`` drives them.

Every input comes from an explicit random seed (``--seeds``) and never depends on the preset, so
every preset sees bit-identical inputs; every draw is folded into a SHA-256, so two reports with
equal hashes ran on identical inputs.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import get_format
from ..geometry import Geometry
from ..layers import ARCHS, LAYERS  # noqa: F401  (LAYERS re-exported for checks)
from ..precision import PRESETS, S32_MAX_ABS, Precision

from . import PROTOCOL, SCHEMA  # noqa: F401  (re-exported)

#: The preset every "vs s32_rs" figure is measured against; it always runs first.
BASELINE = "s32_rs"
ARCH_TITLE = {"mamba2": "Mamba2", "gdn": "GDN", "kda": "KDA"}


@dataclass
class Config:
    """Everything a run depends on (the command line, validated)."""

    archs: tuple
    presets: tuple
    seeds: tuple
    steps: int
    window: int
    max_draft: int
    batch: int
    geometry: Geometry
    device: str
    backend: str | None
    controls: bool
    twin: bool
    drift_every: int
    check_every: int
    s32_limit: float = S32_MAX_ABS


# =================================================================================================
# The schedule
# =================================================================================================
@dataclass(frozen=True)
class Step:
    """One step of the schedule: a decode (T = 1) or a speculative round of T drafts.

    ``slots``: slot id per batch row (-1 = pad); ``accept``: accepted drafts per row (rounds).
    """

    index: int
    speculative: bool
    T: int
    slots: tuple
    accept: tuple = ()


class Schedule:
    """The protocol-v1 schedule for ``batch`` live sequences, ``steps`` steps, drafts <= ``max_draft``.

    - Batch rows: live sequence i sits in slot ``batch - 1 - i`` (slot ids differ from row
      numbers); one permanent pad row (-1) is inserted at row 1. The cache has ``batch + 1`` slots
      (one never used).
    - Step s is a standard decode when s is even, else speculative round r = s // 2 with
      T = ``max_draft`` (every third round: min(2, max_draft)) and sequence i accepting
      (r + i) mod (T + 1) drafts: zero, partial and full acceptance recur for every sequence and
      appear side by side in one batch, so the sequences sit at different window positions.
    - The last live sequence is paused (its row is a pad) on every step s with s % 7 == 6.
    """

    def __init__(self, batch: int, steps: int, max_draft: int):
        self.batch, self.steps, self.max_draft = batch, steps, max_draft
        self.num_slots = batch + 1
        self.rows = batch + 1
        self.pad_row = 1 if batch >= 1 else 0
        seq_slots = [batch - 1 - i for i in range(batch)]
        self.row_seq = list(range(batch))
        self.row_seq.insert(self.pad_row, None)  # row -> live sequence index (None = permanent pad)
        self.base_slots = tuple(-1 if s is None else seq_slots[s] for s in self.row_seq)

    def __iter__(self):
        for s in range(self.steps):
            paused = s % 7 == 6
            slots = tuple(-1 if (q is None or (paused and q == self.batch - 1)) else sl
                          for q, sl in zip(self.row_seq, self.base_slots))
            if s % 2 == 0:
                yield Step(s, False, 1, slots)
                continue
            r = s // 2
            T = min(2, self.max_draft) if r % 3 == 2 else self.max_draft
            accept = tuple(0 if sl < 0 else (r + q) % (T + 1) for q, sl in zip(self.row_seq, slots))
            yield Step(s, True, T, slots, accept)

    def describe(self) -> dict:
        return {"batch_slots": list(self.base_slots), "num_slots": self.num_slots,
                "decode_steps": "even steps", "speculative_rounds": "odd steps s, round r = s // 2",
                "draft_len": f"{self.max_draft} (every third round: {min(2, self.max_draft)})",
                "accept": "(r + i) mod (T + 1) for live sequence i",
                "pause": f"sequence {self.batch - 1} is a pad on steps s % 7 == 6",
                "permanent_pad_row": self.pad_row}

    def counts(self) -> dict:
        """Committed tokens and acceptance kinds per round type, summed over live sequences."""
        out = {"decode": {"steps": 0, "tokens": 0},
               "speculative": {"rounds": 0, "drafted": 0, "accepted": 0, "zero": 0, "partial": 0, "full": 0},
               "paused_rows": 0}
        for st in self:
            real = [i for i, s in enumerate(st.slots) if s >= 0]
            out["paused_rows"] += sum(1 for i, s in enumerate(st.slots) if s < 0 and i != self.pad_row)
            if not st.speculative:
                out["decode"]["steps"] += 1
                out["decode"]["tokens"] += len(real)
                continue
            sp = out["speculative"]
            sp["rounds"] += 1
            for i in real:
                a = st.accept[i]
                sp["drafted"] += st.T
                sp["accepted"] += a
                sp["zero" if a == 0 else "full" if a == st.T else "partial"] += 1
        return out


# =================================================================================================
# Input distributions
# =================================================================================================
class Draw:
    """Float32 draws on the CPU from an explicit random seed; every draw is folded into a SHA-256."""

    def __init__(self, seed: int, arch: str):
        self.gen = torch.Generator().manual_seed(seed * 1000 + ARCHS.index(arch))
        self.hash = hashlib.sha256(f"{PROTOCOL}|{arch}|{seed}".encode())

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        self.hash.update(t.contiguous().numpy().tobytes())
        return t

    def normal(self, shape, std=1.0, mean=0.0):
        return self._keep(mean + std * torch.randn(shape, generator=self.gen, dtype=torch.float32))

    def uniform(self, shape, lo, hi):
        return self._keep(lo + (hi - lo) * torch.rand(shape, generator=self.gen, dtype=torch.float32))

    def log_uniform(self, shape, lo, hi):
        return self._keep(torch.exp(math.log(lo) + (math.log(hi) - math.log(lo))
                                    * torch.rand(shape, generator=self.gen, dtype=torch.float32)))

    def note(self, text: str):
        self.hash.update(text.encode())


def _inverse_softplus(y):
    return y + torch.log(-torch.expm1(-y))


class Mamba2Inputs:
    """Protocol-v1 Mamba-2 inputs.

    Constants (per head): A = -U(1, 16); dt_bias = softplus^-1(dt0), dt0 log-uniform in
    [1e-3, 1e-1] (mamba_ssm's initialization ranges); D ~ U(0.5, 1.5).
    Tokens: x, z ~ N(0, 1) [H, P]; dt_raw ~ N(0, 0.5^2) [H] (dt = softplus(dt_raw + dt_bias),
    applied inside the call); B, C ~ N(0, 1) [G, N]. Decays alpha = exp(A dt) spread over (0, 1).
    Initial state: N(0, dt0 / (2|A|)) per head, about the recurrence's stationary scale.
    """

    def __init__(self, geo: Geometry, draw: Draw):
        self.geo = geo
        H = geo.H
        self.A = draw.uniform((H,), -16.0, -1.0)
        self.dt0 = draw.log_uniform((H,), 1e-3, 1e-1)
        dt_bias = _inverse_softplus(self.dt0)
        D = draw.uniform((H,), 0.5, 1.5)
        self.consts = {"A": self.A, "D": D, "dt_bias": dt_bias}

    def initial_state(self, draw: Draw, b: int):
        g = self.geo
        std = torch.sqrt(self.dt0 / (2 * self.A.abs()))
        return draw.normal((b, g.H, g.P, g.N)) * std[None, :, None, None]

    def tokens(self, draw: Draw, b: int, T: int) -> dict:
        g = self.geo
        return {"x": draw.normal((b, T, g.H, g.P)), "dt": draw.normal((b, T, g.H), 0.5),
                "B": draw.normal((b, T, g.G, g.N)), "C": draw.normal((b, T, g.G, g.N)),
                "z": draw.normal((b, T, g.H, g.P))}


class GDNInputs:
    """Protocol-v1 Gated DeltaNet inputs.

    Constants (per value head): A ~ U(1, 16); dt_bias = softplus^-1(dt0), dt0 log-uniform in
    [1e-3, 1e-1]. Tokens: q, k ~ N(0, 1) [G, N], L2-normalized inside the call
    (``use_qk_l2norm=True``, scale N^-1/2); v ~ N(0, 1) [H, P]; g = -A softplus(a + dt_bias) with
    a ~ N(0, 0.5^2) (Qwen3-Next gating), so decays exp(g) spread over (0, 1);
    beta = sigmoid(N(0, 1)). Initial state N(0, 1/N).
    """

    def __init__(self, geo: Geometry, draw: Draw):
        self.geo = geo
        self.A = draw.uniform((geo.H,), 1.0, 16.0)
        self.dt_bias = _inverse_softplus(draw.log_uniform((geo.H,), 1e-3, 1e-1))
        self.consts = {}

    def initial_state(self, draw: Draw, b: int):
        g = self.geo
        return draw.normal((b, g.H, g.P, g.N), g.N ** -0.5)

    def tokens(self, draw: Draw, b: int, T: int) -> dict:
        g = self.geo
        q, k = draw.normal((b, T, g.G, g.N)), draw.normal((b, T, g.G, g.N))
        v = draw.normal((b, T, g.H, g.P))
        a = draw.normal((b, T, g.H), 0.5)
        gate = -self.A * F.softplus(a + self.dt_bias)
        beta = torch.sigmoid(draw.normal((b, T, g.H)))
        return {"q": q, "k": k, "v": v, "g": gate, "beta": beta}


class KDAInputs:
    """Protocol-v1 Kimi Delta Attention inputs (Kimi-Linear's gating, per key channel).

    Constants: A ~ U(1, 16) per value head; dt_bias = softplus^-1(dt0) per (value head, key
    channel), dt0 log-uniform in [1e-3, 1e-1]. Tokens: q, k ~ N(0, 1) [G, N], L2-normalized inside
    the call (``use_qk_l2norm=True``, scale N^-1/2); v ~ N(0, 1) [H, P];
    g = -A softplus(a + dt_bias) with a ~ N(0, 0.5^2) [H, N], so the channels of one head decay at
    different rates spread over (0, 1); beta = sigmoid(N(0, 1)) [H]. Initial state N(0, 1/N).
    """

    def __init__(self, geo: Geometry, draw: Draw):
        self.geo = geo
        self.A = draw.uniform((geo.H,), 1.0, 16.0)
        self.dt_bias = _inverse_softplus(draw.log_uniform((geo.H, geo.N), 1e-3, 1e-1))
        self.consts = {}

    def initial_state(self, draw: Draw, b: int):
        g = self.geo
        return draw.normal((b, g.H, g.P, g.N), g.N ** -0.5)

    def tokens(self, draw: Draw, b: int, T: int) -> dict:
        g = self.geo
        q, k = draw.normal((b, T, g.G, g.N)), draw.normal((b, T, g.G, g.N))
        v = draw.normal((b, T, g.H, g.P))
        a = draw.normal((b, T, g.H, g.N), 0.5)
        gate = -self.A[:, None] * F.softplus(a + self.dt_bias)
        beta = torch.sigmoid(draw.normal((b, T, g.H)))
        return {"q": q, "k": k, "v": v, "g": gate, "beta": beta}


INPUTS = {"mamba2": Mamba2Inputs, "gdn": GDNInputs, "kda": KDAInputs}


# =================================================================================================
# Presets and control runs
# =================================================================================================
def anchor_key(p: Precision) -> tuple:
    return (p.anchor.name, p.anchor_rounding)


def read_key(p: Precision) -> tuple:
    return (p.read_format.name, p.read_rounding_used)


def describe_precision(p: Precision) -> dict:
    return {"anchor": p.anchor.name, "anchor_rounding": p.anchor_rounding,
            "read": None if p.shared else p.read.name,
            "read_rounding": None if p.shared else p.read_rounding}


def plan_presets(names, controls: bool):
    """The presets to run: ``s32_rs`` first (the baseline of every "vs s32_rs" figure), then the
    requested ones, then (``controls``) one control per anchor format that no other requested
    preset shares, so that check (c) compares two read formats over every anchor format.

    Returns a list of (Precision, is_control).
    """
    plan = [PRESETS[BASELINE]] + [PRESETS[n] for n in names if n != BASELINE]
    out = [(p, False) for p in plan]
    if not controls:
        return out
    for key in dict.fromkeys(anchor_key(p) for p in plan):
        group = [q for q in plan if anchor_key(q) == key]
        if len({read_key(q) for q in group}) > 1:
            continue
        p = group[0]
        # an existing preset with the same anchor and another read format, else a synthetic one
        ctl = next((q for q in PRESETS.values() if anchor_key(q) == key and read_key(q) != read_key(p)), None)
        if ctl is None:
            read = "fp16" if p.anchor.name == "fp32" else "fp32"
            sr = "sr" if p.anchor_rounding == "stochastic" else ""
            ctl = Precision(f"ctl_{p.anchor.name}{sr}_r{read[2:]}", p.anchor, p.anchor_rounding,
                            get_format(read), "nearest")
        out.append((ctl, True))
    return out
