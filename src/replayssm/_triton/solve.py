"""The inverse of a window's unit lower-triangular residual system inside kernels.

The residuals of a delta-rule window solve (I + M) u = r with M strictly lower triangular
[LP, LP] (LP a power of two). M^LP = 0, so

    (I + M)^{-1} = (I - M)(I + M^2)(I + M^4) ... (I + M^{LP/2}):

log2(LP) products instead of LP dependent substitution steps, in IEEE fp32 (FMAs) or 3-pass tf32
on tensor cores, as the caller says. The partial products grow like the powers of M before they
cancel: where M's entries are near 1 (nearly parallel keys, beta and decays near 1) M^8 has
entries near 2000 while the inverse's stay below 1, and the product form is off by up to 5e-4 in
fp32. One Newton step, X + X (I - (I + M) X), takes that to rounding (7e-9): its residual is
small and computed from entries below 1. GDN's solve launch was bound by the FMA products'
operand round trips through shared memory (H100: L1 92% busy, DRAM 3%); KDA's, which builds M row
by row, measured slower on tensor cores.
"""
import triton
import triton.language as tl


@triton.jit
def unit_lower_inverse(M, SQUARINGS: tl.constexpr, PRECISION: tl.constexpr):
    """(I + M)^{-1} [..., LP, LP] fp32 for M [LP, LP] or a batch [n, LP, LP] of fp32 strictly
    lower triangular matrices; SQUARINGS = log2(LP) - 1 (the factors (I + M^2) .. (I + M^{LP/2}));
    PRECISION: the products' ``input_precision``, "ieee" or "tf32x3"."""
    r = tl.arange(0, M.shape[len(M.shape) - 1])
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    if len(M.shape) == 3:
        eye = tl.broadcast_to(eye[None, :, :], M.shape)
    X = eye - M
    power = M
    for _ in tl.static_range(SQUARINGS):
        power = tl.dot(power, power, input_precision=PRECISION)
        X = tl.dot(X, eye + power, input_precision=PRECISION)
    residual = eye - X - tl.dot(M, X, input_precision=PRECISION)  # I - (I + M) X
    return X + tl.dot(X, residual, input_precision=PRECISION)
