"""Tree drafts on the Triton backend (Triton's interpreter on the CPU, TRITON_INTERPRET=1), at the
smallest geometries the kernels tile: every root-to-node output of random trees against the float64
recurrence along that node's path, mixed trees, chains, flat trees and pads in one batch, accepted
paths of every depth (0 included, non-contiguous ones) moved by the device-side accept, rounds
across refreshes; the accept's moves bit for bit against the PyTorch accept; and teeth."""
import importlib

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import helpers  # noqa: E402
import replayssm as rs  # noqa: E402
from helpers import S32_TOL  # noqa: E402
from test_triton_backend import GEOMETRY  # noqa: E402
from test_trees import TreeDriver, mixed_rounds, random_parents, root_path, verify  # noqa: E402

ARCHS = ["mamba2", "gdn", "kda"]
TREE_GEOMETRY = dict(GEOMETRY, kda=GEOMETRY["gdn"])


def driver(arch, **kw):
    return TreeDriver(arch, backend="triton", geometry=TREE_GEOMETRY[arch], **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_every_tree_path_matches_the_recurrence(arch):
    d = driver(arch, window=6)
    mixed_rounds(d, 6)
    assert sum(d.refreshes.values()) >= 3  # rounds across refreshes
    assert d.moved >= 2  # non-contiguous paths, moved by the device-side accept
    assert any(n == 0 for n, _ in d.depths) and any(n == k > 1 for n, k in d.depths)
    assert d.max_err <= S32_TOL, d.max_err
    assert d.state_error([0, 1, 2, 3]) <= S32_TOL
    helpers.record(f"triton {arch} tree max abs err", d.max_err)


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_triton_trees_in_a_step_of_one_launch(arch):
    """A step of one launch (``StepShape.fused``): each program takes its draft's path from the
    tree itself, and program (0, 0) of a batch row stores its pending tree for accept."""
    from replayssm._triton import launch

    d = driver(arch, window=6)
    launch.TUNING.update(fused=True)
    try:
        mixed_rounds(d, 6)
    finally:
        launch.TUNING.clear()
    assert sum(d.refreshes.values()) >= 3 and d.moved >= 2
    assert d.max_err <= S32_TOL, d.max_err
    assert d.state_error([0, 1, 2, 3]) <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_full_depth_of_deep_trees(arch):
    """Whole root paths of trees as deep as max_draft accepted, a refresh in between."""
    d = driver(arch, window=10, max_draft=5, seed=3)
    for _ in range(4):
        d.round([0, 1, 2, 3], 5, ["tree", "chain", "tree", "flat"], depth=5)
    assert sum(d.refreshes.values()) >= 1 and any(n == k >= 3 for n, k in d.depths)
    assert d.max_err <= S32_TOL, d.max_err
    assert d.state_error([0, 1, 2, 3]) <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_chain_parents_are_bitwise_the_chain(arch):
    """parents = s - 1 (the tree kernels) and parents None (the chain kernels) give the same bits:
    outputs, and every tensor of the cache after accepting path 0, 1 / no path."""
    a, b = driver(arch, seed=5), driver(arch, seed=5)
    slots = torch.tensor([0, -1, 1])
    for _ in range(2):
        for c in (a, b):
            tok = c.layer.tokens(helpers.generator(9), 3, 4)
            chain = torch.arange(-1, 3).repeat(3, 1)
            c.y = verify(c.layer, c.cache, slots, tok, chain if c is a else None, "triton")
            n = torch.tensor([2, 0, 4])
            c.cache.accept(slots, n, torch.arange(4).repeat(3, 1) if c is a else None, backend="triton")
        assert torch.equal(a.y, b.y)
        assert helpers.snapshot_diff(helpers.snapshot(a.cache), helpers.snapshot(b.cache)) == []


def _fill_pending_trees(cache, g, slots, T):
    """Random buffers and cursors with a pending tree verify of T drafts on ``slots``; returns
    (parents per slot, num_accepted [b], path [b, T]) with root paths of every depth."""
    for t in cache.buffer.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    counts, paths, trees = [], torch.zeros(len(slots), T, dtype=torch.int64), {}
    for i, s in enumerate(slots):
        par = random_parents(g, T, "tree" if i % 3 else "flat")
        path = root_path(par, int(torch.randint(0, T, (1,), generator=g)))
        paths[i, :len(path)] = torch.tensor(path)
        counts.append(i % (len(path) + 1))
        if s >= 0:
            trees[s] = par
            cache.committed[s] = int(torch.randint(0, cache.window - T + 1, (1,), generator=g))
            cache.pending[s] = T
            cache.draft_gaps[s, :T] = torch.arange(-1, T - 1) - torch.tensor(par)
    return trees, torch.tensor(counts), paths


def test_triton_accept_moves_entries_like_torch_accept():
    """The device-side accept with a path against the PyTorch one, every tensor bit for bit (pads,
    counts 0 .. depth, several element chunks per entry: ``launch.COMPACT_CHUNK`` lowered)."""
    from replayssm._triton import launch

    for arch in ARCHS:
        base = helpers.make_layer(arch, 0, **TREE_GEOMETRY[arch])
        caches = [base.cache(9, window=12, max_draft=5, buffer_dtype=torch.float32) for _ in range(2)]
        slots = torch.tensor([3, -1, 0, 7, 8, 5, -1, 1, 2])
        for c in caches:
            trees, counts, paths = _fill_pending_trees(c, helpers.generator(4), slots.tolist(), 5)
        assert any(p[:n].tolist() != list(range(n)) for p, n in zip(paths, counts))
        old, launch.COMPACT_CHUNK = launch.COMPACT_CHUNK, 16
        try:
            caches[0].accept(slots, counts, paths, backend="torch")
            caches[1].accept(slots, counts.to(torch.int32), paths.to(torch.int32), backend="triton")
        finally:
            launch.COMPACT_CHUNK = old
        assert helpers.snapshot_diff(helpers.snapshot(caches[0]), helpers.snapshot(caches[1])) == [], arch


def test_triton_trees_of_more_than_32_drafts_are_refused():
    cache = rs.Mamba2Cache(1, window=40, max_draft=33, **GEOMETRY["mamba2"])
    layer = helpers.make_layer("mamba2", 0, **GEOMETRY["mamba2"])
    tok = layer.tokens(helpers.generator(1), 1, 33)
    with pytest.raises(ValueError, match="at most 32 drafts"):
        verify(layer, cache, torch.tensor([0]), tok, torch.arange(-1, 32)[None], "triton")


# ---- teeth --------------------------------------------------------------------------------------
@triton.jit
def chain_bits(parents_ptr, pid_b, valid, T: tl.constexpr):
    """``window.ancestor_bits`` with every earlier draft an ancestor (bits 0..s): siblings too."""
    return (tl.full((32,), 2, tl.int32) << tl.arange(0, 32)) - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_a_kernel_mask_that_lets_siblings_see_each_other_is_detected(arch, monkeypatch):
    """Ancestor masks of the draft order (every earlier draft, siblings included) in place of the
    tree's: the outputs of a flat tree's drafts after the first are wrong. (The scores launches,
    where all of a tree is applied, take the masks in registers: ``ancestor_bits``.)"""
    monkeypatch.setattr(importlib.import_module(f"replayssm.{arch}.triton"), "ancestor_bits", chain_bits)
    d = driver(arch, window=16)
    d.round([0, 1, 2, 3], 4, ["flat"] * 4, depth=0)
    assert d.max_err > 100 * S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_a_triton_accept_that_does_not_move_entries_is_detected(arch, monkeypatch):
    from replayssm._triton import launch

    real_run = launch.run
    monkeypatch.setattr(launch, "run", lambda kernel, *a, **kw: None if kernel is launch.compact_kernel
                        else real_run(kernel, *a, **kw))
    d = driver(arch, window=16)
    tok = d.layer.tokens(d.g, 4, 3)
    verify(d.layer, d.cache, torch.arange(4), tok, torch.tensor([[-1, -1, 1]] * 4), "triton")
    d.cache.accept(torch.arange(4), torch.full((4,), 2), torch.tensor([[1, 2, 0]] * 4), backend="triton")
    for s in range(4):
        _, d.ref[s] = d.layer.reference(d.ref[s], d.take(tok, s, [1, 2]))
    assert d.state_error([0, 1, 2, 3]) > 100 * S32_TOL
