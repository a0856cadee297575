"""``replayssm run``: the seeded reproduction protocol, its invariant checks and its report.

The runner drives every requested precision preset of a ReplaySSM cache (Mamba-2 and/or Gated
DeltaNet) through one fixed, versioned schedule of standard decodes and speculative rounds, on
inputs drawn from an explicit seed, beside the float64 conventional recurrence (the oracle) run
on the committed tokens. It measures errors, checks the invariants of the design, writes a JSON
report and prints tables. ``docs/runner.md`` documents the protocol and every number.

Structure (top to bottom):

- ``Geometry``, ``Schedule``, ``Draw`` and the two ``*Arch`` adapters define protocol v1: shapes,
  the step/accept/pad schedule, the input distributions, the public calls and the oracle.
- ``PresetRun`` holds one preset's caches (the main cache and its *twin*, fed different rejected
  drafts) and its accumulators; ``run_case`` runs all presets of one (arch, seed) in lockstep.
- ``build_report`` / ``print_report`` / ``compare_reports`` / ``plot_drift`` turn results into
  JSON, tables and the drift plot; ``add_arguments`` wires the command line.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import __version__
from .formats import get_format
from .gdn.cache import GDNCache
from .gdn.ops import gdn_decode, gdn_verify
from .gdn.reference import gdn_reference_step
from .mamba2.cache import Mamba2Cache
from .mamba2.ops import mamba2_decode, mamba2_verify
from .mamba2.reference import mamba2_reference_step
from .precision import PRESETS, SEED_PRESETS, Precision

PROTOCOL = "replayssm-protocol-v1"
#: Version of the JSON layout (bumped when a field changes meaning or moves).
SCHEMA = 1
#: Check (a): max abs output error of s32_rs vs the float64 recurrence.
S32_OUTPUT_LIMIT = 1e-5
BASELINE = "s32_rs"
ARCHS = ("mamba2", "gdn")
ARCH_TITLE = {"mamba2": "Mamba2", "gdn": "GDN"}

#: Named geometries (H, P, N, G), read per architecture as
#: Mamba-2: nheads H, headdim P, dstate N, ngroups G;
#: GDN: num_v_heads H, head_v_dim P, head_k_dim N, num_k_heads G.
GEOMETRIES = {
    "small": (4, 16, 32, 2),
    "nemotron": (128, 64, 128, 8),
    "qwen35": (64, 128, 128, 16),
}

#: (id, name, what it asserts) of every invariant check, in report order.
CHECKS = (
    ("a", "s32_output_error", "s32_rs output max abs error vs float64 <= --s32-limit (default 1e-5)"),
    ("b", "zero_accept_anchor", "a zero-accept round leaves anchor and read copy bit-identical"),
    ("c", "anchor_independent_of_read",
     "presets sharing an anchor format have bit-identical anchors; their read formats change outputs"),
    ("d", "rejected_drafts",
     "a twin fed different rejected drafts keeps bit-identical committed state, anchors and outputs"),
    ("e", "finite", "no NaN/Inf in outputs, committed states, anchors, read copies"),
    ("f", "independent_read_cast", "each refreshed read copy is Q_read(S) of the unrounded state S"),
    ("x", "completed", "the run finished without an exception"),
)
CHECK_NAMES = {cid: name for cid, name, _ in CHECKS}


# =================================================================================================
# Protocol v1: geometry, schedule, input distributions
# =================================================================================================
@dataclass(frozen=True)
class Geometry:
    """(H, P, N, G); see ``GEOMETRIES`` for the per-architecture reading."""

    H: int
    P: int
    N: int
    G: int

    @classmethod
    def parse(cls, text: str) -> "Geometry":
        if text in GEOMETRIES:
            return cls(*GEOMETRIES[text])
        try:
            vals = tuple(int(v) for v in text.split(","))
        except ValueError:
            vals = ()
        if len(vals) != 4 or min(vals) < 1 or vals[0] % vals[3]:
            raise argparse.ArgumentTypeError(
                f"geometry must be one of {sorted(GEOMETRIES)} or H,P,N,G (positive, G divides H), got {text!r}")
        return cls(*vals)

    def describe(self, arch: str) -> dict:
        if arch == "mamba2":
            return {"nheads": self.H, "headdim": self.P, "dstate": self.N, "ngroups": self.G}
        return {"num_v_heads": self.H, "head_v_dim": self.P, "head_k_dim": self.N, "num_k_heads": self.G}


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


class Draw:
    """Seeded float32 draws on the CPU; every draw is folded into a SHA-256 of the inputs."""

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


class Mamba2Arch:
    """Protocol-v1 Mamba-2 layer: constants, per-token inputs, public calls, float64 oracle.

    Constants (per head): A = -U(1, 16); dt_bias = softplus^-1(dt0), dt0 log-uniform in
    [1e-3, 1e-1] (mamba_ssm's initialization ranges); D ~ U(0.5, 1.5).
    Tokens: x, z ~ N(0, 1) [H, P]; dt_raw ~ N(0, 0.5^2) [H] (dt = softplus(dt_raw + dt_bias),
    applied inside the call); B, C ~ N(0, 1) [G, N]. Decays alpha = exp(A dt) spread over (0, 1).
    Initial state: N(0, dt0 / (2|A|)) per head, about the recurrence's stationary scale.
    """

    name = "mamba2"
    fields = ("x", "dt", "B", "C", "z")

    def __init__(self, geo: Geometry, draw: Draw, device):
        self.geo, self.device = geo, device
        H = geo.H
        self.A = draw.uniform((H,), -16.0, -1.0)
        self.dt0 = draw.log_uniform((H,), 1e-3, 1e-1)
        self.dt_bias = _inverse_softplus(self.dt0)
        self.D = draw.uniform((H,), 0.5, 1.5)
        self.consts = {k: v.to(device) for k, v in (("A", self.A), ("D", self.D), ("dt_bias", self.dt_bias))}

    def initial_state(self, draw: Draw, b: int):
        g = self.geo
        std = torch.sqrt(self.dt0 / (2 * self.A.abs()))
        return draw.normal((b, g.H, g.P, g.N)) * std[None, :, None, None]

    def tokens(self, draw: Draw, b: int, T: int) -> dict:
        g = self.geo
        return {"x": draw.normal((b, T, g.H, g.P)), "dt": draw.normal((b, T, g.H), 0.5),
                "B": draw.normal((b, T, g.G, g.N)), "C": draw.normal((b, T, g.G, g.N)),
                "z": draw.normal((b, T, g.H, g.P))}

    def cache(self, precision, num_slots, window, max_draft, device, seed):
        g = self.geo
        return Mamba2Cache(num_slots, g.H, g.P, g.N, ngroups=g.G, window=window, max_draft=max_draft,
                           precision=precision, device=device, seed=seed)

    def call(self, cache, slots, tok, verify: bool, backend):
        c = self.consts
        if verify:
            return mamba2_verify(cache, slots, tok["x"], tok["dt"], c["A"], tok["B"], tok["C"], c["D"],
                                 tok["z"], c["dt_bias"], True, backend=backend)
        t = {k: v[:, 0] for k, v in tok.items()}
        return mamba2_decode(cache, slots, t["x"], t["dt"], c["A"], t["B"], t["C"], c["D"], t["z"],
                             c["dt_bias"], True, backend=backend)[:, None]

    def reference_step(self, state, tok, t: int):
        c = self.consts
        return mamba2_reference_step(state, tok["x"][:, t], tok["dt"][:, t], c["A"], tok["B"][:, t],
                                     tok["C"][:, t], c["D"], tok["z"][:, t], c["dt_bias"], True)


class GDNArch:
    """Protocol-v1 Gated DeltaNet layer.

    Constants (per value head): A ~ U(1, 16); dt_bias = softplus^-1(dt0), dt0 log-uniform in
    [1e-3, 1e-1]. Tokens: q, k ~ N(0, 1) [G, N], L2-normalized inside the call
    (``use_qk_l2norm=True``, scale N^-1/2); v ~ N(0, 1) [H, P]; g = -A softplus(a + dt_bias) with
    a ~ N(0, 0.5^2) (Qwen3-Next gating), so decays exp(g) spread over (0, 1);
    beta = sigmoid(N(0, 1)). Initial state N(0, 1/N).
    """

    name = "gdn"
    fields = ("q", "k", "v", "g", "beta")

    def __init__(self, geo: Geometry, draw: Draw, device):
        self.geo, self.device = geo, device
        self.A = draw.uniform((geo.H,), 1.0, 16.0)
        self.dt_bias = _inverse_softplus(draw.log_uniform((geo.H,), 1e-3, 1e-1))

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

    def cache(self, precision, num_slots, window, max_draft, device, seed):
        g = self.geo
        return GDNCache(num_slots, g.G, g.H, g.N, g.P, window=window, max_draft=max_draft,
                        precision=precision, device=device, seed=seed)

    def call(self, cache, slots, tok, verify: bool, backend):
        if verify:
            return gdn_verify(cache, slots, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"],
                              use_qk_l2norm=True, backend=backend)
        t = {k: v[:, 0] for k, v in tok.items()}
        return gdn_decode(cache, slots, t["q"], t["k"], t["v"], t["g"], t["beta"],
                          use_qk_l2norm=True, backend=backend)[:, None]

    def reference_step(self, state, tok, t: int):
        return gdn_reference_step(state, tok["q"][:, t], tok["k"][:, t], tok["v"][:, t],
                                  tok["g"][:, t], tok["beta"][:, t], use_qk_l2norm=True)


ARCH_CLASSES = {"mamba2": Mamba2Arch, "gdn": GDNArch}


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


# =================================================================================================
# One (arch, seed): all presets in lockstep
# =================================================================================================
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _parts_rows(parts, rows) -> dict:
    return {k: v[rows].clone() for k, v in parts.items()}


def _parts_equal(p: dict, q: dict) -> bool:
    return p.keys() == q.keys() and all(torch.equal(_bytes(p[k]), _bytes(q[k])) for k in p)


class _Acc:
    """Max abs and sum of squares of an error over many tensors (host floats)."""

    def __init__(self):
        self.max, self.sumsq, self.n = 0.0, 0.0, 0

    def add(self, err: torch.Tensor):
        if err.numel():
            e = err.double()
            self.max = max(self.max, float(e.abs().max()))
            self.sumsq += float((e * e).sum())
            self.n += e.numel()

    @property
    def rms(self):
        return math.sqrt(self.sumsq / self.n) if self.n else None

    def max_or_none(self):
        return self.max if self.n else None


@dataclass
class _Check:
    """Per-run evidence for one check: evaluations, failures, the figure, the first failure."""

    evaluated: int = 0
    failed: int = 0
    figure: float | None = None
    detail: str = ""

    def record(self, ok: bool, detail: str = ""):
        self.evaluated += 1
        if not ok:
            self.failed += 1
            if not self.detail:
                self.detail = detail


@dataclass
class PresetRun:
    """One preset's main cache, its twin, and everything measured about it."""

    precision: Precision
    control: bool
    main: object
    twin: object | None  # None for control presets (they exist for check (c) only)
    check_cast: bool
    wall: float = 0.0
    out_f64: _Acc = field(default_factory=_Acc)
    out_s32: _Acc = field(default_factory=_Acc)
    anchor_f64: _Acc = field(default_factory=_Acc)
    anchor_s32: _Acc = field(default_factory=_Acc)
    read_f64: _Acc = field(default_factory=_Acc)
    state_f64: _Acc = field(default_factory=_Acc)
    drift: dict = field(default_factory=dict)  # refresh index -> [sumsq, sumsq_s32, n, ref_sumsq, tokens, rows]
    checks: dict = field(default_factory=lambda: {c: _Check() for c in "bdef"})


@dataclass
class Config:
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
    s32_limit: float = S32_OUTPUT_LIMIT


class Progress:
    """A one-line progress bar on stderr, drawn only on a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.t0 = self.last = time.perf_counter()
        self.label = ""

    def update(self, n=1, label=None):
        self.done += n
        if label is not None:
            self.label = label
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            frac = self.done / self.total
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r[{bar:<30}] {100 * frac:5.1f}% {self.label:<24} {now - self.t0:6.1f}s")
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_case(arch_name: str, seed: int, cfg: Config, plan, progress: Progress) -> dict:
    """Run every preset of ``plan`` for one (arch, seed) over the protocol schedule.

    Returns {"input_sha256", "runs": [...], "checks": [...]} (see ``build_report``).
    """
    dev = torch.device(cfg.device)
    draw = Draw(seed, arch_name)
    arch = ARCH_CLASSES[arch_name](cfg.geometry, draw, dev)
    sched = Schedule(cfg.batch, cfg.steps, cfg.max_draft)
    draw.note(json.dumps([cfg.geometry.H, cfg.geometry.P, cfg.geometry.N, cfg.geometry.G, cfg.batch,
                          cfg.steps, cfg.max_draft]))
    b = sched.rows
    S0 = arch.initial_state(draw, b).to(dev)
    base_slots = torch.tensor(sched.base_slots, dtype=torch.int64, device=dev)
    live = base_slots >= 0
    live_slots = base_slots[live]
    slot_seeds = (seed * 4096 + base_slots.clamp(min=0)).to(torch.int64)

    runs: list[PresetRun] = []
    for p, control in plan:
        caches = [arch.cache(p, sched.num_slots, cfg.window, cfg.max_draft, dev, seed)
                  for _ in range(2 if cfg.twin and not control else 1)]
        for c in caches:
            c.load_state(base_slots, S0, seeds=slot_seeds)
        cast = not p.shared and p.read_rounding == "nearest"
        runs.append(PresetRun(p, control, caches[0], caches[1] if len(caches) > 1 else None, cast))
    base = runs[0]
    assert base.precision.name == BASELINE
    groups = {}
    for r in runs:
        groups.setdefault(anchor_key(r.precision), []).append(r)
    groups = {k: g for k, g in groups.items() if len(g) > 1}
    c_check = _Check()
    out_diff = {}  # (name_p, name_q) -> max |y_p - y_q| over the run, pairs with different reads

    # the read copy written by load_state is the independent cast of S0
    for r in runs:
        if r.check_cast:
            exp = r.precision.read.encode(S0[live].float(), "nearest")
            r.checks["f"].record(_parts_equal(exp, _parts_rows(r.main.read_copy, live_slots)),
                                 "read copy after load_state != Q_read(S0)")

    ref = S0.double()
    ref_sq = 0.0
    ref_n = 0
    for step in sched:
        slots = torch.tensor(step.slots, dtype=torch.int64, device=dev)
        valid = slots >= 0
        T = step.T
        draw.note(f"|{step.index}:{int(step.speculative)}:{T}:{step.slots}:{step.accept}")
        tok = {k: v.to(dev) for k, v in arch.tokens(draw, b, T).items()}
        if step.speculative:
            n = torch.tensor(step.accept, dtype=torch.int64, device=dev)
            alt = {k: v.to(dev) for k, v in arch.tokens(draw, b, T).items()}
            keep = torch.arange(T, device=dev)[None, :] < n[:, None]  # [b, T] accepted drafts
            tok_twin = {k: torch.where(keep.view(b, T, *([1] * (v.dim() - 2))), v, alt[k])
                        for k, v in tok.items()}
        else:
            n = valid.long()
            keep = valid[:, None]
            tok_twin = tok
        keep = keep & valid[:, None]

        # ---- float64 oracle: outputs of all T tokens, committed state after the accepted ones
        ref_pre = ref
        states, ys = [ref], []
        for t in range(T):
            y_t, st = arch.reference_step(states[-1], tok, t)
            ys.append(y_t)
            states.append(st)
        y_ref = torch.stack(ys, 1)
        picked = torch.stack(states, 0)[n, torch.arange(b, device=dev)]
        ref = torch.where(valid.view(-1, 1, 1, 1), picked, ref_pre)
        yv = y_ref[valid]
        ref_sq += float((yv * yv).sum())
        ref_n += yv.numel()

        # ---- every preset takes the step
        y_of = {}
        check_state = (step.index % cfg.check_every == 0) or step.index == cfg.steps - 1
        for r in runs:
            before = r.main.counters(slots)
            h = before["committed"]
            need = valid & (h + T > cfg.window)
            s_pre = r.main.materialize(slots) if r.check_cast and bool(need.any()) else None
            zero = valid & (n == 0) if step.speculative else torch.zeros_like(valid)
            zrows = slots[zero]
            snaps = []

            def snap():
                parts = _parts_rows(r.main.anchor, zrows)
                if r.main.read_copy is not None:
                    parts.update({f"read.{k}": v for k, v in _parts_rows(r.main.read_copy, zrows).items()})
                return parts

            if zrows.numel():
                snaps.append(snap())
            _sync(dev)
            t0 = time.perf_counter()
            y = arch.call(r.main, slots, tok, step.speculative, cfg.backend)
            if step.speculative:
                if zrows.numel():
                    _sync(dev)
                    r.wall += time.perf_counter() - t0
                    snaps.append(snap())
                    t0 = time.perf_counter()
                r.main.accept(slots, n)
            _sync(dev)
            r.wall += time.perf_counter() - t0
            y_of[r.precision.name] = y
            if r.twin is not None:
                y_tw = arch.call(r.twin, slots, tok_twin, step.speculative, cfg.backend)
                if step.speculative:
                    r.twin.accept(slots, n)
            after = r.main.counters(slots)
            where = f"step {step.index}"

            # (b) zero-accept rounds: accept(0) changes nothing; without a refresh the whole
            # verify + accept leaves anchor and read copy bit-identical
            if zrows.numel():
                snaps.append(snap())
                no_refresh = bool((after["refreshes"][zero] == before["refreshes"][zero]).all())
                # a refresh at the start of the verify legitimately rewrote the checkpoint and
                # emptied the committed history; accept(0) must then leave h = 0
                h_expect = before["committed"][zero] if no_refresh else torch.zeros_like(h[zero])
                ok = (_parts_equal(snaps[1], snaps[2]) and (not no_refresh or _parts_equal(snaps[0], snaps[2]))
                      and torch.equal(after["committed"][zero], h_expect))
                r.checks["b"].record(ok, f"{where}: slots {zrows.tolist()} changed by a zero-accept round")

            # (d) the twin saw other rejected drafts: its outputs of accepted tokens, counters and
            # (every check_every steps) anchors, read copies and committed states are bit-identical
            mat = r.main.materialize(slots) if check_state else None
            if r.twin is not None:
                ok = torch.equal(y[keep], y_tw[keep]) and all(
                    torch.equal(after[k], r.twin.counters(slots)[k]) for k in ("committed", "refreshes", "tokens"))
                if check_state:
                    ok = ok and _parts_equal(_parts_rows(r.main.anchor, live_slots),
                                             _parts_rows(r.twin.anchor, live_slots))
                    if r.main.read_copy is not None:
                        ok = ok and _parts_equal(_parts_rows(r.main.read_copy, live_slots),
                                                 _parts_rows(r.twin.read_copy, live_slots))
                    ok = ok and torch.equal(_bytes(mat), _bytes(r.twin.materialize(slots)))
                r.checks["d"].record(ok, f"{where}: rejected drafts changed the committed state or outputs")

            # (e) finite outputs, states
            fin = bool(torch.isfinite(y).all()) and (mat is None or bool(torch.isfinite(mat[valid]).all()))
            r.checks["e"].record(fin, f"{where}: non-finite output or committed state")

            # (f) each refreshed read copy is the independent cast of the unrounded state
            if s_pre is not None:
                did = need & (after["refreshes"] > before["refreshes"])
                if bool(did.any()):
                    exp = r.precision.read.encode(s_pre[did], "nearest")
                    got = _parts_rows(r.main.read_copy, slots[did])
                    r.checks["f"].record(_parts_equal(exp, got),
                                         f"{where}: read copy of slots {slots[did].tolist()} != Q_read(S)")

            # errors vs float64 and vs s32_rs
            r.out_f64.add(y[keep] - y_ref[keep])
            r.out_s32.add(y[keep] - y_of[BASELINE][keep])
            if mat is not None:
                r.state_f64.add(mat[valid] - ref[valid])
            event = valid & (after["refreshes"] > before["refreshes"])
            if bool(event.any()):
                rows = slots[event]
                anc, rd = r.main.decode_anchor(rows), r.main.decode_read(rows)
                anc_s32 = base.main.decode_anchor(rows)
                target = ref_pre[event]
                r.checks["e"].record(bool(torch.isfinite(anc).all() and torch.isfinite(rd).all()),
                                     f"{where}: non-finite anchor or read copy after a refresh")
                r.anchor_f64.add(anc - target)
                r.anchor_s32.add(anc - anc_s32)
                r.read_f64.add(rd - target)
                for j, i in enumerate(event.nonzero().flatten().tolist()):
                    k = int(after["refreshes"][i])
                    d = r.drift.setdefault(k, [0.0, 0.0, 0, 0.0, 0, 0])
                    e64 = (anc[j].double() - target[j])
                    d[0] += float((e64 * e64).sum())
                    d[1] += float(((anc[j] - anc_s32[j]).double() ** 2).sum())
                    d[2] += e64.numel()
                    d[3] += float((target[j] * target[j]).sum())
                    d[4] += int(before["tokens"][i])
                    d[5] += 1

        # (c) anchors identical across read formats of one anchor format; reads change outputs
        for members in groups.values():
            a0 = _parts_rows(members[0].main.anchor, live_slots)
            for m in members[1:]:
                c_check.record(_parts_equal(a0, _parts_rows(m.main.anchor, live_slots)),
                               f"step {step.index}: anchors of {members[0].precision.name} and "
                               f"{m.precision.name} differ")
            for i, p in enumerate(members):
                for q in members[i + 1:]:
                    if read_key(p.precision) != read_key(q.precision):
                        key = (p.precision.name, q.precision.name)
                        dy = (y_of[key[0]][keep] - y_of[key[1]][keep]).abs()
                        out_diff[key] = max(out_diff.get(key, 0.0), float(dy.max()) if dy.numel() else 0.0)
        progress.update(1)

    # read formats must change outputs
    for key, diff in out_diff.items():
        if diff == 0.0:
            c_check.failed += 1
            c_check.detail = c_check.detail or f"outputs of {key[0]} and {key[1]} are identical: read precision unused"
    c_check.figure = min(out_diff.values()) if out_diff else None

    # ---- results
    live_counters = [r.main.counters(live_slots) for r in runs]
    ref_rms = math.sqrt(ref_sq / ref_n) if ref_n else None
    ref_state_rms = float(ref[live].pow(2).mean().sqrt())
    counts = _schedule_counts(sched)
    out_runs, checks = [], []
    for r, ctr in zip(runs, live_counters):
        name = r.precision.name
        metrics = {
            "output_max_abs_vs_f64": r.out_f64.max_or_none(), "output_rmse_vs_f64": r.out_f64.rms,
            "output_max_abs_vs_s32": r.out_s32.max_or_none(), "output_rmse_vs_s32": r.out_s32.rms,
            "anchor_rmse_vs_f64": r.anchor_f64.rms, "anchor_max_abs_vs_f64": r.anchor_f64.max_or_none(),
            "anchor_rmse_vs_s32": r.anchor_s32.rms, "read_rmse_vs_f64": r.read_f64.rms,
            "state_max_abs_vs_f64": r.state_f64.max_or_none(), "state_rmse_vs_f64": r.state_f64.rms,
            "reference_output_rms": ref_rms, "reference_state_rms": ref_state_rms,
        }
        out_runs.append({
            "arch": arch_name, "preset": name, "seed": seed, "control": r.control,
            "precision": describe_precision(r.precision), "metrics": metrics,
            "tokens_committed": int(ctr["tokens"].sum()), "tokens_per_sequence": ctr["tokens"].tolist(),
            "refreshes": int(ctr["refreshes"].sum()), "refreshes_per_sequence": ctr["refreshes"].tolist(),
            "rounds": counts, "wall_s": r.wall, "drift": _drift_records(r.drift, cfg.drift_every),
        })
        if name == BASELINE:
            fig = r.out_f64.max_or_none()
            ok = fig is not None and fig <= cfg.s32_limit
            checks.append(_check_record("a", arch_name, seed, name, ok, fig, 1, 0 if ok else 1,
                                        "" if ok else f"max abs error {fig:.3e} > {cfg.s32_limit:g}",
                                        limit=cfg.s32_limit))
        for cid, ch in r.checks.items():
            if (cid == "f" and not r.check_cast) or (cid == "d" and r.twin is None):
                continue
            checks.append(_check_record(cid, arch_name, seed, name, ch.failed == 0, ch.figure,
                                        ch.evaluated, ch.failed, ch.detail))
    if groups:
        checks.append(_check_record("c", arch_name, seed, None, c_check.failed == 0, c_check.figure,
                                    c_check.evaluated, c_check.failed, c_check.detail,
                                    groups=[[m.precision.name for m in g] for g in groups.values()]))
    return {"input_sha256": draw.hash.hexdigest(), "runs": out_runs, "checks": checks}


def _check_record(cid, arch, seed, preset, passed, figure, evaluated, failed, detail, **extra):
    return {"id": cid, "name": CHECK_NAMES[cid], "arch": arch, "seed": seed, "preset": preset,
            "passed": bool(passed), "figure": figure, "evaluated": evaluated, "failed": failed,
            "detail": detail, **extra}


def _schedule_counts(sched: Schedule) -> dict:
    """Committed tokens and acceptance kinds per round type, summed over live sequences."""
    out = {"decode": {"steps": 0, "tokens": 0},
           "speculative": {"rounds": 0, "drafted": 0, "accepted": 0, "zero": 0, "partial": 0, "full": 0},
           "paused_rows": 0}
    for st in sched:
        real = [i for i, s in enumerate(st.slots) if s >= 0]
        out["paused_rows"] += sum(1 for i, s in enumerate(st.slots) if s < 0 and i != sched.pad_row)
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


def _drift_records(drift: dict, every: int) -> list:
    out = []
    for k in sorted(drift):
        if k % every:
            continue
        s, s32, n, rsq, tok, rows = drift[k]
        out.append({"refreshes": k, "tokens": tok / rows, "anchor_rmse_vs_f64": math.sqrt(s / n),
                    "anchor_rel_rmse_vs_f64": math.sqrt(s / rsq) if rsq > 0 else None,
                    "anchor_rmse_vs_s32": math.sqrt(s32 / n)})
    return out


# =================================================================================================
# The report
# =================================================================================================
def _git_commit():
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def _environment(cfg: Config) -> dict:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    dev = torch.device(cfg.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "platform": platform.platform(), "device": str(dev), "device_name": name,
            "backend": cfg.backend or ("triton" if dev.type == "cuda" and triton_version else "torch"),
            "torch_threads": torch.get_num_threads()}


def _mean_std(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": mean, "std": std, "n": len(vals)}


SUMMARY_METRICS = ("output_rmse_vs_s32", "anchor_rmse_vs_s32", "output_rmse_vs_f64", "anchor_rmse_vs_f64")


def _summary(runs) -> dict:
    out = {}
    for r in runs:
        out.setdefault(r["arch"], {}).setdefault(r["preset"], []).append(r)
    return {arch: {preset: {m: _mean_std([x["metrics"][m] for x in rs]) for m in SUMMARY_METRICS}
                   | {"control": rs[0]["control"], "drift_exponent": _drift_exponent(rs)}
                   for preset, rs in presets.items()}
            for arch, presets in out.items()}


def _drift_exponent(runs):
    """Least-squares slope of log(anchor RMSE vs f64) against log(refreshes), records averaged
    over seeds (0.5 = error growing like sqrt(refreshes)); None with fewer than 3 points."""
    pts = {}
    for r in runs:
        for d in r["drift"]:
            pts.setdefault(d["refreshes"], []).append(d["anchor_rmse_vs_f64"])
    xy = [(math.log(k), math.log(sum(v) / len(v))) for k, v in sorted(pts.items()) if k > 0 and sum(v) > 0]
    if len(xy) < 3:
        return None
    mx = sum(x for x, _ in xy) / len(xy)
    my = sum(y for _, y in xy) / len(xy)
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    return sum((x - mx) * (y - my) for x, y in xy) / sxx if sxx > 0 else None


def build_report(cfg: Config, plan, cases: dict, wall: float) -> dict:
    runs = [r for c in cases.values() for r in c["runs"]]
    checks = [ch for c in cases.values() for ch in c["checks"]]
    failed = [ch for ch in checks if not ch["passed"]]
    commit, dirty = _git_commit()
    hashes = {f"{a}/{s}": c["input_sha256"] for (a, s), c in cases.items()}
    total = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(hashes.items())).encode()).hexdigest()
    return {
        "protocol": PROTOCOL, "schema": SCHEMA,
        "package": {"name": "replayssm", "version": __version__, "git_commit": commit, "git_dirty": dirty},
        "environment": _environment(cfg),
        "config": {"archs": list(cfg.archs), "presets": list(cfg.presets),
                   "controls": [p.name for p, c in plan if c], "seeds": list(cfg.seeds), "steps": cfg.steps,
                   "window": cfg.window, "max_draft": cfg.max_draft, "batch": cfg.batch,
                   "geometry": {a: cfg.geometry.describe(a) for a in cfg.archs},
                   "twin": cfg.twin, "drift_every": cfg.drift_every, "check_every": cfg.check_every,
                   "schedule": Schedule(cfg.batch, cfg.steps, cfg.max_draft).describe(),
                   "s32_output_limit": cfg.s32_limit},
        "precisions": {p.name: describe_precision(p) | {"control": c} for p, c in plan},
        "inputs": {"sha256": total, "per_case": hashes},
        "runs": runs, "checks": checks, "summary": _summary(runs),
        "passed": not failed,
        "failed_checks": sorted({f"({ch['id']}) {ch['name']}" for ch in failed}),
        "wall_s": wall,
    }


def _fmt(v, spec=".3e"):
    if v is None:
        return "-"
    if isinstance(v, float):
        return "0" if v == 0 else format(v, spec)
    return str(v)


def _table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pm(ms, spec=".3g"):
    if ms is None:
        return "-"
    if ms["mean"] == 0 and not ms["std"]:
        return "0"
    std = "n/a" if ms["std"] is None else format(ms["std"], spec)
    return f"{format(ms['mean'], spec)} ± {std}"


def print_report(rep: dict, out=None) -> None:
    w = lambda s="": print(s, file=out or sys.stdout)  # noqa: E731
    cfg = rep["config"]
    env = rep["environment"]
    w(f"{rep['protocol']}  replayssm {rep['package']['version']} ({(rep['package']['git_commit'] or 'no git')[:12]})"
      f"  device {env['device']} [{env['backend']}]  torch {env['torch']}  triton {env['triton']}")
    w(f"archs {','.join(cfg['archs'])}  seeds {','.join(map(str, cfg['seeds']))}  steps {cfg['steps']}  "
      f"window {cfg['window']}  max_draft {cfg['max_draft']}  batch {cfg['batch']}+1 pad  "
      f"inputs sha256 {rep['inputs']['sha256'][:16]}")
    w()
    rows = []
    for r in rep["runs"]:
        m = r["metrics"]
        sp = r["rounds"]["speculative"]
        rows.append([r["arch"], r["preset"] + (" (ctl)" if r["control"] else ""), r["seed"],
                     _fmt(m["output_max_abs_vs_f64"]), _fmt(m["output_rmse_vs_f64"]),
                     _fmt(m["output_rmse_vs_s32"]), _fmt(m["anchor_rmse_vs_f64"]),
                     _fmt(m["anchor_rmse_vs_s32"]), _fmt(m["read_rmse_vs_f64"]), _fmt(m["state_max_abs_vs_f64"]),
                     r["tokens_committed"], r["refreshes"],
                     f"{r['rounds']['decode']['tokens']}/{sp['accepted']}/{sp['drafted']}",
                     f"{r['wall_s']:.2f}"])
    w("Per run (errors: max abs / RMSE vs the float64 recurrence, RMSE vs the s32_rs run)")
    w(_table(["arch", "preset", "seed", "out max", "out rmse", "out vs s32", "anchor rmse", "anc vs s32",
              "read rmse", "state max", "tokens", "refr", "dec/acc/draft", "wall s"], rows))
    w()
    w("Invariant checks")
    crow = []
    for cid, name, what in CHECKS:
        sel = [c for c in rep["checks"] if c["id"] == cid]
        if not sel:
            if cid != "x":
                crow.append([f"({cid}) {name}", "n/a", "-", "-", what])
            continue
        bad = [c for c in sel if not c["passed"]]
        figs = [c["figure"] for c in sel if c["figure"] is not None]
        fig = (max(figs) if cid == "a" else min(figs)) if figs else None
        crow.append([f"({cid}) {name}", "FAIL" if bad else "pass", sum(c["evaluated"] for c in sel),
                     _fmt(fig), bad[0]["detail"] + f" [{bad[0]['arch']} seed {bad[0]['seed']}"
                     + (f" {bad[0]['preset']}" if bad[0]["preset"] else "") + "]" if bad else what])
    w(_table(["check", "result", "evaluated", "figure", "detail"], crow))
    w()
    archs = [a for a in ARCHS if a in rep["summary"]]
    presets = [p for p in rep["summary"][archs[0]] if not rep["summary"][archs[0]][p]["control"]] if archs else []
    n = len(cfg["seeds"])
    w(f"Summary: RMSE relative to s32_rs, mean ± sample std over {n} seed{'s' * (n > 1)}")
    heads = ["preset"] + [f"{ARCH_TITLE[a]} {k}" for a in archs for k in ("output RMSE", "anchor RMSE")]
    srows = [[p] + [_pm(rep["summary"][a][p][m]) for a in archs
                    for m in ("output_rmse_vs_s32", "anchor_rmse_vs_s32")] for p in presets]
    w(_table(heads, srows))
    if any(r["drift"] for r in rep["runs"]) and cfg["steps"] >= 1000:
        w()
        w(f"Anchor drift vs float64 (every {cfg['drift_every']} refreshes, mean over seeds)")
        drows = []
        for a in archs:
            for p, s in rep["summary"][a].items():
                recs = _mean_drift([r for r in rep["runs"] if r["arch"] == a and r["preset"] == p])
                if recs:
                    drows.append([a, p, f"{recs[0][1]:.0f}", _fmt(recs[0][2]), f"{recs[-1][1]:.0f}",
                                  _fmt(recs[-1][2]), _fmt(s["drift_exponent"], ".2f")])
        w(_table(["arch", "preset", "tokens@first", "rmse@first", "tokens@last", "rmse@last",
                  "slope log-log"], drows))
    w()
    if rep["passed"]:
        w(f"PASS: every invariant holds ({rep['wall_s']:.1f} s)")
    else:
        w(f"FAIL: {', '.join(rep['failed_checks'])}")


def _mean_drift(runs):
    """[(refreshes, tokens, anchor_rmse_vs_f64)] averaged over seeds."""
    acc = {}
    for r in runs:
        for d in r["drift"]:
            a = acc.setdefault(d["refreshes"], [0.0, 0.0, 0])
            a[0] += d["tokens"]
            a[1] += d["anchor_rmse_vs_f64"]
            a[2] += 1
    return [(k, t / c, e / c) for k, (t, e, c) in sorted(acc.items())]


def plot_drift(rep: dict, path: Path) -> str:
    """Anchor RMSE vs float64 against committed tokens, log-log, one panel per arch, with a
    sqrt(tokens) guide. Returns a message (the plot is skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "drift plot skipped: matplotlib is not installed (pip install 'replayssm[plot]')"
    archs = [a for a in ARCHS if a in rep["summary"]]
    fig, axes = plt.subplots(1, len(archs), figsize=(6 * len(archs), 4.5), squeeze=False)
    for ax, a in zip(axes[0], archs):
        for p in rep["summary"][a]:
            recs = _mean_drift([r for r in rep["runs"] if r["arch"] == a and r["preset"] == p])
            recs = [x for x in recs if x[2] > 0]
            if recs:
                ts = [x[1] for x in recs]
                ax.loglog(ts, [x[2] for x in recs], label=p)
                guide = "∝ sqrt(tokens)" if p == BASELINE else None
                ax.loglog(ts, [recs[0][2] * math.sqrt(t / ts[0]) for t in ts], ":", color="0.6", label=guide)
        ax.set_title(f"{ARCH_TITLE[a]}: anchor drift vs float64")
        ax.set_xlabel("committed tokens")
        ax.set_ylabel("anchor RMSE at refresh")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"drift plot written to {path}"


# =================================================================================================
# --compare
# =================================================================================================
COMPARE_METRICS = ("output_max_abs_vs_f64", "output_rmse_vs_f64", "output_rmse_vs_s32", "anchor_rmse_vs_f64",
                   "anchor_rmse_vs_s32", "read_rmse_vs_f64", "state_max_abs_vs_f64")


def compare_reports(a: dict, b: dict, out=None) -> int:
    """Print the differences between two reports. Returns 0 when they ran the same protocol on
    identical inputs (the metrics may differ: that is what is being compared), else 1."""
    w = lambda s="": print(s, file=out or sys.stdout)  # noqa: E731
    rows = []
    for key in ("protocol", "schema"):
        rows.append([key, a.get(key), b.get(key)])
    for key in ("version", "git_commit", "git_dirty"):
        rows.append([f"package.{key}", a["package"].get(key), b["package"].get(key)])
    for key in ("device", "device_name", "backend", "torch", "triton"):
        rows.append([key, a["environment"].get(key), b["environment"].get(key)])
    for key in ("steps", "window", "max_draft", "batch", "seeds", "presets"):
        rows.append([key, a["config"].get(key), b["config"].get(key)])
    rows.append(["inputs sha256", a["inputs"]["sha256"][:16], b["inputs"]["sha256"][:16]])
    rows.append(["passed", a["passed"], b["passed"]])
    w(_table(["", "A", "B"], [[k, str(x), str(y)] for k, x, y in rows]))
    same_inputs = a.get("protocol") == b.get("protocol")
    common = sorted(set(a["inputs"]["per_case"]) & set(b["inputs"]["per_case"]))
    differing = [c for c in common if a["inputs"]["per_case"][c] != b["inputs"]["per_case"][c]]
    if not same_inputs or differing or not common:
        w(f"\nNOT COMPARABLE: different protocol or inputs ({', '.join(differing) or 'no common case'})")
        same_inputs = False
    w()
    ra = {(r["arch"], r["preset"], r["seed"]): r for r in a["runs"]}
    rb = {(r["arch"], r["preset"], r["seed"]): r for r in b["runs"]}
    drows, identical = [], 0
    for key in sorted(set(ra) & set(rb)):
        for m in COMPARE_METRICS:
            x, y = ra[key]["metrics"].get(m), rb[key]["metrics"].get(m)
            if x == y:
                identical += 1
                continue
            rel = _fmt((y - x) / abs(x), ".2e") if x and y is not None else "-"
            drows.append([*map(str, key), m, _fmt(x), _fmt(y), _fmt(y - x if None not in (x, y) else None), rel])
        for m in ("tokens_committed", "refreshes"):
            if ra[key][m] != rb[key][m]:
                drows.append([*map(str, key), m, ra[key][m], rb[key][m], rb[key][m] - ra[key][m], "-"])
    only = sorted(set(ra) ^ set(rb))
    if drows:
        w(_table(["arch", "preset", "seed", "metric", "A", "B", "B - A", "rel"], drows))
    w(f"\n{identical} metric values identical, {len(drows)} differ"
      + (f"; runs in only one report: {only}" if only else ""))
    wall_a = sum(r["wall_s"] for r in a["runs"])
    wall_b = sum(r["wall_s"] for r in b["runs"])
    w(f"cache wall time: A {wall_a:.2f} s, B {wall_b:.2f} s")
    ca = {(c["id"], c["arch"], c["seed"], c["preset"]): c["passed"] for c in a["checks"]}
    cb = {(c["id"], c["arch"], c["seed"], c["preset"]): c["passed"] for c in b["checks"]}
    flips = [k for k in sorted(set(ca) & set(cb), key=str) if ca[k] != cb[k]]
    for k in flips:
        w(f"check ({k[0]}) {CHECK_NAMES[k[0]]} {k[1]} seed {k[2]} {k[3] or ''}: "
          f"A {'pass' if ca[k] else 'FAIL'}, B {'pass' if cb[k] else 'FAIL'}")
    w(f"failed checks: A {a['failed_checks'] or 'none'}, B {b['failed_checks'] or 'none'}")
    return 0 if same_inputs else 1


# =================================================================================================
# Command line
# =================================================================================================
def _csv(choices=None, cast=str):
    def parse(text):
        items = [cast(x) for x in text.split(",") if x]
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {sorted(choices)} or all")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the ``run`` subcommand's options; the handler returns the exit code."""
    p.description = ("Run the seeded ReplaySSM reproduction protocol (" + PROTOCOL + ") beside the float64 "
                     "recurrence, check the invariants, write a JSON report. Exit code 0 only if every "
                     "invariant passes.")
    p.add_argument("--arch", default="all", choices=(*ARCHS, "all"))
    p.add_argument("--presets", default=",".join(SEED_PRESETS),
                   help=f"comma-separated presets, or 'all' for every preset ({','.join(PRESETS)}); "
                        f"s32_rs always runs as the baseline (default: the seed's four)")
    p.add_argument("--seeds", type=_csv(cast=int), default=[42, 43, 44])
    p.add_argument("--steps", type=int, default=48, help="schedule steps (decodes and speculative rounds)")
    p.add_argument("--window", type=int, default=16, help="refresh window L")
    p.add_argument("--max-draft", type=int, default=4, help="draft length T of speculative rounds")
    p.add_argument("--batch", type=int, default=4, help="live sequences in the batch (plus one pad row)")
    p.add_argument("--geometry", type=Geometry.parse, default=Geometry.parse("small"),
                   help=f"{'|'.join(GEOMETRIES)} or H,P,N,G (default small = {GEOMETRIES['small']})")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--backend", default=None, choices=("torch", "triton"),
                   help="default: triton on CUDA when installed, else torch")
    p.add_argument("--no-controls", dest="controls", action="store_false",
                   help="do not add the control presets that check (c) needs")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="do not run the twin caches that check (d) needs (halves the cost of long runs)")
    p.add_argument("--s32-limit", type=float, default=S32_OUTPUT_LIMIT,
                   help="check (a): bound on s32_rs's max abs output error (default 1e-5, sized for the "
                        "small geometry; large geometries have a longer fp32 rounding tail)")
    p.add_argument("--drift-every", type=int, default=4, help="record anchor drift every N refreshes")
    p.add_argument("--check-every", type=int, default=4,
                   help="materialize committed states (state error, twin state comparison) every K steps "
                        "and at the last step")
    p.add_argument("--plot", default="auto",
                   help="drift plot PNG path; 'auto' = next to --output when --steps >= 1000; 'none'")
    p.add_argument("--output", default="runs/replayssm.json", help="JSON report path ('-' = do not write)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the small geometry is latency-bound and extra "
                        "threads only add overhead)")
    p.add_argument("--quiet", action="store_true", help="print only the verdict line")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print the difference between two reports and exit")
    p.set_defaults(func=main)


def run_all(cfg: Config, plan, progress: bool = False) -> dict:
    """Run every (arch, seed) case and build the report. An exception inside a case becomes a
    failed check (x) naming it, so a broken implementation still yields a report."""
    bar = Progress(len(cfg.archs) * len(cfg.seeds) * cfg.steps, progress)
    t0 = time.perf_counter()
    cases = {}
    for arch in cfg.archs:
        for seed in cfg.seeds:
            bar.label = f"{arch} seed {seed}"
            try:
                cases[(arch, seed)] = run_case(arch, seed, cfg, plan, bar)
            except Exception as exc:  # noqa: BLE001 - reported as a named failed check
                cases[(arch, seed)] = {"input_sha256": "", "runs": [], "checks": [_check_record(
                    "x", arch, seed, None, False, None, 1, 1, f"{type(exc).__name__}: {exc}")]}
    bar.close()
    return build_report(cfg, plan, cases, time.perf_counter() - t0)


def main(args) -> int:
    if args.compare:
        reports = []
        for path in args.compare:
            with open(path) as f:
                reports.append(json.load(f))
        return compare_reports(*reports)
    presets = list(PRESETS) if args.presets == "all" else _csv(set(PRESETS))(args.presets)
    for name, v, lo in (("--steps", args.steps, 1), ("--window", args.window, 1), ("--max-draft", args.max_draft, 1),
                        ("--batch", args.batch, 1), ("--drift-every", args.drift_every, 1),
                        ("--check-every", args.check_every, 1), ("--threads", args.threads, 1)):
        if v < lo:
            print(f"replayssm run: {name} must be >= {lo}", file=sys.stderr)
            return 2
    if args.max_draft > args.window:
        print("replayssm run: --max-draft must be <= --window", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("replayssm run: CUDA is not available", file=sys.stderr)
            return 2
        if dev.index is None:  # tensors land on cuda:N; give the caches the same explicit index
            dev = torch.device("cuda", torch.cuda.current_device())
    if args.backend == "triton" and importlib.util.find_spec("replayssm.mamba2.triton") is None:
        print("replayssm run: the triton backend is not available in this build", file=sys.stderr)
        return 2
    cfg = Config(tuple(ARCHS if args.arch == "all" else (args.arch,)), tuple(presets), tuple(args.seeds),
                 args.steps, args.window, args.max_draft, args.batch, args.geometry, str(dev), args.backend,
                 args.controls, args.twin, args.drift_every, args.check_every, args.s32_limit)
    plan = plan_presets(cfg.presets, cfg.controls)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        rep = run_all(cfg, plan, progress=sys.stderr.isatty() and not args.quiet)
    finally:
        torch.set_num_threads(threads)
    messages = []
    if args.output != "-":
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_jsonable(rep), indent=1) + "\n")
        messages.append(f"report written to {out}")
        plot = None if args.plot == "none" else (
            out.with_suffix(".drift.png") if args.plot == "auto" and cfg.steps >= 1000 else
            None if args.plot == "auto" else Path(args.plot))
        if plot is not None:
            messages.append(plot_drift(rep, plot))
    if args.quiet:
        print(f"PASS ({rep['wall_s']:.1f} s)" if rep["passed"] else f"FAIL: {', '.join(rep['failed_checks'])}")
    else:
        print_report(rep)
        for m in messages:
            print(m)
    return 0 if rep["passed"] else 1


def _jsonable(x):
    """NaN/Inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x

