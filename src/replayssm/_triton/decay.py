"""Decay factors inside kernels, from per-token log decays of one window.

A decay between two positions is exp of the sum of the log decays between them. Summing each
segment directly keeps its relative accuracy; the difference c_t - c_j of two fp32 prefix sums
loses ~ulp(c) absolutely once the prefix sums are large (strong decays), a relative error of
every decay factor. Windows are short (<= 32), so the masked [LP, LP] sums are cheap.
"""
import triton
import triton.language as tl


@triton.jit
def segment_to(la, t):
    """[LP] sums of la over j < k <= t, for every j (the decay from entry j to position t)."""
    k = tl.arange(0, la.shape[0])
    return tl.sum(tl.where((k[None, :] > k[:, None]) & (k[None, :] <= t), la[None, :], 0.0), 1)


@triton.jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20) in fp32, with log1p(e^x) by Kahan's correction."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    return tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))


@triton.jit
def segment_along(la, seen):
    """[LP] sums of la over the entries k > j that a query sees (``seen`` [LP] bool, a draft's
    path), for every j: the decay from entry j to the query along its path. For a chain (seen =
    k <= t) the same masked sum as ``segment_to``."""
    k = tl.arange(0, la.shape[0])
    return tl.sum(tl.where((k[None, :] > k[:, None]) & seen[None, :], la[None, :], 0.0), 1)
