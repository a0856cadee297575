"""Kimi-Linear (``KimiLinearForCausalLM``) through ``rs.patch``: its Kimi Delta Attention layers
decode with ``rs.kda_decode`` / ``rs.kda_verify``, its MLA attention layers stay with transformers.

Greedy parity (batch of 2 with left padding, window 8, 40 new tokens = 4 refreshes per slot), the
state handed back to transformers mid-sequence, batched speculative generation identical to greedy
with chain and tree drafters (trees: PyTorch backend, refused on Triton), teeth (an adapter that
drops the per-channel decay fails parity; tree residuals coupled to siblings leave greedy's
tokens), unsupported variants naming the attribute. A tiny random-weight config in fp32 on CPU; the oracle is stock transformers (its
conventional per-token KDA update), never the code under test. Logit tolerance 1e-4 as in
``test_integration_transformers``: the fp32 output-only form differs from the stock recurrence by
association only (measured ~1e-7 here).

The default initialisation gives per-channel decays of about 0.4 .. 0.99 (median 0.8 .. 0.95) and
small projections; the KDA parameters are redrawn so that the state carries the signal and the
per-channel decays span (0.2, 0.9999) within each head (A_log zeroed, dt_bias set per key
channel), which the teeth test relies on.
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_linear")

from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

import replayssm.integrations.transformers as rst  # noqa: E402
from helpers import RowDrafter, TreeRowDrafter, handover_logits, unpadded_rows  # noqa: E402
from replayssm.integrations.speculative import NGramTreeDrafter, speculative_generate  # noqa: E402

LOGIT_ATOL = 1e-4
DEVICE = os.environ.get("REPLAYSSM_TEST_DEVICE", "cpu")
VOCAB = 99
WINDOW = 8
NEW_TOKENS = 40  # 39 decode steps at L = 8: 4 refreshes per slot


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _config():
    # layer kinds: KDA, MLA + MoE, KDA, KDA + MoE (Kimi-Linear interleaves 3 KDA per MLA layer)
    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"], linear_num_heads=2, linear_head_dim=8,
        linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _kda_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "KimiLinearDeltaAttention"]


@torch.no_grad()
def _energize(model, seed=1):
    """Per-channel decays alpha = exp(-exp(A_log) softplus(dt_bias)) across (0.2, 0.9999) in every
    head (f_b_proj scaled down so the input moves them a little), larger q/k/v projections."""
    g = torch.Generator().manual_seed(seed)
    for m in _kda_layers(model):
        fg = m.forget_gate
        H, D = m.num_heads, m.head_dim
        alpha = 0.2 + (0.9999 - 0.2) * torch.rand(H, D, generator=g)
        alpha[:, 0], alpha[:, 1] = 0.2, 0.9999  # both ends in every head
        fg.A_log.zero_()  # exp(A_log) = 1: g = -softplus(.), so dt_bias = softplus^-1(-log alpha)
        x = -torch.log(alpha)
        fg.dt_bias.copy_((x + torch.log(-torch.expm1(-x))).reshape(-1))
        fg.f_b_proj.weight.mul_(0.1)
        for proj in (m.q_proj, m.k_proj, m.v_proj):
            proj.weight.mul_(3)
    return model


_cache = {}


def model_of():
    if "kimi" not in _cache:
        torch.manual_seed(0)
        _cache["kimi"] = _energize(KimiLinearForCausalLM(_config()).eval()).to(DEVICE)
    return _cache["kimi"]


def _greedy(model, ids, mask, n=NEW_TOKENS, eos=None):
    return model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=n, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)


def _padded_batch(b=2, seed=3):
    """Prompts of 12 tokens (the second half repeats the first), rows 1 and 2 left-padded by 3, 5."""
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


def test_kimi_greedy_parity():
    model = model_of()
    ids, mask = _padded_batch()
    ref = _greedy(model, ids, mask)
    with rst.patch(model, precision="s32_rs", window=WINDOW) as p:
        out = _greedy(model, ids, mask)
        counters = p.counters()
        kinds = {ad.kind for ad in p.adapters}
    assert kinds == {"kda"} and len(p.adapters) == len(_kda_layers(model)) == 3  # MLA stays stock
    assert torch.equal(out.sequences, ref.sequences)
    diff = _max_logit_diff(ref, out)
    print(f"kimi_linear: max |logit diff| over {NEW_TOKENS} steps = {diff:.2e}")
    assert diff <= LOGIT_ATOL
    for c in counters.values():
        assert (c["refreshes"] >= 4).all() and (c["tokens"] == NEW_TOKENS - 1).all()


def test_kimi_patch_passes_its_backend_to_the_kda_calls(monkeypatch):
    """The patch's backend reaches ``rs.kda_decode``: backend='triton' runs the KDA kernels (the
    interpreter here, on this model's 8-wide heads) and backend='torch' none, both decoding as
    transformers does."""
    from replayssm._triton import launch

    model = model_of()
    ids, mask = _padded_batch()
    ref = _greedy(model, ids, mask, n=6)
    for backend in ("triton", "torch"):
        launched = []
        real = launch.LAUNCHER
        monkeypatch.setattr(launch, "LAUNCHER", lambda kernel, grid, args, kwargs: launched.append(kernel.fn.__name__)
                            or real(kernel, grid, args, kwargs))
        with rst.patch(model, window=WINDOW, backend=backend):
            out = _greedy(model, ids, mask, n=6)
        monkeypatch.setattr(launch, "LAUNCHER", real)
        assert ("_kda_step_kernel" in launched) == (backend == "triton"), (backend, sorted(set(launched)))
        assert torch.equal(out.sequences, ref.sequences) and _max_logit_diff(ref, out) <= LOGIT_ATOL


def test_kimi_per_channel_decay_has_teeth(monkeypatch):
    """An adapter that reduces the per-channel decay to one value per head (its mean over the
    channels, which GDN would take) or that drops it is caught by the parity check."""
    model = model_of()
    ids, mask = _padded_batch()
    ref = _greedy(model, ids, mask, n=16)
    stock = rst._KDAAdapter.recurrence
    for broken in (lambda g: g.mean(-1, keepdim=True).expand_as(g), torch.zeros_like):
        monkeypatch.setattr(rst._KDAAdapter, "recurrence",
                            lambda self, s, q, k, v, g, beta, verify, _b=broken: stock(self, s, q, k, v, _b(g),
                                                                                      beta, verify))
        with rst.patch(model, window=WINDOW):
            out = _greedy(model, ids, mask, n=16)
        diff = _max_logit_diff(ref, out)
        print(f"broken decay: max |logit diff| = {diff:.2e}")
        assert diff > 30 * LOGIT_ATOL
    monkeypatch.setattr(rst._KDAAdapter, "recurrence", stock)


def test_kimi_state_written_back():
    """Decode 10 tokens through ReplaySSM, continue the same cache with a stock 4-token forward,
    unpatch and decode stock: every logit is the all-stock run's (the KDA state goes back to
    transformers' [K, V] layout at each hand-over)."""
    model = model_of()
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        assert (handover_logits(model, ids, False) - handover_logits(model, ids, True)).abs().max().item() <= LOGIT_ATOL


def test_kimi_batched_speculative_matches_greedy():
    """Batch of 3 with left padding, rows accepting different counts (every 0 .. 3) per step, the
    MLA KV caches cropped and the KDA convolution states rolled back: every row is greedy's."""
    model = model_of()
    ids, mask = _padded_batch(3)
    ref = _greedy(model, ids, mask, n=30).sequences
    drafter = RowDrafter(unpadded_rows(ref, mask), VOCAB)
    out, st = speculative_generate(model, ids, attention_mask=mask, drafter=drafter, num_draft=3,
                                   max_new_tokens=30, window=WINDOW)
    assert torch.equal(out, ref.to(out.device))
    print(f"kimi_linear: {st.as_dict()}")
    assert {0, 3} <= set(st.accepted_per_step) and st.verify_steps > 0
    assert rst.get_patch(model) is None


def _tree_spec(model, ids, mask, drafter, n, **kw):
    return speculative_generate(model, ids, attention_mask=mask, drafter=drafter, num_draft=4, max_new_tokens=n,
                                window=WINDOW, backend="torch", **kw)


def test_kimi_tree_speculative_matches_greedy():
    """Batch of 3 with left padding; each row drafts its own random tree around its greedy
    continuation (every third call a chain) and accepts 0 .. depth drafts along its own path,
    across refreshes: every row is greedy's. The n-gram trie drafter gives greedy's tokens too."""
    model = model_of()
    ids, mask = _padded_batch(3)
    ref = _greedy(model, ids, mask, n=30).sequences
    drafter = TreeRowDrafter(unpadded_rows(ref, mask), VOCAB, chain_every=3)
    out, st = _tree_spec(model, ids, mask, drafter, 30)
    print(f"kimi_linear trees: {st.as_dict()}")
    assert torch.equal(out, ref.to(out.device))
    assert st.tree_steps > 0 and 0 in st.accepted_per_step and max(st.accepted_per_step) >= 3
    ref = _greedy(model, ids, mask, n=16).sequences
    out, st = _tree_spec(model, ids, mask, NGramTreeDrafter(depth=2, max_candidates=3), 16)
    assert torch.equal(out, ref.to(out.device)) and st.tree_steps > 0
    assert rst.get_patch(model) is None


def test_kimi_tree_residuals_have_teeth(monkeypatch):
    """KDA residuals solved over the draft order instead of each node's ancestor chain (siblings
    coupled) leave greedy's tokens."""
    from replayssm.kda import replay
    model = model_of()
    ids, mask = _padded_batch(3)
    ref = _greedy(model, ids, mask, n=30).sequences
    orig = replay._solve
    monkeypatch.setattr(replay, "_solve", lambda st, k, buf, g, rows, cached_u=None, visible=None:
                        orig(st, k, buf, g, rows, cached_u))
    out, _ = _tree_spec(model, ids, mask, TreeRowDrafter(unpadded_rows(ref, mask), VOCAB, seed=1), 30)
    assert not torch.equal(out, ref.to(out.device))


def test_kimi_tree_speculative_on_triton_matches_greedy():
    """KDA's Triton tree kernels (the interpreter here, on this model's 8-wide heads) behind
    ``speculative_generate``: each row's random trees around its greedy continuation give greedy's
    tokens."""
    model = model_of()
    ids, mask = _padded_batch(2)
    ref = _greedy(model, ids, mask, n=10).sequences
    drafter = TreeRowDrafter(unpadded_rows(ref, mask), VOCAB, chain_every=3)
    out, st = speculative_generate(model, ids, attention_mask=mask, drafter=drafter, num_draft=3,
                                   max_new_tokens=10, window=WINDOW, backend="triton")
    assert torch.equal(out, ref.to(out.device)) and st.tree_steps > 0
    assert rst.get_patch(model) is None


def test_kimi_unsupported_variants():
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(_config()).eval()
    layer = _kda_layers(model)[0]
    fg = layer.forget_gate
    a_log = fg.A_log
    fg.A_log = torch.nn.Parameter(torch.zeros(1, 1, layer.num_heads, layer.head_dim))  # per channel
    with pytest.raises(rst.ReplaySSMUnsupported,
                       match=r"KimiLinearDeltaAttention \(layer 0\): forget_gate.A_log has shape"):
        rst.patch(model)
    fg.A_log = a_log
    layer.activation = "no-such-activation"
    with pytest.raises(rst.ReplaySSMUnsupported, match="activation"):
        rst.patch(model)
    layer.activation = "silu"
    proj = layer.b_proj
    del layer.b_proj
    with pytest.raises(rst.ReplaySSMUnsupported, match="b_proj is missing"):
        rst.patch(model)
    layer.b_proj = proj
    assert rst.get_patch(model) is None
    with rst.patch(model) as p:  # restored: accepted again
        assert len(p.adapters) == 3
