"""Shared test machinery: per-architecture layers (random inputs at realistic scales, the public
calls, the float64 oracle), a reference-tracking driver, and bitwise cache snapshots.

Every accuracy check in the suite goes through ``Tracker``: it keeps the float64 committed state
of each slot, computed by the conventional recurrence (``rs.*_reference``) on exactly the inputs
the cache committed, and compares the cache's outputs against it. Nothing is ever compared against
the code under test or against stored outputs.
"""
from __future__ import annotations

import math

import torch

import replayssm as rs
from replayssm.geometry import GEOMETRIES
from replayssm.layers import LAYERS as CALLS
from replayssm.precision import S32_MAX_ABS

#: Measured figures, filled by the tests, printed by ``conftest.pytest_terminal_summary``.
MEASURED: dict = {}

#: Max abs error allowed for s32_rs (fp32 anchor, fp32 buffers) at unit-scale inputs.
S32_TOL = S32_MAX_ABS

#: Loose bound on max|y - y_ref| / max|y_ref| per read format (anchor drift included).
READ_BOUND = {"fp32": S32_TOL, "fp16": 2e-3, "bf16": 1.5e-2, "fp8_e4m3": 0.1, "nvfp4": 0.5}

#: The default test geometry (H, P, N, G), from the library's one geometry table.
TINY = GEOMETRIES["tiny"].geometry


def record(key, value):
    """Keep the worst (largest) figure seen under ``key`` for the end-of-run table."""
    MEASURED[key] = max(MEASURED.get(key, 0.0), float(value))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def uniform(g, shape, lo, hi):
    return lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float32)


def log_uniform(g, shape, lo, hi):
    return torch.exp(uniform(g, shape, math.log(lo), math.log(hi)))


# ------------------------------------------------------------------------------------------------
# Layers: geometry + layer constants + random token inputs + the public calls + the oracle
# ------------------------------------------------------------------------------------------------
class Mamba2Layer:
    """A Mamba-2 layer: H heads of [P, N], G groups. Constants A, D, dt_bias drawn from ``g``.

    dt_bias is the inverse softplus of a log-uniform dt in [0.01, 1] and A lies in [-2, -0.3],
    so per-token decays exp(A * softplus(dt_raw + dt_bias)) spread over (0, 1).
    """

    name = "mamba2"

    def __init__(self, g, nheads=TINY.H, headdim=TINY.P, dstate=TINY.N, ngroups=TINY.G):
        self.H, self.P, self.N, self.G = nheads, headdim, dstate, ngroups
        self.A = uniform(g, (nheads,), -2.0, -0.3)
        dt0 = log_uniform(g, (nheads,), 0.01, 1.0)
        self.dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # softplus(dt_bias) = dt0
        self.D = torch.randn(nheads, generator=g)

    @property
    def state_shape(self):
        return (self.H, self.P, self.N)

    def cache(self, num_slots, **kw):
        return rs.Mamba2Cache(num_slots, self.H, self.P, self.N, ngroups=self.G, **kw)

    def tokens(self, g, b, T):
        H, P, N, G = self.H, self.P, self.N, self.G
        return {"x": torch.randn(b, T, H, P, generator=g),
                "dt": 0.5 * torch.randn(b, T, H, generator=g),
                "B": torch.randn(b, T, G, N, generator=g),
                "C": torch.randn(b, T, G, N, generator=g),
                "z": torch.randn(b, T, H, P, generator=g)}

    def _consts(self):
        return {"A": self.A, "D": self.D, "dt_bias": self.dt_bias, "dt_softplus": True}

    def run(self, cache, slots, tok, verify):
        """The public decode / verify call (``replayssm.layers``); outputs [b, T, H, P]."""
        return CALLS["mamba2"].call(cache, slots, tok, self._consts(), verify)

    def reference(self, state, tok):
        return rs.mamba2_reference(state, **tok, **self._consts())


class GDNLayer:
    """A Gated DeltaNet layer: HK key heads of dim K, HV value heads of dim V (GQA ratio HV/HK).

    q, k unit-normalized in the kernel (use_qk_l2norm=True); decays exp(g) log-uniform in
    [0.7, 0.999]; beta uniform in [0.05, 1].
    """

    name = "gdn"

    def __init__(self, g, num_k_heads=TINY.G, num_v_heads=TINY.H, head_k_dim=TINY.N, head_v_dim=TINY.P):
        self.HK, self.HV, self.K, self.V = num_k_heads, num_v_heads, head_k_dim, head_v_dim

    @property
    def state_shape(self):
        return (self.HV, self.V, self.K)

    def cache(self, num_slots, **kw):
        return rs.GDNCache(num_slots, self.HK, self.HV, self.K, self.V, **kw)

    def tokens(self, g, b, T):
        HK, HV, K, V = self.HK, self.HV, self.K, self.V
        return {"q": torch.randn(b, T, HK, K, generator=g),
                "k": torch.randn(b, T, HK, K, generator=g),
                "v": torch.randn(b, T, HV, V, generator=g),
                "g": torch.log(log_uniform(g, (b, T, HV), 0.7, 0.999)),
                "beta": uniform(g, (b, T, HV), 0.05, 1.0)}

    def run(self, cache, slots, tok, verify):
        """The public decode / verify call (``replayssm.layers``); outputs [b, T, HV, V]."""
        return CALLS["gdn"].call(cache, slots, tok, {}, verify)

    def reference(self, state, tok):
        return rs.gdn_reference(state, **tok, use_qk_l2norm=True)


class KDALayer(GDNLayer):
    """A Kimi Delta Attention layer: the GDN geometry with one log decay per key channel,
    g [b, T, HV, K], decays exp(g) log-uniform in [0.2, 0.9999] per channel."""

    name = "kda"
    backend = None

    def cache(self, num_slots, **kw):
        return rs.KDACache(num_slots, self.HK, self.HV, self.K, self.V, **kw)

    def tokens(self, g, b, T):
        tok = super().tokens(g, b, T)
        tok["g"] = torch.log(log_uniform(g, (b, T, self.HV, self.K), 0.2, 0.9999))
        return tok

    def run(self, cache, slots, tok, verify):
        if verify:
            return rs.kda_verify(cache, slots, **tok, use_qk_l2norm=True, backend=self.backend)
        one = {k: v[:, 0] for k, v in tok.items()}
        return rs.kda_decode(cache, slots, **one, use_qk_l2norm=True, backend=self.backend)[:, None]

    def reference(self, state, tok):
        return rs.kda_reference(state, **tok, use_qk_l2norm=True)


LAYERS = {"mamba2": Mamba2Layer, "gdn": GDNLayer, "kda": KDALayer}


def make_layer(arch, seed=0, **geometry):
    return LAYERS[arch](generator(seed), **geometry)


def take(tok, i, n=None):
    """Row ``i`` of every token input, first ``n`` draft positions (all when None)."""
    return {k: v[i:i + 1, :n] for k, v in tok.items()}


# ------------------------------------------------------------------------------------------------
# Bitwise snapshots
# ------------------------------------------------------------------------------------------------
def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def snapshot(cache, rows=None):
    """Every tensor of the cache as raw bytes (NaN-safe bitwise comparison); ``rows`` selects
    storage rows (every tensor of the cache is indexed by row first)."""
    out = {}
    for k, v in cache.state_dict().items():
        if k == "config":
            continue
        out[k] = _bytes(v if rows is None else v[rows])
    return out


def snapshot_diff(a, b):
    """Names of the entries whose bytes differ between two snapshots. Entries only ``b`` has must be
    the buffer of a cache that follows its inputs, allocated by its first decode or verify."""
    assert a.keys() <= b.keys() and all(k.startswith("buffer.") for k in b.keys() - a.keys())
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def parts_equal(p, q):
    """Bitwise equality of two dicts of physical format parts."""
    return p.keys() == q.keys() and all(torch.equal(_bytes(p[k]), _bytes(q[k])) for k in p)


def slot_parts(parts, slots):
    return {k: v[slots] for k, v in parts.items()}


# ------------------------------------------------------------------------------------------------
# The reference-tracking driver
# ------------------------------------------------------------------------------------------------
class Tracker:
    """Drive a cache through the public API and measure it against the float64 recurrence.

    Keeps per slot: the float64 committed state (the oracle run on the committed inputs), and the
    counters the refresh rule predicts (h, refreshes, tokens). ``slots`` arguments are Python
    lists of slot ids, -1 for pads.
    """

    def __init__(self, layer, cache, seed=1, check_untouched=True):
        self.layer, self.cache, self.g = layer, cache, generator(seed)
        self.ref, self.h, self.refreshes, self.tokens = {}, {}, {}, {}
        self.pending = None  # (slots, tok) of the verify awaiting accept
        self.max_err = 0.0
        self.max_ref = 0.0
        self.max_rel = 0.0  # max over elements of |y - y_ref| / max(1, |y_ref|)
        self.check_untouched = check_untouched

    @staticmethod
    def t(slots):
        return torch.tensor(slots, dtype=torch.int64)

    def load(self, slots, scale=1.0, rows=None):
        """Random states for ``slots``, times ``scale``; ``rows`` [dv]: each state row's factor on top."""
        b = len(slots)
        state = scale * torch.randn(b, *self.layer.state_shape, generator=self.g)
        if rows is not None:
            state = state * rows[:, None]
        self.cache.load_state(self.t(slots), state)
        for i, s in enumerate(slots):
            if s >= 0:
                self.ref[s] = state[i:i + 1].double()
                self.h[s], self.refreshes[s], self.tokens[s] = 0, 0, 0

    def step(self, slots, T=None):
        """A decode (T None) or a verify of T drafts on ``slots``. Returns (y, max abs error)."""
        verify = T is not None
        T = T or 1
        real = [s for s in slots if s >= 0]
        others = [s for s in self.ref if s not in real]
        before = snapshot(self.cache, others) if (self.check_untouched and others) else None
        tok = self.layer.tokens(self.g, len(slots), T)
        y = self.layer.run(self.cache, self.t(slots), tok, verify)
        assert y.dtype == torch.float32
        if before is not None:
            assert snapshot_diff(before, snapshot(self.cache, others)) == [], \
                "a slot outside the batch was modified"
        err = 0.0
        for i, s in enumerate(slots):
            if s < 0:
                assert torch.equal(y[i], torch.zeros_like(y[i])), "pad outputs must be exactly zero"
                continue
            assert torch.isfinite(y[i]).all(), f"non-finite output for slot {s}"
            yref, st = self.layer.reference(self.ref[s], take(tok, i))
            e = (y[i:i + 1].double() - yref).abs()
            err = max(err, e.max().item())
            self.max_ref = max(self.max_ref, yref.abs().max().item())
            self.max_rel = max(self.max_rel, (e / yref.abs().clamp(min=1.0)).max().item())
            if self.h[s] + T > self.cache.window:  # the refresh rule
                self.h[s] = 0
                self.refreshes[s] += 1
            if not verify:
                self.ref[s] = st
                self.h[s] += 1
                self.tokens[s] += 1
        if verify:
            self.pending = (list(slots), tok)
        self.max_err = max(self.max_err, err)
        return y, err

    def decode(self, slots):
        return self.step(slots)

    def verify(self, slots, T):
        return self.step(slots, T)

    def accept(self, counts):
        """Accept ``counts[i]`` drafts for row i of the pending verify (pads: any value)."""
        slots, tok = self.pending
        accept = getattr(self.layer, "accept", None)  # a layer may route accept to a backend
        if accept is None:
            self.cache.accept(self.t(slots), torch.tensor(counts, dtype=torch.int64))
        else:
            accept(self.cache, self.t(slots), torch.tensor(counts, dtype=torch.int64))
        for i, s in enumerate(slots):
            if s >= 0:
                n = counts[i]
                _, self.ref[s] = self.layer.reference(self.ref[s], take(tok, i, n))
                self.h[s] += n
                self.tokens[s] += n
        self.pending = None

    def expected_counters(self, slots):
        return {"committed": [self.h[s] for s in slots], "pending": [0] * len(slots),
                "refreshes": [self.refreshes[s] for s in slots], "tokens": [self.tokens[s] for s in slots]}

    def check_counters(self, slots):
        got = {k: v.tolist() for k, v in self.cache.counters(self.t(slots)).items()}
        assert got == self.expected_counters(slots)

    def state_error(self, slots):
        """Max abs error of ``materialize`` against the float64 committed states."""
        m = self.cache.materialize(self.t(slots))
        assert torch.isfinite(m).all()
        ref = torch.cat([self.ref[s] for s in slots])
        return (m.double() - ref).abs().max().item()


# ------------------------------------------------------------------------------------------------
# Scenarios shared by the per-architecture test files
# ------------------------------------------------------------------------------------------------
#: Buffer field whose perturbation changes the very next output (teeth checks).
PERTURB_FIELD = {"mamba2": "x", "gdn": "k", "kda": "k"}


def decode_accuracy(arch, steps=48, window=16, precision="s32_rs", seed=0):
    """Decode ``steps`` tokens on 3 of 4 slots (plus a pad) and check every output, every
    committed state and every counter against the float64 recurrence and the refresh rule.
    Returns (tracker, max output error, max state error)."""
    layer = make_layer(arch, seed)
    cache = layer.cache(4, window=window, precision=precision)
    tr = Tracker(layer, cache, seed=seed + 1)
    tr.load([2, 0, 3, 1])
    batch = [2, -1, 0, 3]
    real = [2, 0, 3]
    state_err = 0.0
    for _ in range(steps):
        tr.decode(batch)
        tr.check_counters(real + [1])
        state_err = max(state_err, tr.state_error(real))
    return tr, tr.max_err, state_err


def broken_refresh(cache, skip_calls=(0,)):
    """A refresh that, on the listed calls, drops the committed history instead of folding it
    (moves the pointer and counts, but writes no checkpoint)."""
    orig = cache.refresh
    calls = [0]

    def refresh(rows, need):
        i = calls[0]
        calls[0] += 1
        if i in skip_calls:
            cache.committed[rows] = torch.where(need, 0, cache.committed[rows])
            cache.refreshes[rows] += need.long()
            return
        orig(rows, need)
    return refresh


def check_explicit_scale(arch):
    """GDN / KDA: q, k passed already unit-norm with an explicit scale (no in-kernel normalization)
    decode as the float64 recurrence does with that scale."""
    decode, reference_step = {"gdn": (rs.gdn_decode, rs.gdn_reference_step),
                              "kda": (rs.kda_decode, rs.kda_reference_step)}[arch]
    layer = make_layer(arch)
    cache = layer.cache(1, window=4)
    g = torch.Generator().manual_seed(5)
    S = torch.randn(1, *layer.state_shape, generator=g)
    cache.load_state(torch.tensor([0]), S)
    ref = S.double()
    err = 0.0
    for _ in range(6):
        tok = {k: v[:, 0] for k, v in layer.tokens(g, 1, 1).items()}
        tok["q"] = torch.nn.functional.normalize(tok["q"], dim=-1)
        tok["k"] = torch.nn.functional.normalize(tok["k"], dim=-1)
        o = decode(cache, torch.tensor([0]), **tok, scale=0.5)
        oref, ref = reference_step(ref, **tok, scale=0.5)
        err = max(err, (o.double() - oref).abs().max().item())
    assert err <= S32_TOL


def check_decode_accuracy(arch, record_property):
    """Requirement 1: >= 48 s32_rs decode steps (2 refreshes at window 16) vs the reference."""
    tr, err, state_err = decode_accuracy(arch, steps=48, window=16)
    print(f"\n{arch} s32_rs decode: max abs output error {err:.3e}, state error {state_err:.3e} "
          f"(max |y_ref| {tr.max_ref:.2f})")
    record_property("max_abs_err", err)
    record_property("max_state_err", state_err)
    record(f"{arch} s32_rs decode out", err)
    record(f"{arch} s32_rs decode state", state_err)
    assert tr.refreshes[0] == 2 and tr.h[0] == 16  # refreshes before tokens 17 and 33
    assert err <= S32_TOL
    assert state_err <= S32_TOL


def check_perturbed_buffer_detected(arch):
    """Teeth: one perturbed committed buffer value pushes the next output past the tolerance."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=16)
    tr = Tracker(layer, cache)
    tr.load([0, 1])
    for _ in range(5):
        tr.decode([0, 1])
    assert tr.max_err <= S32_TOL
    entry = cache.buffer[PERTURB_FIELD[arch]][1, 2].view(-1)
    entry[0] += 0.05 * entry.abs().max()  # relative: GDN and KDA keys are buffered before their L2 norm
    _, err = tr.decode([0, 1])
    assert err > 10 * S32_TOL


def check_skipped_refresh_detected(arch, monkeypatch):
    """Teeth: a refresh that drops its window instead of folding it breaks outputs and state."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=8)
    monkeypatch.setattr(cache, "refresh", broken_refresh(cache))
    tr = Tracker(layer, cache)
    tr.load([0, 1])
    errs = [tr.decode([0, 1])[1] for _ in range(10)]
    assert max(errs[:8]) <= S32_TOL  # the window is not yet full
    assert errs[8] > 1e-3  # the first window's history is lost
    assert tr.state_error([0, 1]) > 1e-3


def any_dims(arch, dv, dk):
    """A two-head geometry of state [dv, dk] (GDN, KDA: one key head)."""
    if arch == "mamba2":
        return dict(nheads=2, headdim=dv, dstate=dk, ngroups=1)
    return dict(num_k_heads=1, num_v_heads=2, head_k_dim=dk, head_v_dim=dv)


def refresh_schedule(layer, preset, tuning, seed, rows=None):
    """A Tracker over 3 slots (window 4, drafts up to 4; states loaded with ``Tracker.load``'s
    ``rows``) after decodes and verify rounds of 4 drafts with several accept counts, a pad and
    staggered slots, so that every slot refreshes in decodes and in verifies, run under
    ``launch.TUNING`` = ``tuning`` (cleared after)."""
    from replayssm._triton import launch  # the Triton backend's tests only

    tr = Tracker(layer, layer.cache(3, window=4, max_draft=4, precision=preset), seed=seed)
    tr.load([0, 1, 2], rows=rows)
    tr.decode([2, 1])
    launch.TUNING.update(tuning)
    try:
        for r in range(2):
            tr.decode([0, -1, 2])
            tr.verify([1, -1, 2, 0], 4)
            tr.accept([r % 5, 0, 4, (r + 2) % 5])
    finally:
        launch.TUNING.clear()
    return tr


def check_any_dims(layer, preset, tuning, seed):
    """Decodes and verify rounds of 4 drafts with several accept counts, a pad and staggered slots,
    refreshes in decodes and in verifies (window 4), under ``launch.TUNING`` = ``tuning``: outputs
    within the read format's bound of the float64 recurrence (s32_rs: to fp32 accuracy), the
    committed states of the fp32 anchor to fp32 accuracy, the counters as the refresh rule has them."""
    tr = refresh_schedule(layer, preset, tuning, seed)
    tr.check_counters([0, 1, 2])
    assert min(tr.refreshes.values()) >= 1
    read = rs.get_precision(preset).read_format.name
    if read == "fp32":
        assert tr.max_rel <= 2e-5, tr.max_rel
    else:
        assert 1e-7 < tr.max_err / tr.max_ref <= READ_BOUND[read], tr.max_err / tr.max_ref
    assert tr.state_error([0, 1, 2]) <= 1e-5


# ------------------------------------------------------------------------------------------------
# A draft-tree drafter for the transformers integration tests
# ------------------------------------------------------------------------------------------------
def unpadded_rows(seqs, mask):
    """Each row of a left-padded batch without its padding: the prompt tokens ``mask`` keeps, then
    the generated ones (lists of ints; ``seqs`` [b, n + generated], ``mask`` [b, n])."""
    n = mask.shape[1]
    return [s[:n][mask[r] == 1].tolist() + s[n:].tolist() for r, s in enumerate(seqs.cpu())]


class RowDrafter:
    """Right for a random number of tokens (0 .. k) of the row's greedy continuation, then wrong
    (``speculative_generate`` drafter): in one step the rows accept different counts, and every
    count 0 .. k occurs. ``rows``: each row's tokens without padding, prompt + greedy continuation."""

    def __init__(self, rows, vocab, seed=0):
        self.rows, self.vocab = rows, vocab
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, tokens, k):
        t = tokens.tolist()
        ref = next((r for r in self.rows if r[:len(t)] == t), None)
        if ref is None:  # the row left every greedy continuation (a deliberately broken run)
            return []
        good = int(torch.randint(0, k + 1, (1,), generator=self.g))
        d = ref[len(t):len(t) + k]
        return d[:good] + [(x + 1) % self.vocab for x in d[good:]]


def handover_logits(model, ids, patched):
    """Last-position logits [17, vocab] of a hand-over run over ``ids`` [1, >= 20]: a 6-token
    prefill and 10 decodes (through ReplaySSM when ``patched``, ``integrations.transformers.patch``),
    a stock-shaped 4-token forward on the same cache, then unpatched, 3 more decodes on it. Against
    the all-stock run (``patched`` False) every logit must agree: the state goes back to
    transformers' layout at each hand-over."""
    from transformers import DynamicCache

    import replayssm.integrations.transformers as rst
    cache = DynamicCache(config=model.config)
    p = rst.patch(model, window=4, max_draft=4) if patched else None
    out = [model(input_ids=ids[:, :6], cache=cache, use_cache=True).logits[0, -1]]
    for t in range(6, 16):
        out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
    out.append(model(input_ids=ids[:, 16:20], cache=cache, use_cache=True).logits[0, -1])
    if p is not None:
        p.unpatch()
    for t in range(3):
        out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


class TreeRowDrafter:
    """Draft trees around each row's greedy continuation (``speculative_generate`` drafter).

    Each call draws a random tree of 1 .. k nodes (random parents, so siblings and orders vary by
    row and step) and a random node x of depth <= the known continuation (or the root): the nodes
    on the root path of x carry the row's greedy tokens, every other child of a path node carries
    a token that differs from the greedy one there, and the rest random tokens. So a correct
    verify accepts exactly the path to x (0 .. k drafts), and a verify that lets a node see
    anything but its ancestors, or commits anything but that path, leaves the greedy sequence.
    ``rows``: each row's tokens without padding, prompt + greedy continuation; ``chain_every``:
    every n-th call returns a plain chain instead (rows of one step mix chains and trees).
    """

    def __init__(self, rows, vocab, seed=0, chain_every=0):
        self.rows, self.vocab = rows, vocab
        self.g = torch.Generator().manual_seed(seed)
        self.chain_every, self.calls = chain_every, 0

    def _int(self, lo, hi):  # uniform in [lo, hi)
        return int(torch.randint(lo, hi, (1,), generator=self.g))

    def __call__(self, tokens, k):
        t = tokens.tolist()
        ref = next((r for r in self.rows if r[:len(t)] == t), None)
        if ref is None:  # the row left every greedy continuation (a deliberately broken run)
            return []
        d = ref[len(t):len(t) + k]
        self.calls += 1
        if self.chain_every and self.calls % self.chain_every == 0:
            good = self._int(0, len(d) + 1)
            return d[:good] + [(x + 1) % self.vocab for x in d[good:]]
        m = self._int(1, k + 1)
        parents = [self._int(-1, i) if i else -1 for i in range(m)]
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        ends = [-1] + [i for i in range(m) if depth[i] <= len(d)]
        x = ends[self._int(0, len(ends))]
        on_path = set()
        while x >= 0:
            on_path.add(x)
            x = parents[x]
        toks = []
        for i, p in enumerate(parents):
            right = d[depth[i] - 1] if depth[i] <= len(d) else None
            if i in on_path:
                toks.append(right)
            elif (p < 0 or p in on_path) and right is not None:  # a wrong sibling of the path
                toks.append((right + self._int(1, self.vocab)) % self.vocab)
            else:
                toks.append(self._int(0, self.vocab))
        return toks, parents


def _torch_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    class TorchOps(TorchDispatchMode):
        """Records the names of the PyTorch ops run inside ``with TorchOps() as ops:`` (``ops.names``)."""

        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return TorchOps


TorchOps = _torch_ops()
