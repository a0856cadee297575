"""Decay factors inside kernels, from per-token log decays of one window.

A decay between two positions is exp of the sum of the log decays between them. Summing each
segment directly keeps its relative accuracy; the difference c_t - c_j of two fp32 prefix sums
loses ~ulp(c) absolutely once the prefix sums are large (strong decays), a relative error of
every decay factor. Segments to a query are suffix sums of the window's own terms
(``path_decays``), and the refresh's are masked [LP, LP] sums: windows are short (<= 32). The
refresh's sums are ``ordered_row_sums``, whose bits no launch shape changes: the anchor a refresh
folds is the same whether a launch of its own or the refreshing program computes them.
"""
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20) in fp32, with log1p(e^x) by Kahan's correction."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    return tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))


@triton.jit
def path_decays(G, G_next, path, path_next):
    """A query's decays over a window, for several heads at once: (e^{g(j, t]} [RP, LP], zero off
    the path, and e^{c_t} [RP], the decay from the checkpoint to t), from the heads' log decays G
    [RP, LP], the same one entry on (G_next[:, j] = G[:, j + 1]) and the query's path (``path``
    [LP] bool, and ``path_next``, the same one entry on). g(j, t] is a suffix sum (tl.cumsum) of
    the path's terms after j: a sum of the segment's own terms, not a difference of sums."""
    seg = tl.cumsum(tl.where(path_next[None, :], G_next, 0.0), 1, reverse=True)
    decay = tl.exp(tl.where(path[None, :], seg, float("-inf")))  # masked before exp
    return decay, tl.exp(tl.sum(tl.where(path[None, :], G, 0.0), 1))


@triton.jit
def ordered_row_sums(X):
    """sum_k X[r, j, k] [R, LP] for X [R, LP, LP] fp32, in the order k = 0, 1, ...: an IEEE
    product with ones (its FMAs accumulate over k in order, in any layout), whose first column a
    masked sum takes out (it adds zeros only). A plain tl.sum's order follows the layout, so its
    bits would depend on the program's warps and how many heads it takes."""
    k = tl.arange(0, X.shape[2])
    both = tl.dot(X, tl.full(X.shape, 1.0, tl.float32), input_precision="ieee")
    return tl.sum(tl.where(k[None, None, :] == 0, both, 0.0), 2)
