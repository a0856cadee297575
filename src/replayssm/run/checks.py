"""The invariant checks of ``replayssm run`` and the loop that feeds them: for one (arch, seed),
every preset takes every step of the schedule in lockstep beside the float64 recurrence, and each
step is checked and measured.

Per preset there is a main cache and, unless ``--no-twin``, a *twin* fed the same inputs except
that its rejected drafts are replaced by other ones (check (d)). Control presets (check (c)) have
no twin.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch

from ..precision import Precision
from .protocol import BASELINE, INPUTS, LAYERS, Config, Draw, Schedule, anchor_key, describe_precision, read_key

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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _parts_rows(parts, rows) -> dict:
    return {k: v[rows].clone() for k, v in parts.items()}


def _parts_equal(p: dict, q: dict) -> bool:
    return p.keys() == q.keys() and all(torch.equal(_bytes(p[k]), _bytes(q[k])) for k in p)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Acc:
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
class Evidence:
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
    check_cast: bool  # check (f) applies: a separate read copy rounded to nearest
    wall: float = 0.0
    out_f64: Acc = field(default_factory=Acc)
    out_s32: Acc = field(default_factory=Acc)
    anchor_f64: Acc = field(default_factory=Acc)
    anchor_s32: Acc = field(default_factory=Acc)
    read_f64: Acc = field(default_factory=Acc)
    state_f64: Acc = field(default_factory=Acc)
    drift: dict = field(default_factory=dict)  # refresh index -> [sumsq, sumsq_s32, n, ref_sumsq, tokens, rows]
    checks: dict = field(default_factory=lambda: {c: Evidence() for c in "bdef"})


@dataclass
class StepData:
    """One step's inputs and the oracle's answer, shared by every preset."""

    step: object
    slots: torch.Tensor  # [b] slot ids (-1 = pad)
    valid: torch.Tensor  # [b] bool
    n: torch.Tensor  # [b] committed tokens of the step per row
    keep: torch.Tensor  # [b, T] outputs of committed tokens
    tok: dict
    tok_twin: dict
    y_ref: torch.Tensor  # float64 outputs of all T tokens
    ref_pre: torch.Tensor  # float64 committed state before the step
    check_state: bool


def record(cid, arch, seed, preset, passed, figure, evaluated, failed, detail, **extra) -> dict:
    """One entry of the report's ``checks``."""
    return {"id": cid, "name": CHECK_NAMES[cid], "arch": arch, "seed": seed, "preset": preset,
            "passed": bool(passed), "figure": figure, "evaluated": evaluated, "failed": failed,
            "detail": detail, **extra}


class Case:
    """Every preset of ``plan`` for one (arch, seed) over the protocol schedule."""

    def __init__(self, arch: str, seed: int, cfg: Config, plan):
        self.arch, self.seed, self.cfg = arch, seed, cfg
        self.dev = torch.device(cfg.device)
        self.layer = LAYERS[arch]
        self.draw = Draw(seed, arch)
        self.inputs = INPUTS[arch](cfg.geometry, self.draw)
        self.consts = {k: v.to(self.dev) for k, v in self.inputs.consts.items()}
        self.sched = Schedule(cfg.batch, cfg.steps, cfg.max_draft)
        g = cfg.geometry
        self.draw.note(json.dumps([g.H, g.P, g.N, g.G, cfg.batch, cfg.steps, cfg.max_draft]))
        self.b = self.sched.rows
        self.S0 = self.inputs.initial_state(self.draw, self.b).to(self.dev)
        self.base_slots = torch.tensor(self.sched.base_slots, dtype=torch.int64, device=self.dev)
        self.live = self.base_slots >= 0
        self.live_slots = self.base_slots[self.live]
        self.runs = [self._preset_run(p, control) for p, control in plan]
        assert self.runs[0].precision.name == BASELINE
        groups = {}
        for r in self.runs:
            groups.setdefault(anchor_key(r.precision), []).append(r)
        self.groups = {k: g for k, g in groups.items() if len(g) > 1}  # check (c)
        self.c_check = Evidence()
        self.out_diff = {}  # (name_p, name_q) -> max |y_p - y_q| over the run, pairs with different reads
        self.ref = self.S0.double()
        self.ref_sq, self.ref_n = 0.0, 0

    def _preset_run(self, p: Precision, control: bool) -> PresetRun:
        cfg = self.cfg
        slot_seeds = (self.seed * 4096 + self.base_slots.clamp(min=0)).to(torch.int64)
        caches = [self.layer.cache(cfg.geometry, self.sched.num_slots, window=cfg.window, max_draft=cfg.max_draft,
                                   precision=p, device=self.dev, seed=self.seed)
                  for _ in range(2 if cfg.twin and not control else 1)]
        for c in caches:
            c.load_state(self.base_slots, self.S0, seeds=slot_seeds)
        run = PresetRun(p, control, caches[0], caches[1] if len(caches) > 1 else None,
                        not p.shared and p.read_rounding == "nearest")
        if run.check_cast:  # the read copy written by load_state is the independent cast of S0
            exp = p.read.encode(self.S0[self.live].float(), "nearest")
            run.checks["f"].record(_parts_equal(exp, _parts_rows(run.main.read_copy, self.live_slots)),
                                   "read copy after load_state != Q_read(S0)")
        return run

    # ---------------------------------------------------------------------------------------------
    def run(self, progress=None) -> dict:
        """Returns {"input_sha256", "runs": [...], "checks": [...]} (see ``report.build_report``)."""
        for step in self.sched:
            data = self._step_data(step)
            y_of = {}
            for r in self.runs:
                y_of[r.precision.name] = self._preset_step(r, data, y_of)
            self._check_c(data, y_of)
            if progress is not None:
                progress.update(1)
        return self._results()

    def _step_data(self, step) -> StepData:
        """The step's tokens (and the twin's), and the float64 oracle: outputs of all T tokens,
        committed state after the accepted ones."""
        dev, b, T, draw = self.dev, self.b, step.T, self.draw
        slots = torch.tensor(step.slots, dtype=torch.int64, device=dev)
        valid = slots >= 0
        draw.note(f"|{step.index}:{int(step.speculative)}:{T}:{step.slots}:{step.accept}")
        tok = {k: v.to(dev) for k, v in self.inputs.tokens(draw, b, T).items()}
        if step.speculative:
            n = torch.tensor(step.accept, dtype=torch.int64, device=dev)
            alt = {k: v.to(dev) for k, v in self.inputs.tokens(draw, b, T).items()}
            keep = torch.arange(T, device=dev)[None, :] < n[:, None]  # [b, T] accepted drafts
            tok_twin = {k: torch.where(keep.view(b, T, *([1] * (v.dim() - 2))), v, alt[k]) for k, v in tok.items()}
        else:
            n = valid.long()
            keep = valid[:, None]
            tok_twin = tok
        keep = keep & valid[:, None]
        ref_pre = self.ref
        states, ys = [ref_pre], []
        for t in range(T):
            y_t, st = self.layer.reference_step(states[-1], tok, self.consts, t)
            ys.append(y_t)
            states.append(st)
        y_ref = torch.stack(ys, 1)
        picked = torch.stack(states, 0)[n, torch.arange(b, device=dev)]
        self.ref = torch.where(valid.view(-1, 1, 1, 1), picked, ref_pre)
        yv = y_ref[valid]
        self.ref_sq += float((yv * yv).sum())
        self.ref_n += yv.numel()
        check_state = step.index % self.cfg.check_every == 0 or step.index == self.cfg.steps - 1
        return StepData(step, slots, valid, n, keep, tok, tok_twin, y_ref, ref_pre, check_state)

    def _call(self, cache, slots, tok, verify):
        return self.layer.call(cache, slots, tok, self.consts, verify, self.cfg.backend)

    def _preset_step(self, r: PresetRun, d: StepData, y_of: dict) -> torch.Tensor:
        """Run one preset's main cache (timed) and twin through the step; checks (b), (d), (e),
        (f) and the error figures. Returns the main cache's outputs."""
        step, slots, valid, n = d.step, d.slots, d.valid, d.n
        before = r.main.counters(slots)
        need = valid & (before["committed"] + step.T > self.cfg.window)  # rows that refresh first
        s_pre = r.main.materialize(slots) if r.check_cast and bool(need.any()) else None
        zero = valid & (n == 0) if step.speculative else torch.zeros_like(valid)
        zrows = slots[zero]

        def snap():  # anchor and read copy of the zero-accept rows
            parts = _parts_rows(r.main.anchor, zrows)
            if r.main.read_copy is not None:
                parts.update({f"read.{k}": v for k, v in _parts_rows(r.main.read_copy, zrows).items()})
            return parts

        snaps = [snap()] if zrows.numel() else []
        _sync(self.dev)
        t0 = time.perf_counter()
        y = self._call(r.main, slots, d.tok, step.speculative)
        if step.speculative:
            if zrows.numel():
                _sync(self.dev)
                r.wall += time.perf_counter() - t0
                snaps.append(snap())
                t0 = time.perf_counter()
            r.main.accept(slots, n)
        _sync(self.dev)
        r.wall += time.perf_counter() - t0
        y_twin = None
        if r.twin is not None:
            y_twin = self._call(r.twin, slots, d.tok_twin, step.speculative)
            if step.speculative:
                r.twin.accept(slots, n)
        after = r.main.counters(slots)
        where = f"step {step.index}"
        if zrows.numel():
            snaps.append(snap())
            self._check_b(r, before, after, zero, zrows, snaps, where)
        mat = r.main.materialize(slots) if d.check_state else None
        if r.twin is not None:
            self._check_d(r, d, y, y_twin, after, mat, where)
        fin = bool(torch.isfinite(y).all()) and (mat is None or bool(torch.isfinite(mat[valid]).all()))
        r.checks["e"].record(fin, f"{where}: non-finite output or committed state")
        if s_pre is not None:
            self._check_f(r, slots, need, before, after, s_pre, where)
        self._measure(r, d, y, y_of, before, after, mat, where)
        return y

    @staticmethod
    def _check_b(r, before, after, zero, zrows, snaps, where):
        """(b) accept(0) changes nothing; without a refresh the whole verify + accept leaves
        anchor and read copy bit-identical. A refresh at the start of the verify legitimately
        rewrote the checkpoint and emptied the committed history: accept(0) must then leave h = 0."""
        no_refresh = bool((after["refreshes"][zero] == before["refreshes"][zero]).all())
        h = before["committed"][zero]
        h_expect = h if no_refresh else torch.zeros_like(h)
        ok = (_parts_equal(snaps[1], snaps[2]) and (not no_refresh or _parts_equal(snaps[0], snaps[2]))
              and torch.equal(after["committed"][zero], h_expect))
        r.checks["b"].record(ok, f"{where}: slots {zrows.tolist()} changed by a zero-accept round")

    def _check_d(self, r, d, y, y_twin, after, mat, where):
        """(d) the twin saw other rejected drafts: its outputs of committed tokens and its counters
        (every step) and its anchors, read copies and committed states (every check_every
        steps) are bit-identical to the main cache's."""
        slots, live = d.slots, self.live_slots
        ok = torch.equal(y[d.keep], y_twin[d.keep]) and all(
            torch.equal(after[k], r.twin.counters(slots)[k]) for k in ("committed", "refreshes", "tokens"))
        if d.check_state:
            ok = ok and _parts_equal(_parts_rows(r.main.anchor, live), _parts_rows(r.twin.anchor, live))
            if r.main.read_copy is not None:
                ok = ok and _parts_equal(_parts_rows(r.main.read_copy, live), _parts_rows(r.twin.read_copy, live))
            ok = ok and torch.equal(_bytes(mat), _bytes(r.twin.materialize(slots)))
        r.checks["d"].record(ok, f"{where}: rejected drafts changed the committed state or outputs")

    @staticmethod
    def _check_f(r, slots, need, before, after, s_pre, where):
        """(f) each refreshed read copy is the independent cast of the unrounded state."""
        did = need & (after["refreshes"] > before["refreshes"])
        if bool(did.any()):
            exp = r.precision.read.encode(s_pre[did], "nearest")
            got = _parts_rows(r.main.read_copy, slots[did])
            r.checks["f"].record(_parts_equal(exp, got), f"{where}: read copy of slots {slots[did].tolist()} != Q_read(S)")

    def _measure(self, r, d, y, y_of, before, after, mat, where):
        """Errors vs float64 and vs s32_rs; anchors and read copies at refresh events (with the
        drift records and the finiteness of what the refresh wrote)."""
        keep, valid, slots = d.keep, d.valid, d.slots
        r.out_f64.add(y[keep] - d.y_ref[keep])
        r.out_s32.add(y[keep] - y_of.get(BASELINE, y)[keep])
        if mat is not None:
            r.state_f64.add(mat[valid] - self.ref[valid])
        event = valid & (after["refreshes"] > before["refreshes"])
        if not bool(event.any()):
            return
        rows = slots[event]
        anc, rd = r.main.decode_anchor(rows), r.main.decode_read(rows)
        anc_s32 = self.runs[0].main.decode_anchor(rows)
        target = d.ref_pre[event]
        r.checks["e"].record(bool(torch.isfinite(anc).all() and torch.isfinite(rd).all()),
                             f"{where}: non-finite anchor or read copy after a refresh")
        r.anchor_f64.add(anc - target)
        r.anchor_s32.add(anc - anc_s32)
        r.read_f64.add(rd - target)
        for j, i in enumerate(event.nonzero().flatten().tolist()):
            k = int(after["refreshes"][i])
            rec = r.drift.setdefault(k, [0.0, 0.0, 0, 0.0, 0, 0])
            e64 = anc[j].double() - target[j]
            rec[0] += float((e64 * e64).sum())
            rec[1] += float(((anc[j] - anc_s32[j]).double() ** 2).sum())
            rec[2] += e64.numel()
            rec[3] += float((target[j] * target[j]).sum())
            rec[4] += int(before["tokens"][i])
            rec[5] += 1

    def _check_c(self, d, y_of):
        """(c) anchors identical across read formats of one anchor format; reads change outputs."""
        live = self.live_slots
        for members in self.groups.values():
            a0 = _parts_rows(members[0].main.anchor, live)
            for m in members[1:]:
                self.c_check.record(_parts_equal(a0, _parts_rows(m.main.anchor, live)),
                                    f"step {d.step.index}: anchors of {members[0].precision.name} and "
                                    f"{m.precision.name} differ")
            for i, p in enumerate(members):
                for q in members[i + 1:]:
                    if read_key(p.precision) != read_key(q.precision):
                        key = (p.precision.name, q.precision.name)
                        dy = (y_of[key[0]][d.keep] - y_of[key[1]][d.keep]).abs()
                        self.out_diff[key] = max(self.out_diff.get(key, 0.0), float(dy.max()) if dy.numel() else 0.0)

    # ---------------------------------------------------------------------------------------------
    def _results(self) -> dict:
        arch, seed, cfg = self.arch, self.seed, self.cfg
        for key, diff in self.out_diff.items():  # read formats must change outputs
            if diff == 0.0:
                self.c_check.failed += 1
                self.c_check.detail = self.c_check.detail or (
                    f"outputs of {key[0]} and {key[1]} are identical: read precision unused")
        self.c_check.figure = min(self.out_diff.values()) if self.out_diff else None
        ref_rms = math.sqrt(self.ref_sq / self.ref_n) if self.ref_n else None
        ref_state_rms = float(self.ref[self.live].pow(2).mean().sqrt())
        counts = self.sched.counts()
        out_runs, checks = [], []
        for r in self.runs:
            ctr = r.main.counters(self.live_slots)
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
                "arch": arch, "preset": name, "seed": seed, "control": r.control,
                "precision": describe_precision(r.precision), "metrics": metrics,
                "tokens_committed": int(ctr["tokens"].sum()), "tokens_per_sequence": ctr["tokens"].tolist(),
                "refreshes": int(ctr["refreshes"].sum()), "refreshes_per_sequence": ctr["refreshes"].tolist(),
                "rounds": counts, "wall_s": r.wall, "drift": _drift_records(r.drift, cfg.drift_every),
            })
            if name == BASELINE:
                fig = r.out_f64.max_or_none()
                ok = fig is not None and fig <= cfg.s32_limit
                checks.append(record("a", arch, seed, name, ok, fig, 1, 0 if ok else 1,
                                     "" if ok else f"max abs error {fig:.3e} > {cfg.s32_limit:g}",
                                     limit=cfg.s32_limit))
            for cid, ch in r.checks.items():
                if (cid == "f" and not r.check_cast) or (cid == "d" and r.twin is None):
                    continue
                checks.append(record(cid, arch, seed, name, ch.failed == 0, ch.figure, ch.evaluated, ch.failed,
                                     ch.detail))
        if self.groups:
            c = self.c_check
            checks.append(record("c", arch, seed, None, c.failed == 0, c.figure, c.evaluated, c.failed, c.detail,
                                 groups=[[m.precision.name for m in g] for g in self.groups.values()]))
        return {"input_sha256": self.draw.hash.hexdigest(), "runs": out_runs, "checks": checks}


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


def run_case(arch: str, seed: int, cfg: Config, plan, progress=None) -> dict:
    """Every preset of ``plan`` for one (arch, seed); see ``Case``."""
    return Case(arch, seed, cfg, plan).run(progress)
