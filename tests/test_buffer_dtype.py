"""The replay buffer holds inputs as given: by default (``buffer_dtype=None``) the fields that carry
inputs take the dtype of the first decode or verify call's inputs, so nothing is rounded on the way
in and bf16 activations cost bf16 bytes."""
import pytest
import torch

import replayssm as rs
from helpers import S32_TOL, Tracker, generator, make_layer, snapshot, snapshot_diff

ARCHS = ["mamba2", "gdn", "kda"]
INPUT_FIELDS = {"mamba2": ("x", "B"), "gdn": ("k", "v"), "kda": ("k", "v")}
SOURCE = {"x": "x", "B": "B", "k": "k", "v": "v"}  # buffer field -> token input it holds


def _decode_rounds(layer, cache, tok_dtype, rounds=6, seed=3):
    """Decode ``rounds`` tokens on slots 0, 1 (across a refresh at window 4) with inputs cast to
    ``tok_dtype`` (the float constants and gates stay as drawn); returns the outputs."""
    g = generator(seed)
    cache.load_state(torch.tensor([0, 1]), 0.5 * torch.randn(2, *layer.state_shape, generator=g))
    ys = []
    for _ in range(rounds):
        tok = layer.tokens(g, 2, 1)
        tok = {k: v.to(tok_dtype) if k in SOURCE or k in ("q", "k", "C", "z") else v for k, v in tok.items()}
        ys.append(layer.run(cache, torch.tensor([0, 1]), tok, False))
    return torch.cat(ys)


@pytest.mark.parametrize("tok_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_follows_the_inputs(arch, tok_dtype):
    """The default cache has no buffer until its first decode, then buffers the input fields in the
    inputs' dtype (the derived fields keep fp32), and its outputs are bit-identical to a cache that
    buffers in fp32 (lossless). Teeth: fp32 inputs buffered in bf16 give other outputs."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=4)
    assert cache.buffer is None and cache.buffer_dtype is None and cache.follows_inputs
    y = _decode_rounds(layer, cache, tok_dtype)
    assert cache.buffer_dtype == tok_dtype
    for name, buf in cache.buffer.items():
        assert buf.dtype == (tok_dtype if name in INPUT_FIELDS[arch] else torch.float32), name
    wide = _decode_rounds(layer, layer.cache(2, window=4, buffer_dtype=torch.float32), tok_dtype)
    assert torch.equal(y, wide)
    if tok_dtype == torch.float32:
        narrow = _decode_rounds(layer, layer.cache(2, window=4, buffer_dtype=torch.bfloat16), tok_dtype)
        assert not torch.equal(y, narrow)


@pytest.mark.parametrize("arch", ARCHS)
def test_first_call_fixes_the_dtype(arch):
    """A later call's inputs of another dtype are cast into the buffer the first call made; an
    explicit ``buffer_dtype`` is never changed by the inputs."""
    layer = make_layer(arch)
    cache = layer.cache(2, window=4)
    _decode_rounds(layer, cache, torch.float16, rounds=1)
    _decode_rounds(layer, cache, torch.float32, rounds=2)
    assert cache.buffer_dtype == torch.float16
    assert all(cache.buffer[f].dtype == torch.float16 for f in INPUT_FIELDS[arch])
    fixed = layer.cache(2, window=4, buffer_dtype=torch.bfloat16)
    _decode_rounds(layer, fixed, torch.float32, rounds=1)
    assert fixed.buffer_dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_before_the_first_call(arch):
    """Before any decode: materialize gives the loaded state, accept of zero drafts changes nothing,
    and the bytes per slot count the buffer of fp32 inputs (an upper bound)."""
    layer = make_layer(arch)
    cache = layer.cache(3, window=4)
    tr = Tracker(layer, cache)
    tr.load([0, 2])
    state = cache.materialize(torch.tensor([0, 2]))
    assert torch.equal(state, cache.decode_anchor(torch.tensor([0, 2])))
    before = snapshot(cache)
    cache.accept(torch.tensor([0, 2]), torch.tensor([0, 0]))
    assert snapshot_diff(before, snapshot(cache)) == [] and cache.buffer is None
    assert cache.bytes_per_slot()["buffer"] == layer.cache(3, window=4, buffer_dtype=torch.float32) \
        .bytes_per_slot()["buffer"]
    tr.decode([0, 2])  # the first decode allocates the buffer; the oracle still holds
    assert tr.max_rel <= S32_TOL


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_state_dict_with_and_without_a_buffer(arch):
    """A cache that follows its inputs restores dicts of any buffer dtype (taking it on) and of no
    buffer yet (dropping its own); a dict without a buffer must have nothing committed or pending,
    and a refused dict leaves the cache unchanged. A cache of a fixed dtype refuses other dtypes."""
    layer = make_layer(arch)
    fresh = layer.cache(2, window=4)
    Tracker(layer, fresh).load([0, 1])
    unbuffered = fresh.state_dict()
    assert not any(k.startswith("buffer.") for k in unbuffered)
    used = layer.cache(2, window=4)
    _decode_rounds(layer, used, torch.bfloat16, rounds=3)
    sd = used.state_dict()

    other = layer.cache(2, window=4)
    other.load_state_dict(sd)  # unbuffered cache takes the bf16 buffer on
    assert other.buffer_dtype == torch.bfloat16 and snapshot_diff(snapshot(used), snapshot(other)) == []
    other.load_state_dict(unbuffered)  # and drops it again
    assert other.buffer is None and other.buffer_dtype is None
    assert snapshot_diff(snapshot(fresh), snapshot(other)) == []

    bad = dict(unbuffered, committed=unbuffered["committed"].clone())
    bad["committed"][0] = 1  # committed entries but no buffer to hold them
    target = layer.cache(2, window=4)
    target.load_state_dict(sd)
    before = snapshot(target)
    with pytest.raises(ValueError, match="committed"):
        target.load_state_dict(bad)
    assert target.buffer_dtype == torch.bfloat16 and snapshot_diff(before, snapshot(target)) == []

    fixed = layer.cache(2, window=4, buffer_dtype=torch.float32)
    with pytest.raises(ValueError, match="config"):
        fixed.load_state_dict(sd)


def test_buffer_dtype_validated():
    with pytest.raises(ValueError, match="buffer_dtype"):
        rs.Mamba2Cache(2, 4, 8, 8, buffer_dtype=torch.int32)
    cache = rs.Mamba2Cache(2, 4, 8, 8)
    with pytest.raises(ValueError, match="dtype"):
        cache.follow_inputs(torch.int8)
    assert cache.buffer is None
    cache.follow_inputs(torch.bfloat16)
    assert cache.buffer["x"].dtype == torch.bfloat16 and cache.buffer["dt"].dtype == torch.float32


@pytest.mark.parametrize("arch", ["mamba2", "gdn"])
def test_triton_kernels_read_a_buffer_that_follows_fp16_inputs(arch):
    """The Triton kernels (interpreter) on a default cache with fp16 inputs: the buffer holds them
    in fp16, the outputs match those of a cache buffering in fp32 to fp32 rounding, and both match
    the float64 recurrence, across a refresh."""
    pytest.importorskip("triton")
    from replayssm.layers import LAYERS as CALLS
    layer = make_layer(arch)
    consts = layer._consts() if arch == "mamba2" else {}
    g = generator(5)
    state = 0.5 * torch.randn(2, *layer.state_shape, generator=g)
    caches = [layer.cache(2, window=4), layer.cache(2, window=4, buffer_dtype=torch.float32)]
    for c in caches:
        c.load_state(torch.tensor([0, 1]), state)
    ref = state.double()
    for _ in range(6):
        tok = layer.tokens(g, 2, 1)
        tok = {k: v.half() if k in ("x", "B", "C", "z", "q", "k", "v") else v for k, v in tok.items()}
        y = [CALLS[arch].call(c, torch.tensor([0, 1]), tok, consts, False, backend="triton") for c in caches]
        yref, ref = layer.reference(ref, tok)
        for out in y:
            assert (out.double() - yref).abs().max() <= S32_TOL * max(1.0, yref.abs().max().item())
        assert (y[0] - y[1]).abs().max() <= 1e-6 * max(1.0, y[1].abs().max().item())
    assert all(caches[0].buffer[f].dtype == torch.float16 for f in INPUT_FIELDS[arch])
    assert caches[0].counters(torch.tensor([0, 1]))["refreshes"].tolist() == [1, 1]


def _decode_keys(arch, backend, tok_dtype, buffer_dtype, seed):
    """Three decodes on slots 0, 1 of a window-8 cache with q, k, v cast to ``tok_dtype``: (the
    cache, the keys given [3, 2, HK, K], the largest output error against the float64 recurrence
    run on k and v as the buffer holds them: read back from it, since Triton's interpreter casts
    fp32 to bf16 by truncation where the GPU and torch round to nearest)."""
    from replayssm.layers import LAYERS as CALLS
    layer = make_layer(arch)
    g = generator(seed)
    cache = layer.cache(2, window=8, buffer_dtype=buffer_dtype)
    state = 0.5 * torch.randn(2, *layer.state_shape, generator=g)
    cache.load_state(torch.tensor([0, 1]), state)
    ref, keys, err = state.double(), [], 0.0
    for i in range(3):
        tok = {k: v.to(tok_dtype) if k in ("q", "k", "v") else v for k, v in layer.tokens(g, 2, 1).items()}
        y = CALLS[arch].call(cache, torch.tensor([0, 1]), tok, {}, False, backend=backend)
        held = dict(tok, k=cache.buffer["k"][:2, i:i + 1], v=cache.buffer["v"][:2, i:i + 1])
        yref, ref = layer.reference(ref, held)
        err = max(err, ((y.double() - yref).abs().max() / yref.abs().max()).item())
        keys.append(tok["k"][:, 0])
    return cache, torch.stack(keys), err


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_keys_are_buffered_as_given_with_their_normalizing_factor(arch, backend):
    """GDN and KDA buffer each key as the layer gives it (bf16 bits unchanged, before its L2 norm)
    and the fp32 factor that normalizes it, 1 / sqrt(k . k + 1e-6): no rounding on the way in."""
    if backend == "triton":
        pytest.importorskip("triton")
    cache, keys, err = _decode_keys(arch, backend, torch.bfloat16, None, seed=11)
    assert err <= S32_TOL
    held = cache.buffer["k"][:2, :3].transpose(0, 1)  # [3 tokens, 2 slots, HK, K]
    assert held.dtype == torch.bfloat16 and torch.equal(held, keys)
    expected = torch.rsqrt((keys.float() ** 2).sum(-1) + 1e-6)
    scale = cache.buffer["k_scale"][:2, :3].transpose(0, 1)
    assert torch.allclose(scale, expected, rtol=1e-6, atol=0) and not torch.allclose(scale, torch.ones_like(scale))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_a_new_key_is_the_key_its_replay_reads(arch, backend):
    """fp32 keys into a bf16 buffer: the key a step uses for its new token is computed from the
    rounded value the buffer holds, as every later replay of the buffer computes it, so the outputs
    are those of the recurrence on the rounded keys to fp32 accuracy. Teeth: the new token's key
    taken from the unrounded input (as if not buffered) misses that by the bf16 rounding."""
    if backend == "triton":
        pytest.importorskip("triton")
    _, _, err = _decode_keys(arch, backend, torch.float32, torch.bfloat16, seed=12)
    assert err <= S32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_wider_than_the_buffer_round_to_nearest_on_both_backends(arch):
    """fp32 inputs into a bf16 buffer: the Triton kernels store the bits of torch's nearest-even
    cast, in the interpreter too (whose own bf16 cast truncates). Teeth: truncation differs."""
    pytest.importorskip("triton")
    from replayssm.layers import LAYERS as CALLS
    layer = make_layer(arch)
    consts = layer._consts() if arch == "mamba2" else {}
    g = generator(13)
    state = 0.5 * torch.randn(2, *layer.state_shape, generator=g)
    toks = [layer.tokens(g, 2, 1) for _ in range(2)]
    held = {}
    for backend in ("torch", "triton"):
        cache = layer.cache(2, window=4, buffer_dtype=torch.bfloat16)
        cache.load_state(torch.tensor([0, 1]), state)
        for tok in toks:
            CALLS[arch].call(cache, torch.tensor([0, 1]), tok, consts, False, backend=backend)
        held[backend] = {f: cache.buffer[f][:2, :2].clone() for f in INPUT_FIELDS[arch]}
    for f in INPUT_FIELDS[arch]:
        source = torch.stack([t[SOURCE[f]][:, 0] for t in toks], 1)
        assert torch.equal(held["torch"][f], source.bfloat16()), f
        assert torch.equal(held["triton"][f], held["torch"][f]), f
        truncated = (source.view(torch.int32) & -65536).view(torch.float32).bfloat16()
        assert not torch.equal(truncated, held["torch"][f]), f
