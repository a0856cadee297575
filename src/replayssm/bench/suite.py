"""GPU benchmark machinery: geometries, inputs, CUDA-graph timing, traffic model.

Timing: every measured region is a CUDA graph of whole windows (so refresh steps are counted
once per L tokens), replayed many times; the figure is the median per step. Slots rotate over a
pool whose state is several times the L2 cache, so no step reads state left in cache by the last.
"""
from __future__ import annotations

import math

import torch

from ..geometry import GEOMETRIES as _NAMED
from ..layers import LAYERS
from . import Problem  # noqa: F401  (re-exported)
from .conventional import gdn_conventional, kda_conventional, mamba2_conventional

#: name -> (layer kind, geometry) of the model geometries in ``replayssm.geometry.GEOMETRIES``.
GEOMETRIES = {name: (g.arch, g.geometry) for name, g in _NAMED.items() if g.arch is not None}

L2_BYTES = 60 * 2**20


def make_inputs(p: Problem, device, gen, dtype=torch.bfloat16):
    """Random inputs at realistic scales for one step of ``p`` (dict of tensors)."""
    b, T = p.batch, p.T
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, device=device, generator=gen)  # noqa: E731
    H, P, N, G = p.dims
    if p.arch == "mamba2":
        return dict(x=r(b, T, H, P).to(dtype), dt=(u(b, T, H) * 2 - 3.5), B=(r(b, T, G, N) * 0.3).to(dtype),
                    C=(r(b, T, G, N) * 0.3).to(dtype), z=r(b, T, H, P).to(dtype))
    decays = (b, T, H, N) if p.arch == "kda" else (b, T, H)  # KDA: one per key channel
    return dict(q=r(b, T, G, N).to(dtype), k=r(b, T, G, N).to(dtype), v=r(b, T, H, P).to(dtype),
                g=torch.log(0.85 + 0.149 * u(*decays)), beta=u(b, T, H).to(dtype))


def make_params(p: Problem, device, gen):
    if p.arch != "mamba2":
        return {}
    H = p.dims[0]
    return dict(A=-(0.3 + 1.7 * torch.rand(H, device=device, generator=gen)),
                D=torch.randn(H, device=device, generator=gen),
                dt_bias=torch.randn(H, device=device, generator=gen) * 0.5)


def make_cache(p: Problem, num_slots, precision, window, max_draft, device, buffer_dtype=torch.bfloat16):
    return LAYERS[p.arch].cache(p.dims, num_slots, window=window, max_draft=max_draft, precision=precision,
                                device=device, buffer_dtype=buffer_dtype)


def replay_call(p: Problem, cache, slots, inp, prm, verify: bool, backend=None, parents=None):
    """One ReplaySSM decode (T = 1) or verify call (of draft trees with ``parents`` [b, T]);
    outputs [b, H, P] (decode) or [b, T, H, P]."""
    y = LAYERS[p.arch].call(cache, slots, inp, prm, verify, backend, parents=parents)
    return y if verify else y[:, 0]


def state_shape(p: Problem) -> tuple:
    """Per-sequence state shape [H, P, N] (Mamba-2 [nheads, headdim, dstate], GDN and KDA [HV, V, K])."""
    H, P, N, _ = p.dims
    return (H, P, N)


def conventional_call(p: Problem, state, slots, inp, prm, inter=None, parents=None):
    """The conventional kernel on the same inputs (prepared the same way as ReplaySSM's); with
    ``inter`` one state per draft, of a draft tree with ``parents`` int32 [b, T] (Mamba-2, GDN)."""
    if p.arch == "mamba2":
        return mamba2_conventional(state, slots, inp["x"], inp["dt"], prm["A"], inp["B"], inp["C"], prm["D"],
                                   prm["dt_bias"], inp["z"], inter, parents)
    tokens = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], p.dims.N ** -0.5)
    if p.arch == "kda":
        return kda_conventional(state, slots, *tokens, inter)
    return gdn_conventional(state, slots, *tokens, inter, parents)


def pool_groups(p: Problem, state_bytes_per_elem: float = 4.0, min_bytes: int = 4 * L2_BYTES) -> int:
    """Number of slot groups to rotate over so the pool's state is >= min_bytes."""
    per_group = p.batch * p.state_elems * state_bytes_per_elem
    return max(1, math.ceil(min_bytes / per_group))


def time_graph(step_fns, reps: int = 20) -> tuple[float, float]:
    """Capture the callables in one CUDA graph; return (median, IQR/2) microseconds per callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in step_fns:  # warm-up / compile outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in step_fns:
            fn()
    for _ in range(3):
        g.replay()
    return _median_per_call(g.replay, len(step_fns), reps)


def time_eager(step_fns, reps: int = 20) -> tuple[float, float]:
    """Like ``time_graph`` but launching eagerly (``--no-graphs``): includes launch overhead."""
    def run_all():
        for fn in step_fns:
            fn()
    run_all()
    return _median_per_call(run_all, len(step_fns), reps)


def _median_per_call(run, calls: int, reps: int) -> tuple[float, float]:
    """(median, IQR/2) in microseconds per call of ``reps`` timed runs of ``run`` (``calls`` calls each)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    q = torch.quantile(torch.tensor(times), torch.tensor([0.25, 0.5, 0.75]))
    return float(q[1]), float(q[2] - q[0]) / 2


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the
    faster of torch's ``copy_`` and a plain Triton copy kernel, each timed in a CUDA graph (a
    graph-captured ``copy_`` is a memcpy node, measured at 2.8 TB/s on an H200 where the same copy
    launched as a kernel moves 4.2)."""
    from .conventional import device_copy

    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    best = min(time_graph([lambda: b.copy_(a)] * 4, reps=20)[0],
               time_graph([lambda: device_copy(a, b)] * 4, reps=20)[0])
    return 2 * nbytes / (best * 1e-6)


def replay_bytes(per_slot: dict, batch: int, T: int, window: int, refresh_fraction: float) -> float:
    """Bytes per ReplaySSM step of T tokens over ``batch`` slots from the storage formats (a cache's
    ``bytes_per_slot``): the read copy read by the slots that do not refresh; a refreshing slot (a
    ``refresh_fraction`` of them) reads the anchor and writes anchor and read copy (its outputs
    from registers); every slot reads (L-1)/2 committed entries of its buffer on average, and
    writes T."""
    A, R = per_slot["anchor"], per_slot["read_copy"] or per_slot["anchor"]
    f = refresh_fraction
    return batch * ((1 - f) * R + f * (A + A + per_slot["read_copy"])
                    + per_slot["buffer"] / window * ((window - 1) / 2 + T))


def traffic(p: Problem, cache, window: int, refresh_fraction: float) -> dict:
    """Bytes per step (state traffic): the conventional kernel reads and writes the fp32 state
    (verify: one state per draft); ReplaySSM's from its storage formats (``replay_bytes``)."""
    n = p.batch * p.state_elems
    conv = n * 4 * (1 + p.T) if p.T > 1 else n * 8
    return {"conventional": conv,
            "replay": replay_bytes(cache.bytes_per_slot(), p.batch, p.T, window, refresh_fraction)}


def baseline_available(name: str, arch: str | None = None) -> str | None:
    """None if the baseline can run here (for layer kind ``arch``: fla's KDA kernel for "kda"),
    else why not."""
    try:
        if name == "mamba_ssm":
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update  # noqa: F401
        elif name == "fla" and arch == "kda":
            from fla.ops.kda import fused_recurrent_kda  # noqa: F401
        elif name == "fla":
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # noqa: F401
        return None
    except Exception as exc:  # an optional dependency: report, never fake
        return f"{type(exc).__name__}: {exc}"


def mamba_ssm_call(p: Problem, state, slots, inp, prm):
    """mamba_ssm's selective_state_update (head-tied dt/A as vLLM passes them), in place."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    H, P, N, _ = p.dims
    dt = inp["dt"][:, 0, :, None].expand(-1, -1, P)
    return selective_state_update(state, inp["x"][:, 0], dt, prm["A"][:, None, None].expand(H, P, N),
                                  inp["B"][:, 0], inp["C"][:, 0], prm["D"][:, None].expand(H, P),
                                  inp["z"][:, 0], prm["dt_bias"][:, None].expand(H, P), dt_softplus=True,
                                  state_batch_indices=slots)


def fla_call(p: Problem, state, start: int, inp, prm):
    """flash-linear-attention's fused_recurrent_gated_delta_rule (for KDA fused_recurrent_kda, g
    per key channel) on state[start:start+b] ([N, HV, V, K], its fast layout), writing the final
    state (read + write of the state)."""
    if p.arch == "kda":
        from fla.ops.kda import fused_recurrent_kda as kernel
    else:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as kernel
    o, _ = kernel(
        inp["q"], inp["k"], inp["v"], g=inp["g"], beta=inp["beta"],
        initial_state=state[start:start + p.batch], output_final_state=True,
        use_qk_l2norm_in_kernel=True, state_v_first=True)
    return o
