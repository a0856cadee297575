"""The inverse of a window's unit lower-triangular residual system inside kernels.

The residuals of a delta-rule window solve (I + M) u = r with M strictly lower triangular
[LP, LP] (LP a power of two). The inverse is built by doubling its diagonal blocks: with X the
inverses of the diagonal blocks of size b (block diagonal), those of size 2b are

    X - X M_b X,    M_b: M's lower-left b x b block inside each diagonal block of size 2b

(the block formula [[A, 0], [C, B]]^{-1} = [[A^{-1}, 0], [-B^{-1} C A^{-1}, B^{-1}]], for every
block at once), from the 2 x 2 blocks' I - M up: 2 log2(LP) - 2 small products instead of LP
dependent substitution steps, in IEEE fp32 (FMAs) or 3-pass tf32 on tensor cores, as the caller
says. Every intermediate is an inverse of a diagonal block, so nothing grows and cancels: the
product form (I - M)(I + M^2)(I + M^4)(I + M^8), as many products, has partial products that grow
like M's powers (entries near 2000 for nearly parallel keys with beta and decays near 1, where the
inverse's stay below 1) and was off by up to 5e-4 in fp32 there, in a window of 64 (entries near
1e10) by more than the inverse itself; the blocks stay at rounding (1e-7). GDN's solve launch was
bound by the FMA products' operand round trips through shared memory (H100: L1 92% busy, DRAM 3%);
KDA's, which builds M row by row, measured slower on tensor cores.
"""
import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(M, LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """(I + M)^{-1} [..., LP, LP] fp32 for M [LP, LP] or a batch [n, LP, LP] of fp32 strictly
    lower triangular matrices; LEVELS = log2(LP) - 1 (diagonal blocks of 2 to LP rows);
    PRECISION: the products' ``input_precision``, "ieee" or "tf32x3"."""
    r = tl.arange(0, M.shape[len(M.shape) - 1])
    row, col = r[:, None], r[None, :]
    X = tl.where(row == col, 1.0, 0.0) - tl.where(row // 2 == col // 2, M, 0.0)  # the 2 x 2 blocks
    for level in tl.static_range(LEVELS):
        b = 2 << level  # the blocks of X so far
        # X M X on the lower-left b x b block of each 2b one is X M_b X there (X is block diagonal)
        XMX = tl.dot(tl.dot(X, M, input_precision=PRECISION), X, input_precision=PRECISION)
        X = X - tl.where((row // (2 * b) == col // (2 * b)) & ((row // b) % 2 == 1) & ((col // b) % 2 == 0), XMX, 0.0)
    return X
