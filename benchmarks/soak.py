"""Serving-lifecycle soak: drive a ReplaySSM cache the way a serving engine does, against an
independent float64 per-request reference (the conventional per-token recurrence).

The engine loop, per round:

- arrivals: requests with a random length arrive at random; a new request's prefill hands its
  state over by ``load_state`` (or starts empty on a ``reset`` slot);
- admission: waiting requests (new, forked or preempted) take free slots, chosen at random;
- preemption: a running request is ``materialize``d, its slot freed, and later resumed on
  another slot by ``load_state``;
- prefix forks: a running request's committed prefix is materialized and two new requests
  start from it;
- a speculative verify of T drafts for some running requests, a standard decode for the others
  (separate calls; a slot with a pending verify accepts before its next call), then ``accept``
  with random counts 0..T;
- every call carries pad rows (-1) in random places, its rows in random order, int32 or int64 ids;
- some requests are fed NaN/Inf once: their own outputs may be non-finite, every other request
  must stay exact; their slots are recycled afterwards;
- the cache is saved (``state_dict`` through ``torch.save``) and restored into a freshly built
  cache, mid-window and with a verify pending;
- finished requests free their slots by ``reset``.

Every output row of every call is compared with the float64 reference of its request, every
materialized state with the reference state, and the cursors with what the refresh rule predicts
(committed tokens per request: nothing lost, nothing counted twice).

Usage (GPU, real geometry; prints the figures of each run):

    PYTHONPATH=src python benchmarks/soak.py --device cuda --batch 64 --steps 10000 --budget 540

and at tiny size on the CPU (``--tiny``; ``--backend triton`` needs TRITON_INTERPRET=1 there).
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

import replayssm as rs

#: Bound on the relative output error of the run (||y - y_ref|| / ||y_ref|| over every exact
#: output row of every call), by storage format; a preset's bound is the larger of its anchor's
#: and its read copy's. One call's error (a few rows) may reach twice the bound: at 4 bits the
#: rounding of a small state is a large share of a small output.
OUTPUT_BOUND = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2, "fp8_e4m3": 0.1, "nvfp4": 0.5}

#: Real geometries (Mamba-2 2.7B-like and Qwen3-Next-like GDN layers).
REAL = {"mamba2": dict(nheads=128, headdim=64, dstate=128, ngroups=8),
        "gdn": dict(num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128)}
#: Tiny geometries for CPU runs (the Triton kernels tile dims >= 16).
TINY = {"mamba2": dict(nheads=4, headdim=8, dstate=16, ngroups=2),
        "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)}
TINY_TRITON = {"mamba2": dict(nheads=2, headdim=16, dstate=16, ngroups=1),
               "gdn": dict(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)}


def output_bound(preset) -> float:
    p = rs.get_precision(preset)
    return max(OUTPUT_BOUND[p.read_format.name], OUTPUT_BOUND[p.anchor.name])


def state_bound(preset) -> float:
    """Materialized states read the anchor: its format bounds their relative error."""
    return OUTPUT_BOUND[rs.get_precision(preset).anchor.name]


# ------------------------------------------------------------------------------------------------
# Layers: constants, random token inputs, the public calls and the float64 reference step
# ------------------------------------------------------------------------------------------------
class Mamba2Layer:
    """A-in [-2, -0.3], dt_bias the inverse softplus of a log-uniform dt in [0.01, 1], D, z gate."""

    arch = "mamba2"

    def __init__(self, gen, device, nheads, headdim, dstate, ngroups):
        self.H, self.P, self.N, self.G = nheads, headdim, dstate, ngroups
        self.device, self.gen = device, gen
        u = lambda *s: torch.rand(*s, generator=gen, device=device)  # noqa: E731
        self.A = -0.3 - 1.7 * u(nheads)
        dt0 = torch.exp(math.log(0.01) + math.log(100.0) * u(nheads))
        self.dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
        self.D = torch.randn(nheads, generator=gen, device=device)
        self.state_shape = (nheads, headdim, dstate)

    def cache(self, num_slots, **kw):
        return rs.Mamba2Cache(num_slots, self.H, self.P, self.N, ngroups=self.G, **kw)

    def tokens(self, b, T):
        H, P, N, G, g, d = self.H, self.P, self.N, self.G, self.gen, self.device
        return {"x": torch.randn(b, T, H, P, generator=g, device=d),
                "dt": 0.5 * torch.randn(b, T, H, generator=g, device=d),
                "B": torch.randn(b, T, G, N, generator=g, device=d) / math.sqrt(N),
                "C": torch.randn(b, T, G, N, generator=g, device=d),
                "z": torch.randn(b, T, H, P, generator=g, device=d)}

    def poison(self, tok, row, t):
        tok["x"][row, t, 0, 0] = float("nan")
        tok["B"][row, t, 0, 0] = float("inf")

    def _consts(self):
        return dict(A=self.A, D=self.D, dt_bias=self.dt_bias, dt_softplus=True)

    def call(self, cache, slots, tok, verify, backend):
        if verify:
            return rs.mamba2_verify(cache, slots, **tok, **self._consts(), backend=backend)
        one = {k: v[:, 0] for k, v in tok.items()}
        return rs.mamba2_decode(cache, slots, **one, **self._consts(), backend=backend)[:, None]

    def reference_step(self, state, tok, t):
        g = {k: v[:, t] for k, v in tok.items()}
        return rs.mamba2_reference_step(state, g["x"], g["dt"], self.A, g["B"], g["C"], self.D, g["z"],
                                        self.dt_bias, True)


class GDNLayer:
    """q, k L2-normalized in the call; decays exp(g) log-uniform in [0.7, 0.999]; beta in [0.05, 1]."""

    arch = "gdn"

    def __init__(self, gen, device, num_k_heads, num_v_heads, head_k_dim, head_v_dim):
        self.HK, self.HV, self.K, self.V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.device, self.gen = device, gen
        self.state_shape = (num_v_heads, head_v_dim, head_k_dim)

    def cache(self, num_slots, **kw):
        return rs.GDNCache(num_slots, self.HK, self.HV, self.K, self.V, **kw)

    def tokens(self, b, T):
        HK, HV, K, V, g, d = self.HK, self.HV, self.K, self.V, self.gen, self.device
        u = lambda *s: torch.rand(*s, generator=g, device=d)  # noqa: E731
        return {"q": torch.randn(b, T, HK, K, generator=g, device=d),
                "k": torch.randn(b, T, HK, K, generator=g, device=d),
                "v": torch.randn(b, T, HV, V, generator=g, device=d),
                "g": math.log(0.7) + (math.log(0.999) - math.log(0.7)) * u(b, T, HV),
                "beta": 0.05 + 0.95 * u(b, T, HV)}

    def poison(self, tok, row, t):
        tok["v"][row, t, 0, 0] = float("nan")
        tok["k"][row, t, 0, 0] = float("inf")

    def call(self, cache, slots, tok, verify, backend):
        if verify:
            return rs.gdn_verify(cache, slots, **tok, use_qk_l2norm=True, backend=backend)
        one = {k: v[:, 0] for k, v in tok.items()}
        return rs.gdn_decode(cache, slots, **one, use_qk_l2norm=True, backend=backend)[:, None]

    def reference_step(self, state, tok, t):
        g = {k: v[:, t] for k, v in tok.items()}
        return rs.gdn_reference_step(state, g["q"], g["k"], g["v"], g["g"], g["beta"], use_qk_l2norm=True)


LAYERS = {"mamba2": Mamba2Layer, "gdn": GDNLayer}


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------
@dataclass
class Request:
    rid: int
    length: int  # tokens to commit before it finishes
    start: object  # at admission: "prefill" (a fresh state), None (reset) or an fp32 state to load
    ref: torch.Tensor | None  # float64 committed state [1, ...] while not running
    done: int = 0  # committed tokens
    h: int = 0  # committed entries since the checkpoint, as the refresh rule predicts
    since_load: int = 0  # committed tokens since its slot was loaded (the cache's `tokens`)
    slot: int = -1
    poison_at: int = -1  # token index fed NaN/Inf (-1: never)
    poisoned: bool = False  # a NaN/Inf token was committed: its outputs are no longer checked


class Soak:
    """One soak run. ``figures()`` after ``run()``; ``check()`` raises on any violated bound."""

    def __init__(self, arch, preset="s32_rs", *, geometry, backend="torch", device="cpu", num_slots=8,
                 window=8, max_draft=3, requests=100, min_len=1, max_len=24, seed=0, p_spec=0.4,
                 p_preempt=0.05, p_fork=0.04, p_save=0.02, p_empty=0.15, nan_requests=2,
                 max_rounds=None, budget_s=None, buffer_dtype=torch.float32):
        self.rng = random.Random(seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layer = LAYERS[arch](gen, device, **geometry)
        self.arch, self.preset, self.backend, self.device = arch, preset, backend, device
        self.cache_kw = dict(window=window, max_draft=max_draft, precision=preset, device=device,
                             buffer_dtype=buffer_dtype, seed=seed + 1)
        self.num_slots, self.window, self.max_draft = num_slots, window, max_draft
        self.cache = self.layer.cache(num_slots, **self.cache_kw)
        self.ref = torch.zeros(num_slots, *self.layer.state_shape, dtype=torch.float64, device=device)
        self.n_requests, self.min_len, self.max_len = requests, min_len, max_len
        self.p = dict(spec=p_spec, preempt=p_preempt, fork=p_fork, save=p_save, empty=p_empty)
        self.nan_ids = set(self.rng.sample(range(requests), min(nan_requests, requests)))  # by creation order
        self.max_rounds, self.budget_s = max_rounds, budget_s
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: list[Request] = []
        self.created = self.arrived = 0  # all requests; those that arrived (not forked)
        self.f = dict(requests_finished=0, tokens=0, rounds=0, decode_calls=0, verify_calls=0,
                      drafts=0, drafts_accepted=0, preemptions=0, resumes=0, forks=0, restores=0,
                      restores_pending=0, resets=0, loads=0, nan_requests=0, nan_fed=0,
                      nan_committed=0, pad_rows=0,
                      int32_calls=0, token_mismatches=0, max_abs_err=0.0, max_rel_err=0.0,
                      run_rel_err=0.0, max_state_rel_err=0.0, max_ref=0.0)
        self._num = self._den = 0.0
        self.seconds = 0.0
        self.stopped_by_budget = False

    # ---- helpers ---------------------------------------------------------------------------
    def _ids(self, ids):
        """A slot-id tensor of random dtype."""
        dtype = torch.int32 if self.rng.random() < 0.5 else torch.int64
        self.f["int32_calls"] += dtype == torch.int32
        return torch.tensor(ids, dtype=dtype, device=self.device)

    def _with_pads(self, reqs):
        """Batch rows: the requests and 0-2 pads (None), in random order."""
        rows = list(reqs) + [None] * self.rng.randint(0, 2)
        self.rng.shuffle(rows)
        self.f["pad_rows"] += len(rows) - len(reqs)
        return rows

    def _new_request(self, start, ref):
        rid = self.created
        self.created += 1
        length = self.rng.randint(self.min_len, self.max_len)
        r = Request(rid, length, start, ref)
        if rid in self.nan_ids:
            r.poison_at = self.rng.randrange(length)
            self.f["nan_requests"] += 1
        return r

    def _running(self):
        return [r for r in self.slots if r is not None]

    def _state_check(self, reqs):
        """Materialize the requests' slots (random order, pads) and compare with the reference
        states and the predicted cursors. Returns the materialized fp32 states by request id."""
        rows = self._with_pads(reqs)
        ids = self._ids([-1 if r is None else r.slot for r in rows])
        S = self.cache.materialize(ids)
        cur = {k: v.tolist() for k, v in self.cache.counters(ids).items()}
        real = [i for i, r in enumerate(rows) if r is not None]
        pads = [i for i, r in enumerate(rows) if r is None]
        if pads:
            assert not S[pads].any(), "a pad row of materialize is not zero"
        for i in real:
            r = rows[i]
            if (cur["committed"][i], cur["pending"][i], cur["tokens"][i]) != (r.h, 0, r.since_load):
                self.f["token_mismatches"] += 1
        exact = [i for i in real if not rows[i].poisoned]
        if exact:
            ref = self.ref[torch.tensor([rows[i].slot for i in exact], device=self.device)]
            d = (S[exact].double() - ref).flatten(1).norm(dim=1)
            rel = (d / ref.flatten(1).norm(dim=1).clamp(min=1e-30)).max().item()
            self.f["max_state_rel_err"] = max(self.f["max_state_rel_err"], rel)
        return {rows[i].rid: S[i:i + 1].clone() for i in real}

    def _compare(self, y, yref, rows, fed):
        """Outputs y [b, T, ...] against float64 yref [n, T, ...] of the real rows, in order.
        Pad rows must be exactly zero, the rows of requests never fed NaN/Inf finite and close."""
        real = [i for i, r in enumerate(rows) if r is not None]
        pads = [i for i, r in enumerate(rows) if r is None]
        if pads:
            assert not y[pads].any(), "pad outputs must be exactly zero"
        exact = [j for j, i in enumerate(real) if not rows[i].poisoned and rows[i].rid not in fed]
        if not exact:
            return
        yy = y[[real[j] for j in exact]].double()
        finite = torch.isfinite(yy).flatten(1).all(1).tolist()
        if not all(finite):  # its own outputs may be non-finite only after a NaN/Inf feed
            bad = rows[real[exact[finite.index(False)]]].rid
            raise AssertionError(f"non-finite output for request {bad} (not fed NaN/Inf)")
        yr = yref[exact]
        d = yy - yr
        abs_err, ref_max, num, den = torch.stack([d.abs().max(), yr.abs().max(), d.pow(2).sum(),
                                                  yr.pow(2).sum()]).tolist()
        self.f["max_abs_err"] = max(self.f["max_abs_err"], abs_err)
        self.f["max_ref"] = max(self.f["max_ref"], ref_max)
        if den > 0:
            self.f["max_rel_err"] = max(self.f["max_rel_err"], math.sqrt(num / den))
        self._num += num
        self._den += den
        self.f["run_rel_err"] = math.sqrt(self._num / max(self._den, 1e-300))

    # ---- the lifecycle ---------------------------------------------------------------------
    def arrive(self):
        """0-2 new requests, while the queue is shorter than the batch (admission control)."""
        for _ in range(self.rng.choice([0, 0, 1, 1, 2])):
            if self.arrived >= self.n_requests or len(self.waiting) >= self.num_slots:
                return
            self.arrived += 1
            empty = self.rng.random() < self.p["empty"]  # empty prompt: the slot is just reset
            self.waiting.append(self._new_request(None if empty else "prefill", None))

    def admit(self):
        free = [s for s, r in enumerate(self.slots) if r is None]
        self.rng.shuffle(free)
        loads, resets = [], []
        while free and self.waiting:
            r = self.waiting.pop(0)
            r.slot = free.pop()
            self.slots[r.slot] = r
            if isinstance(r.start, str):  # the prefill hands its state over
                r.start = 0.5 * torch.randn(1, *self.layer.state_shape, generator=self.layer.gen,
                                            device=self.device)
                r.ref = r.start.double()
            elif r.start is None and r.ref is None:
                r.ref = torch.zeros(1, *self.layer.state_shape, dtype=torch.float64, device=self.device)
            self.ref[r.slot] = r.ref[0]
            r.ref, r.h, r.since_load = None, 0, 0
            (resets if r.start is None else loads).append(r)
        if loads:
            rows = self._with_pads(loads)
            states = torch.cat([torch.zeros(1, *self.layer.state_shape, device=self.device)
                                if r is None else r.start for r in rows])
            self.cache.load_state(self._ids([-1 if r is None else r.slot for r in rows]), states)
            self.f["loads"] += len(loads)
        if resets:
            self.cache.reset(self._ids([-1 if r is None else r.slot for r in self._with_pads(resets)]))
            self.f["resets"] += len(resets)
        for r in loads + resets:
            r.start = None

    def _release(self, r):
        """Free a request's slot; its reference state leaves the pool with it."""
        r.ref = self.ref[r.slot:r.slot + 1].clone()
        self.slots[r.slot] = None
        r.slot = -1

    def preempt(self):
        running = self._running()
        if not running or self.rng.random() >= self.p["preempt"]:
            return
        r = self.rng.choice(running)
        r.start = self._state_check([r])[r.rid]  # resumes from the materialized state
        self._release(r)
        self.waiting.append(r)
        self.f["preemptions"] += 1
        self.f["resumes"] += 1

    def fork(self):
        cands = [r for r in self._running() if r.done > 0 and not r.poisoned]
        # forked requests come on top of the arrivals, up to a tenth of them (at least one fork)
        if not cands or self.rng.random() >= self.p["fork"] or self.f["forks"] >= max(1, self.n_requests // 20):
            return
        r = self.rng.choice(cands)
        S = self._state_check([r])[r.rid]
        for _ in range(2):
            child = self._new_request(S.clone(), self.ref[r.slot:r.slot + 1].clone())
            self.waiting.insert(0, child)
        self.f["forks"] += 1

    def save_restore(self, pending):
        """state_dict -> torch.save -> torch.load -> a freshly built cache, which carries on."""
        buf = io.BytesIO()
        torch.save(self.cache.state_dict(), buf)
        buf.seek(0)
        fresh = self.layer.cache(self.num_slots, **self.cache_kw)
        fresh.load_state_dict(torch.load(buf, map_location=self.device))
        self.cache = fresh
        self.f["restores"] += 1
        self.f["restores_pending"] += pending

    def _step(self, reqs, T, verify, counts=None):
        """One verify (T drafts) or decode call over ``reqs``, checked against the reference.
        For a verify, ``counts`` are the drafts each request will accept (chosen beforehand so
        that one reference pass gives both the outputs and the committed states)."""
        rows = self._with_pads(reqs)
        tok = self.layer.tokens(len(rows), T)
        fed = {}
        for i, r in enumerate(rows):
            if r is not None and r.poison_at >= 0 and r.done <= r.poison_at < r.done + T:
                self.layer.poison(tok, i, r.poison_at - r.done)
                fed[r.rid] = r.poison_at - r.done
                self.f["nan_fed"] += 1
        ids = self._ids([-1 if r is None else r.slot for r in rows])
        y = self.layer.call(self.cache, ids, tok, verify, self.backend)
        real = [i for i, r in enumerate(rows) if r is not None]
        sl = torch.tensor([rows[i].slot for i in real], device=self.device)
        sub = {k: v[real] for k, v in tok.items()}
        by_req = dict(zip([r.rid for r in reqs], counts)) if verify else {}
        n_list = [by_req.get(rows[i].rid, 1) for i in real]
        n = torch.tensor(n_list, device=self.device)
        st = committed = self.ref[sl]
        outs = []
        for t in range(T):
            yr, st = self.layer.reference_step(st, sub, t)
            outs.append(yr)
            keep = (t < n).view(-1, *([1] * (st.dim() - 1)))
            committed = torch.where(keep, st, committed)
        self._compare(y, torch.stack(outs, 1), rows, fed)
        self.ref[sl] = committed
        for j, i in enumerate(real):
            r = rows[i]
            if r.h + T > self.window:  # the refresh rule: fold the committed entries first
                r.h = 0
            k = n_list[j]
            if r.rid in fed and fed[r.rid] < k:
                r.poisoned = True  # a NaN/Inf token was committed
                self.f["nan_committed"] += 1
            r.h += k
            r.done += k
            r.since_load += k
            self.f["tokens"] += k
        return rows

    def round(self):
        running = self._running()
        self.rng.shuffle(running)
        spec = [r for r in running if self.rng.random() < self.p["spec"]]
        rest = [r for r in running if r not in spec]
        T = self.rng.randint(1, self.max_draft)
        counts = [self.rng.randint(0, min(T, r.length - r.done)) for r in spec]
        if spec:
            rows = self._step(spec, T, True, counts)
            self.f["verify_calls"] += 1
            self.f["drafts"] += T * len(spec)
            self.f["drafts_accepted"] += sum(counts)
        save_at = self.rng.random() < self.p["save"]
        if spec and save_at and self.rng.random() < 0.5:
            self.save_restore(pending=True)
            save_at = False
        if rest:
            self._step(rest, 1, False)
            self.f["decode_calls"] += 1
        if spec:  # accept in a fresh random order, with pads
            by_req = dict(zip([r.rid for r in spec], counts))
            arows = self._with_pads([r for r in rows if r is not None])
            ids = self._ids([-1 if r is None else r.slot for r in arows])
            n = torch.tensor([self.rng.randint(0, T) if r is None else by_req[r.rid] for r in arows],
                             dtype=torch.int32 if self.rng.random() < 0.5 else torch.int64, device=self.device)
            self.cache.accept(ids, n, backend=self.backend)
        if save_at:
            self.save_restore(pending=False)
        self.f["rounds"] += 1

    def retire(self):
        done = [r for r in self._running() if r.done >= r.length]
        if not done:
            return
        self._state_check(done)
        slots = [r.slot for r in done]
        for r in done:
            if r.done != r.length:
                self.f["token_mismatches"] += 1
            self._release(r)
            r.ref = None
            self.f["requests_finished"] += 1
        rows = self._with_pads(slots)
        self.cache.reset(self._ids([-1 if s is None else s for s in rows]))

    def run(self):
        t0 = time.perf_counter()
        while self.arrived < self.n_requests or self.waiting or self._running():
            if self.max_rounds is not None and self.f["rounds"] >= self.max_rounds:
                break
            if self.budget_s is not None and time.perf_counter() - t0 > self.budget_s:
                self.stopped_by_budget = True
                break
            self.arrive()
            self.admit()
            self.preempt()
            self.fork()
            if self._running():
                self.round()
            self.retire()
            if self.f["rounds"] % 64 == 0 and self._running():
                self._state_check(self._running())
        if self.device != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - t0
        return self

    # ---- figures ---------------------------------------------------------------------------
    def figures(self) -> dict:
        return {"arch": self.arch, "preset": self.preset, "backend": self.backend,
                "requests": self.created, **self.f, "output_bound": output_bound(self.preset),
                "state_bound": state_bound(self.preset), "seconds": round(self.seconds, 2),
                "stopped_by_budget": self.stopped_by_budget}

    def check(self, out_bound=None, st_bound=None):
        """Raise AssertionError unless no token was lost or counted twice and the errors are
        within the bounds (default: ``output_bound`` / ``state_bound`` of the preset)."""
        f = self.f
        out_bound = output_bound(self.preset) if out_bound is None else out_bound
        st_bound = state_bound(self.preset) if st_bound is None else st_bound
        assert f["token_mismatches"] == 0, f"{f['token_mismatches']} lost or duplicated token counts"
        assert f["run_rel_err"] <= out_bound, f"{self.preset} output error {f['run_rel_err']:.3e} > {out_bound:.1e}"
        assert f["max_rel_err"] <= 2 * out_bound, \
            f"{self.preset} output error of a call {f['max_rel_err']:.3e} > {2 * out_bound:.1e}"
        assert f["max_state_rel_err"] <= st_bound, \
            f"{self.preset} state error {f['max_state_rel_err']:.3e} > {st_bound:.1e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=["mamba2", "gdn"], choices=sorted(LAYERS))
    ap.add_argument("--presets", nargs="+", default=list(rs.REPRODUCTION_PRESETS),
                    help="preset names, or 'all' for every preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, choices=["torch", "triton"],
                    help="default: triton on CUDA, torch on the CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (CPU runs)")
    ap.add_argument("--batch", type=int, default=64, help="slots (the batch of a full round)")
    ap.add_argument("--steps", type=int, default=10000, help="rounds per run (at most)")
    ap.add_argument("--requests", type=int, default=None, help="default: enough for --steps")
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all runs together")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    a = ap.parse_args(argv)
    presets = sorted(rs.PRESETS) if a.presets == ["all"] else a.presets
    backend = a.backend or ("triton" if a.device.startswith("cuda") else "torch")
    if backend == "triton" and not a.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is defined
    geo = (TINY_TRITON if backend == "triton" else TINY) if a.tiny else REAL
    runs = [(arch, p) for arch in a.arch for p in presets]
    # requests of mean length L/2 over `batch` slots for `steps` rounds (about 1.3 tokens per round)
    requests = a.requests or max(4, int(a.steps * a.batch * 1.3 / max(1, a.max_len / 2)))
    results, ok = [], True
    t_all = time.perf_counter()
    for i, (arch, preset) in enumerate(runs):
        left = a.budget - (time.perf_counter() - t_all)
        s = Soak(arch, preset, geometry=geo[arch], backend=backend, device=a.device, num_slots=a.batch,
                 window=a.window, max_draft=a.max_draft, requests=requests, max_len=a.max_len,
                 seed=a.seed + i, p_save=min(0.02, 10.0 / a.steps), max_rounds=a.steps,
                 budget_s=max(1.0, left / (len(runs) - i))).run()
        f = s.figures()
        try:
            s.check()
            f["ok"] = True
        except AssertionError as e:
            f["ok"], ok = False, False
            f["failure"] = str(e)
        results.append(f)
        print(json.dumps(f), flush=True)
    print(f"{'arch':7} {'preset':12} {'backend':7} {'reqs':>6} {'tokens':>8} {'rounds':>6} {'preempt':>7} "
          f"{'forks':>5} {'restore':>7} {'nan':>3} {'out rel':>9} {'call max':>9} {'bound':>7} {'state rel':>9} "
          f"{'lost/dup':>8} {'s':>6} ok")
    for f in results:
        print(f"{f['arch']:7} {f['preset']:12} {f['backend']:7} {f['requests']:6d} {f['tokens']:8d} "
              f"{f['rounds']:6d} {f['preemptions']:7d} {f['forks']:5d} {f['restores']:7d} "
              f"{f['nan_requests']:3d} {f['run_rel_err']:9.2e} {f['max_rel_err']:9.2e} {f['output_bound']:7.0e} "
              f"{f['max_state_rel_err']:9.2e} {f['token_mismatches']:8d} {f['seconds']:6.1f} {f['ok']}")
    short = [f"{f['arch']}:{f['preset']}" for f in results if f["stopped_by_budget"]]
    if short:
        print(f"stopped by the time budget before {a.steps} rounds: {' '.join(short)}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
