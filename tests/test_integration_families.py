"""The Mamba-2 hybrid families of transformers through ``rs.patch``: greedy parity (batch of 2 with
left padding, window 8, 40 new tokens = 4 refreshes), batched speculative generation identical to
greedy, the one place their differences are stated (``MAMBA2_MIXERS``), unsupported variants.

Tiny random-weight configs in fp32 on CPU; the oracle is stock transformers (its conventional
per-token state update), never the code under test. The same logit tolerance as
``test_integration_transformers``: ReplaySSM's fp32 recurrence differs from the stock one by its
association only (a few fp32 ulps of the state), measured ~1e-7 on these models; we assert 1e-4.

The mixers' default initialisation (D = 1, decays of 0.3 .. 1e-5 per token, small B and C) makes
the skip term D x swamp the recurrent state, so a wrong state would hardly move the logits. Each
model's Mamba-2 parameters are redrawn so that the state carries the signal (slow decays, small
D, larger projections): moving dt_bias by 0.5 then moves the logits by ~3e-3, thirty times the
tolerance, which the teeth tests below rely on.
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    BambaConfig, BambaForCausalLM, FalconH1Config, FalconH1ForCausalLM, GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM, NemotronHConfig, NemotronHForCausalLM, Zamba2Config, Zamba2ForCausalLM,
)

import replayssm.integrations.transformers as rst  # noqa: E402
from helpers import RowDrafter, TreeRowDrafter, handover_logits, unpadded_rows  # noqa: E402
from replayssm.integrations.speculative import speculative_generate  # noqa: E402

LOGIT_ATOL = 1e-4
DEVICE = os.environ.get("REPLAYSSM_TEST_DEVICE", "cpu")
VOCAB = 99
WINDOW = 8
NEW_TOKENS = 40  # 39 decode steps at L = 8: 4 refreshes per slot
_IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8)
_ATTN = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _nemotron_h():
    # Nemotron-H / Nemotron-3 layer kinds: Mamba-2, MoE, attention, Mamba-2, dense MLP
    return NemotronHForCausalLM(NemotronHConfig(
        **_IDS, **_ATTN, head_dim=8,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16))


def _falcon_h1(rms_norm=True):
    # muP multipliers on every part of the projection, on the mixer's input and output
    return FalconH1ForCausalLM(FalconH1Config(
        **_IDS, **_ATTN, **_MAMBA, num_hidden_layers=2, mamba_d_ssm=64, mamba_rms_norm=rms_norm,
        mamba_norm_before_gate=rms_norm, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9], ssm_in_multiplier=1.3,
        ssm_out_multiplier=0.8, mlp_multipliers=[1.1, 0.9]))


def _bamba():
    return BambaForCausalLM(BambaConfig(**_IDS, **_ATTN, **_MAMBA, num_hidden_layers=3, attn_layer_indices=[1],
                                        mamba_conv_bias=False))


def _granite():
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **_IDS, **_ATTN, **_MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16, position_embedding_type="rope"))


def _zamba2():
    # the shared attention block (with rotary positions) runs beside the second Mamba-2 layer
    return Zamba2ForCausalLM(Zamba2Config(
        **_IDS, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
        mamba_d_state=16, mamba_ngroups=2, n_mamba_heads=8, mamba_headdim=8, chunk_size=8,
        num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16, intermediate_size=48,
        num_mem_blocks=1, use_mem_rope=True, initializer_range=0.05))  # 0.02: it repeats one token


FAMILIES = {"nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1, "falcon_h1_no_norm": lambda: _falcon_h1(False),
            "bamba": _bamba, "granitemoehybrid": _granite, "zamba2": _zamba2}
_MIXER_NAMES = {name for name, _ in rst.MAMBA2_MIXERS.values()}
_cache = {}


def _mixers(model):
    return [m for m in model.modules() if type(m).__name__ in _MIXER_NAMES]


@torch.no_grad()
def _energize(model, seed=1):
    """Redraw the Mamba-2 parameters so that the recurrent state carries the signal (see top)."""
    g = torch.Generator().manual_seed(seed)
    for m in _mixers(model):
        H = m.num_heads
        m.A_log.copy_(torch.log(0.05 + 0.45 * torch.rand(H, generator=g)))
        m.dt_bias.copy_(-1.5 + torch.rand(H, generator=g))
        m.D.copy_(0.2 * torch.randn(H, generator=g))
        m.in_proj.weight.mul_(4)
        m.conv1d.weight.mul_(2)
    return model


def model_of(name):
    if name not in _cache:
        torch.manual_seed(0)
        _cache[name] = _energize(FAMILIES[name]().eval()).to(DEVICE)
    return _cache[name]


def _greedy(model, ids, mask, n=NEW_TOKENS, eos=None):
    return model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=n, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)


def _padded_batch(b=2, seed=3):
    """Prompts of 12 tokens (the second half repeats the first, so n-gram drafts exist), rows 1 and
    2 left-padded by 3 and 5."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, VOCAB, (b, 6), generator=g)
    ids = torch.cat([base, base], 1)
    mask = torch.ones_like(ids)
    for r, pad in zip(range(1, b), (3, 5)):
        ids[r, :pad] = 0
        mask[r, :pad] = 0
    return ids, mask


def _max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores))


# ---------------------------------------------------------------------------------------------
# greedy parity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_greedy_parity(name):
    model = model_of(name)
    ids, mask = _padded_batch()
    ref = _greedy(model, ids, mask)
    with rst.patch(model, precision="s32_rs", window=WINDOW) as p:
        out = _greedy(model, ids, mask)
        counters = p.counters()
    assert len(p.adapters) == len(_mixers(model)) >= 2  # every Mamba-2 mixer is decoded by ReplaySSM
    assert torch.equal(out.sequences, ref.sequences)
    diff = _max_logit_diff(ref, out)
    print(f"{name}: max |logit diff| over {NEW_TOKENS} steps = {diff:.2e}")
    assert diff <= LOGIT_ATOL
    for c in counters.values():
        assert (c["refreshes"] >= 4).all() and (c["tokens"] == NEW_TOKENS - 1).all()


def test_family_differences_have_teeth():
    """FalconH1's multipliers are its stated difference: an adapter that ignores them (the plain
    Mamba2Mixer entry) is caught by the parity check; and a wrong dt_bias is caught on Nemotron-H."""
    ids, mask = _padded_batch()
    model = model_of("falcon_h1")
    ref = _greedy(model, ids, mask, n=12)
    saved = rst.MAMBA2_MIXERS["falcon_h1"]
    rst.MAMBA2_MIXERS["falcon_h1"] = (saved[0], rst.Mamba2Family())
    try:
        with rst.patch(model, window=WINDOW):
            broken = _greedy(model, ids, mask, n=12)
    finally:
        rst.MAMBA2_MIXERS["falcon_h1"] = saved
    assert _max_logit_diff(ref, broken) > 30 * LOGIT_ATOL

    model = model_of("nemotron_h")
    ref = _greedy(model, ids, mask, n=12)
    with rst.patch(model, window=WINDOW) as p:
        for ad in p.adapters:  # decode with dt_bias shifted by 0.5 (the prefill stays stock)
            ad.module.dt_bias.data += 0.5
        try:
            broken = _greedy(model, ids, mask, n=12)
        finally:
            for ad in p.adapters:
                ad.module.dt_bias.data -= 0.5
    assert _max_logit_diff(ref, broken) > 5 * LOGIT_ATOL


@pytest.mark.parametrize("name", ["falcon_h1", "zamba2"])
def test_family_state_written_back(name):
    """Hybrid cache layers (attention and Mamba-2 state in one): decode 10 tokens through ReplaySSM,
    continue the same cache with a stock 4-token forward, then unpatch and decode stock: every logit
    is the all-stock run's."""
    model = model_of(name)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        assert (handover_logits(model, ids, False) - handover_logits(model, ids, True)).abs().max().item() <= LOGIT_ATOL


# ---------------------------------------------------------------------------------------------
# batched speculative generation
# ---------------------------------------------------------------------------------------------
def _early_eos(continuations):
    """A token that row 0 generates first at step 6 .. 20 and that some other row reaches later or
    never: (token, row 0's length with it)."""
    first = [{} for _ in continuations]
    for r, seq in enumerate(continuations):
        for i, t in enumerate(seq):
            first[r].setdefault(t, i)
    for t, i in sorted(first[0].items(), key=lambda kv: kv[1]):
        if 6 <= i <= 20 and any(f.get(t, len(continuations[0])) > i + 2 for f in first[1:]):
            return t, i + 1
    raise AssertionError("no usable eos token in row 0's continuation")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_batched_speculative_matches_greedy(name):
    """Batch of 3, left padding, rows accepting different counts per step, one row stopping at an
    eos token far earlier than the others: every row is greedy generate's."""
    model = model_of(name)
    ids, mask = _padded_batch(3)
    free = _greedy(model, ids, mask, n=30).sequences
    eos, stop = _early_eos(free[:, ids.shape[1]:].tolist())
    ref = _greedy(model, ids, mask, n=30, eos=eos).sequences
    drafter = RowDrafter(unpadded_rows(free, mask), VOCAB)
    out, st = speculative_generate(model, ids, attention_mask=mask, drafter=drafter, num_draft=3,
                                   max_new_tokens=30, eos_token_id=eos, window=WINDOW)
    assert torch.equal(out, ref.to(out.device))
    print(f"{name}: {st.as_dict()}")
    assert st.row_new_tokens[0] == stop < max(st.row_new_tokens)
    assert {0, 3} <= set(st.accepted_per_step) and st.verify_steps > 0
    assert rst.get_patch(model) is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_tree_speculative_matches_greedy(name):
    """Draft trees (``helpers.TreeRowDrafter``: random shapes per row and step, the greedy path
    among wrong siblings) on the PyTorch backend: the Mamba-2 layers verify with ``parents``, the
    attention layers with the tree mask; every row is greedy generate's."""
    model = model_of(name)
    ids, mask = _padded_batch(3)
    free = _greedy(model, ids, mask, n=24).sequences
    drafter = TreeRowDrafter(unpadded_rows(free, mask), VOCAB)
    out, st = speculative_generate(model, ids, attention_mask=mask, drafter=drafter, num_draft=4,
                                   max_new_tokens=24, window=WINDOW, backend="torch")
    assert torch.equal(out, free.to(out.device))
    assert st.tree_steps > 0 and 0 in st.accepted_per_step


# ---------------------------------------------------------------------------------------------
# unsupported variants name the attribute
# ---------------------------------------------------------------------------------------------
def test_unsupported_mixer_variants():
    torch.manual_seed(0)
    model = _nemotron_h().eval()
    mixer = _mixers(model)[0]
    d = mixer.D
    mixer.D = torch.nn.Parameter(torch.ones(mixer.intermediate_size))  # a per-channel D
    with pytest.raises(rst.ReplaySSMUnsupported, match=r"NemotronHMamba2Mixer \(layer 0\): D has shape"):
        rst.patch(model)
    mixer.D = d
    mixer.n_groups = 3
    with pytest.raises(rst.ReplaySSMUnsupported, match="n_groups = 3 does not divide num_heads = 8"):
        rst.patch(model)
    mixer.n_groups = 2
    mixer.activation = "no-such-activation"
    with pytest.raises(rst.ReplaySSMUnsupported, match="activation"):
        rst.patch(model)
    mixer.activation = "silu"
    assert rst.get_patch(model) is None
    with rst.patch(model) as p:  # restored: accepted again
        assert len(p.adapters) == 2
