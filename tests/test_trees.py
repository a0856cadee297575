"""Tree drafts (PyTorch backend): a verify with ``parents`` and an accept of a root path, for
Mamba-2, Gated DeltaNet and Kimi Delta Attention (per-channel decays in (0.2, 0.9999)).

Every output of every tree node is measured against the float64 conventional recurrence run along
that node's root path (the committed history, then its ancestors, then the node); every accepted
path is committed in the reference by running the recurrence along it, and the committed states
and the next rounds' outputs are measured against that.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import replayssm as rs
from replayssm import step
from helpers import S32_TOL, generator, make_layer, snapshot, snapshot_diff

ARCHS = ["mamba2", "gdn", "kda"]


def verify(layer, cache, slots, tok, parents, backend=None):
    """The public tree verify of the layer; outputs fp32 [b, T, ...]."""
    if layer.name == "mamba2":
        return rs.mamba2_verify(cache, slots, tok["x"], tok["dt"], layer.A, tok["B"], tok["C"], layer.D,
                                tok["z"], layer.dt_bias, dt_softplus=True, backend=backend, parents=parents)
    call = rs.kda_verify if layer.name == "kda" else rs.gdn_verify
    return call(cache, slots, **tok, use_qk_l2norm=True, backend=backend, parents=parents)


def root_path(parents, s):
    """Drafts from the root down to draft s (inclusive), as a list of indices."""
    out = []
    while s >= 0:
        out.append(s)
        s = parents[s]
    return out[::-1]


def random_parents(g, T, kind):
    """One row's parents: 'chain' (s - 1), 'flat' (every draft a child of -1) or a random tree."""
    if kind == "chain":
        return list(range(-1, T - 1))
    if kind == "flat":
        return [-1] * T
    return [int(torch.randint(-1, s, (1,), generator=g)) if s else -1 for s in range(T)]


class TreeDriver:
    """Drive a cache with tree verifies and path accepts; keep the float64 committed states."""

    def __init__(self, arch, num_slots=4, window=8, max_draft=5, seed=0, backend=None, geometry=None):
        self.layer = make_layer(arch, seed, **(geometry or {}))
        self.backend = backend  # of the verifies and accepts
        self.cache = self.layer.cache(num_slots, window=window, max_draft=max_draft)
        self.g = generator(seed + 1)
        slots = torch.arange(num_slots)
        state = torch.randn(num_slots, *self.layer.state_shape, generator=self.g)
        self.cache.load_state(slots, state)
        self.ref = {s: state[s:s + 1].double() for s in range(num_slots)}
        self.h = {s: 0 for s in range(num_slots)}
        self.refreshes = {s: 0 for s in range(num_slots)}
        self.max_err = 0.0
        self.moved = 0  # accepted paths that are not 0, 1, 2, ... (entries had to move)
        self.depths = set()  # (n, depth of the chosen node's path) accepted on real rows

    def take(self, tok, i, idx):
        return {k: v[i:i + 1, idx] for k, v in tok.items()}

    def round(self, slots, T, kinds, depth=None):
        """Verify a tree per row (``kinds`` per row), check every node, accept a random root
        path of a random depth (``depth`` forces it). Returns the max abs error of the round."""
        b = len(slots)
        tok = self.layer.tokens(self.g, b, T)
        par = [random_parents(self.g, T, k) for k in kinds]
        parents = torch.tensor(par, dtype=torch.int64)
        y = verify(self.layer, self.cache, torch.tensor(slots), tok, parents, self.backend)
        err = 0.0
        for i, s in enumerate(slots):
            if s < 0:
                assert torch.equal(y[i], torch.zeros_like(y[i]))
                continue
            for node in range(T):  # every root-to-node path
                path = root_path(par[i], node)
                yref, _ = self.layer.reference(self.ref[s], self.take(tok, i, path))
                err = max(err, (y[i, node].double() - yref[0, -1]).abs().max().item())
            if self.h[s] + T > self.cache.window:
                self.h[s], self.refreshes[s] = 0, self.refreshes[s] + 1
        # accept: a random node's root path, cut to a random depth (0 .. its full depth)
        paths, counts = torch.randint(0, T, (b, T), generator=self.g), []
        for i, s in enumerate(slots):
            node = int(torch.randint(0, T, (1,), generator=self.g))
            path = root_path(par[i], node)
            n = int(torch.randint(0, len(path) + 1, (1,), generator=self.g)) if depth is None \
                else min(depth, len(path))
            paths[i, :len(path)] = torch.tensor(path)  # entries past n are ignored
            counts.append(n)
            self.moved += s >= 0 and path[:n] != list(range(n))
            if s >= 0:
                self.depths.add((n, len(path)))
            if s >= 0 and n:
                _, self.ref[s] = self.layer.reference(self.ref[s], self.take(tok, i, path[:n]))
                self.h[s] += n
        self.cache.accept(torch.tensor(slots), torch.tensor(counts), paths, backend=self.backend)
        real = [s for s in slots if s >= 0]
        got = self.cache.counters(torch.tensor(real))
        assert got["committed"].tolist() == [self.h[s] for s in real]
        assert got["refreshes"].tolist() == [self.refreshes[s] for s in real]
        assert got["pending"].tolist() == [0] * len(real)
        self.max_err = max(self.max_err, err)
        return err

    def state_error(self, slots):
        m = self.cache.materialize(torch.tensor(slots)).double()
        return max((m[i:i + 1] - self.ref[s]).abs().max().item() for i, s in enumerate(slots))


def mixed_rounds(d, rounds, T_max=5):
    """Rounds of random shapes: trees, chains, flat trees and a pad in one batch."""
    errs = []
    for r in range(rounds):
        T = int(torch.randint(1, T_max + 1, (1,), generator=d.g))
        kinds = ["tree", "chain", "tree", "flat"] if r % 2 else ["tree", "tree", "chain", "tree"]
        slots = [2, -1, 0, 3] if r % 3 else [1, 3, 0, 2]
        errs.append(d.round(slots, T, kinds))
    return errs


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tree_path_matches_the_recurrence(arch):
    d = TreeDriver(arch)
    mixed_rounds(d, 30)
    assert sum(d.refreshes.values()) >= 4  # many rounds across refreshes
    assert d.moved >= 3  # non-contiguous paths
    assert any(n == 0 for n, _ in d.depths) and any(n == k > 1 for n, k in d.depths)
    assert d.max_err <= S32_TOL, d.max_err
    assert d.state_error([0, 1, 2, 3]) <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_full_depth_and_deep_trees(arch):
    """Accepting the whole root path (n = depth) of a tree as deep as max_draft, then decoding on."""
    d = TreeDriver(arch, window=12, max_draft=6, seed=3)
    for _ in range(4):
        d.round([0, 1, 2, 3], 6, ["tree", "chain", "tree", "tree"], depth=6)
    assert d.max_err <= S32_TOL
    assert d.state_error([0, 1, 2, 3]) <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_chain_parents_accept_like_no_parents(arch):
    """parents = s - 1 and path = 0, 1, 2 commit the same history as parents None / path None."""
    a, b = TreeDriver(arch, seed=5), TreeDriver(arch, seed=5)
    for c in (a, b):
        tok = c.layer.tokens(generator(9), 2, 4)
        slots = torch.tensor([0, 1])
        chain = torch.arange(-1, 3).repeat(2, 1)
        y = verify(c.layer, c.cache, slots, tok, chain if c is a else None)
        if c is a:
            c.cache.accept(slots, torch.tensor([3, 1]), torch.arange(4).repeat(2, 1))
            ya = y
        else:
            c.cache.accept(slots, torch.tensor([3, 1]))
    assert (ya - y).abs().max().item() <= S32_TOL
    assert (a.cache.materialize(slots) - b.cache.materialize(slots)).abs().max().item() <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_accept_zero_leaves_the_committed_history_bit_identical(arch):
    d = TreeDriver(arch, window=16)
    d.round([0, 1, 2, 3], 3, ["tree"] * 4, depth=2)
    before = snapshot(d.cache)
    h = d.cache.counters(torch.arange(4))["committed"]
    tok = d.layer.tokens(d.g, 4, 4)
    verify(d.layer, d.cache, torch.arange(4), tok, torch.tensor([[-1, -1, 0, 1]] * 4))
    d.cache.accept(torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.tensor([[1, 3, 0, 0]] * 4))
    after = snapshot(d.cache)
    # only the draft entries past the committed pointer may differ
    changed = [k for k in snapshot_diff(before, after) if not k.startswith("buffer.")]
    assert changed == []
    for s in range(4):
        n = int(h[s])
        for name, buf in d.cache.buffer.items():
            row_before = before[f"buffer.{name}"].view(buf.shape[0], buf.shape[1], -1)[s, :n]
            row_after = after[f"buffer.{name}"].view(buf.shape[0], buf.shape[1], -1)[s, :n]
            assert torch.equal(row_before, row_after), name


# ---- teeth --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_a_chain_mask_for_a_tree_is_detected(arch, monkeypatch):
    """Treating the tree as a chain (the causal mask in place of the ancestor mask) fails."""
    def as_chain(parents, h, L):
        chain = torch.arange(-1, parents.shape[1] - 1).expand_as(parents)
        return orig(chain, h, L)
    orig = step.tree_visibility
    monkeypatch.setattr(step, "tree_visibility", as_chain)
    d = TreeDriver(arch)
    d.round([0, 1, 2, 3], 4, ["flat"] * 4, depth=0)
    assert d.max_err > 100 * S32_TOL


@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_residuals_of_the_wrong_chain_are_detected(arch, monkeypatch):
    """Residuals solved over the draft order (a chain) instead of each node's ancestor chain give
    wrong outputs even when the outputs' decays follow the tree."""
    replay = importlib.import_module(f"replayssm.{arch}.replay")
    orig = replay._solve

    def chain_solve(state, k, buf, c, rows, cached_u=None, visible=None):
        return orig(state, k, buf, c, rows, cached_u)
    monkeypatch.setattr(replay, "_solve", chain_solve)
    d = TreeDriver(arch)
    d.round([0, 1, 2, 3], 4, ["flat"] * 4, depth=0)
    assert d.max_err > 100 * S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("which", ["from_checkpoint", "segments"])
def test_decays_along_the_draft_order_are_detected(arch, which, monkeypatch):
    """Decays summed over the draft order (siblings included) instead of each node's ancestor
    path fail, with the ancestor mask itself kept: the decay from the checkpoint
    (``step.path_log_decay``) or the segment decays between entries (``step.segment_log_decay``)."""
    replay = importlib.import_module(f"replayssm.{arch}.replay")
    if which == "from_checkpoint":
        orig = step.path_log_decay
        monkeypatch.setattr(replay, "path_log_decay", lambda la, t, visible=None: orig(la, t))
    else:
        orig = step.segment_log_decay

        def chain_segments(la, t, visible=None):
            seg = orig(la, t)  # summed over every draft before the query
            return seg if visible is None else torch.where(visible[..., None], seg, float("-inf"))
        monkeypatch.setattr(replay, "segment_log_decay", chain_segments)
    d = TreeDriver(arch, window=16)
    d.round([0, 1, 2, 3], 3, ["chain"] * 4, depth=3)  # a committed history for the segments to span
    d.round([0, 1, 2, 3], 4, ["flat"] * 4, depth=0)
    assert d.max_err > 100 * S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_an_accept_that_does_not_compact_is_detected(arch, monkeypatch):
    """Accepting a non-contiguous path without moving its entries commits the wrong drafts."""
    d2 = TreeDriver(arch, window=16)
    monkeypatch.setattr(d2.cache, "_compact", lambda rows, n, path: None)
    for _ in range(2):  # parents [-1, -1, 1, ...]: a path through draft 1 skips draft 0
        tok = d2.layer.tokens(d2.g, 4, 3)
        par = torch.tensor([[-1, -1, 1]] * 4)
        verify(d2.layer, d2.cache, torch.arange(4), tok, par)
        d2.cache.accept(torch.arange(4), torch.full((4,), 2), torch.tensor([[1, 2, 0]] * 4))
        for s in range(4):
            _, d2.ref[s] = d2.layer.reference(d2.ref[s], d2.take(tok, s, [1, 2]))
    assert d2.state_error([0, 1, 2, 3]) > 100 * S32_TOL


# ---- validation ---------------------------------------------------------------------------------
def _rejects(cache, fn, match):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        fn()
    assert snapshot_diff(before, snapshot(cache)) == []


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_parents_are_refused(arch):
    d = TreeDriver(arch)
    c, slots = d.cache, torch.tensor([0, 1])
    tok = d.layer.tokens(d.g, 2, 3)
    good = torch.tensor([[-1, 0, 0], [-1, -1, 1]])
    for bad in (good[:, :2], good[:1], good.float(), torch.tensor([[-1, 1, 0], [-1, -1, 1]]),
                torch.tensor([[-1, 0, 2], [-1, -1, 1]]), torch.tensor([[0, 0, 0], [-1, -1, 1]]),
                torch.tensor([[-1, 0, 0], [-2, -1, 1]])):
        _rejects(c, lambda bad=bad: verify(d.layer, c, slots, tok, bad), "parents")
    # pads may carry any parents
    verify(d.layer, c, torch.tensor([0, -1]), tok, torch.tensor([[-1, 0, 0], [5, 7, 9]]))


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_paths_are_refused(arch):
    d = TreeDriver(arch)
    c, slots = d.cache, torch.tensor([0, 1])
    tok = d.layer.tokens(d.g, 2, 4)
    verify(d.layer, c, slots, tok, torch.tensor([[-1, -1, -1, 2], [-1, 0, 1, 2]]))
    n2 = torch.tensor([2, 2])
    for path, n, match in ((torch.tensor([[0, 2, 0, 0], [0, 1, 0, 0]]), n2, "path"),  # 2 is no child of 0
                           (torch.tensor([[2, 3, 0, 0], [1, 2, 0, 0]]), n2, "path"),  # 1 is no root child
                           (torch.tensor([[2, 4, 0, 0], [0, 1, 0, 0]]), n2, "path"),  # out of range
                           (torch.tensor([[-1, 0, 0, 0], [0, 1, 0, 0]]), n2, "path"),
                           (torch.tensor([[2], [0]]), n2, "path"),  # n > path length
                           (torch.tensor([[2, 3, 0, 0]]), n2, "path"),
                           (torch.tensor([[2, 3, 0, 0], [0, 1, 2, 3]]).float(), n2, "path"),
                           (torch.zeros(2, 6, dtype=torch.int64), n2, "path"),  # > max_draft columns
                           (None, n2, "num_accepted"),  # 0, 1 is not a root path of row 0's tree
                           (torch.tensor([[2, 3, 0, 0], [0, 1, 2, 3]]), torch.tensor([3, 4]),
                            "path")):  # n = 3 > the depth 2 of row 0's path 2, 3
        _rejects(c, lambda n=n, path=path: c.accept(slots, n, path), match)
    c.accept(slots, torch.tensor([2, 3]), torch.tensor([[2, 3, 9, 9], [0, 1, 2, 7]]))
    assert c.counters(slots)["committed"].tolist() == [2, 3]


@pytest.mark.parametrize("arch", ARCHS)
def test_paths_after_a_chain_verify_and_on_triton(arch):
    """After a chain verify a path 0, 1, 2 is accepted and any other path refused; the Triton
    accept takes a path that moves entries (its moves: test_triton_trees.py)."""
    d = TreeDriver(arch)
    c, slots = d.cache, torch.tensor([0, 1])
    d.layer.run(c, slots, d.layer.tokens(d.g, 2, 3), True)
    _rejects(c, lambda: c.accept(slots, torch.tensor([1, 1]), torch.tensor([[1, 0, 0], [0, 1, 2]])), "path")
    c.accept(slots, torch.tensor([3, 1]), torch.tensor([[0, 1, 2], [0, 5, 5]]))
    verify(d.layer, c, slots, d.layer.tokens(d.g, 2, 3), torch.tensor([[-1, -1, 1]] * 2))
    c.accept(slots, torch.tensor([1, 0]), torch.tensor([[1, 0, 0]] * 2), backend="triton")
    assert c.counters(slots)["committed"].tolist() == [4, 1]


@pytest.mark.parametrize("arch", ARCHS)
def test_pending_tree_round_trips_through_state_dict(arch):
    d = TreeDriver(arch)
    slots = torch.tensor([0, 1])
    verify(d.layer, d.cache, slots, d.layer.tokens(d.g, 2, 3), torch.tensor([[-1, -1, 1]] * 2))
    fresh = d.layer.cache(4, window=8, max_draft=5)
    fresh.load_state_dict(d.cache.state_dict())
    with pytest.raises(ValueError, match="path"):  # the parents came along
        fresh.accept(slots, torch.tensor([2, 0]), torch.tensor([[0, 1, 0]] * 2))
    for c in (d.cache, fresh):
        c.accept(slots, torch.tensor([2, 1]), torch.tensor([[1, 2, 0]] * 2))
    assert snapshot_diff(snapshot(d.cache), snapshot(fresh)) == []
    sd = d.cache.state_dict()
    target = d.layer.cache(4, window=8, max_draft=5)
    for gap in (-1, 3):  # draft 2 following draft 2, or draft -2
        bad = {**sd, "draft_gaps": sd["draft_gaps"].clone()}
        bad["draft_gaps"][1, 2] = gap
        _rejects(target, lambda bad=bad: target.load_state_dict(bad), "draft_gaps")
