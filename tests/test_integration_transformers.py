"""The transformers integration: patch / unpatch, greedy parity, batch with padding, speculative
generation (n-gram and random drafters, rejection paths; batched, with per-row acceptance), clear
errors for unsupported things. The Mamba-2 hybrid families: ``test_integration_families``.

Tiny random-weight configs in fp32 on CPU. The oracle is stock transformers (its conventional
per-token state update), never the code under test.

Logit tolerance: with the ``s32_rs`` preset ReplaySSM computes the same recurrence in fp32 with a
different association (checkpoint + replay of up to L tokens instead of one update per token).
Each recurrent output then differs by a few fp32 ulps of the state (|S| * L * 2^-24 ~ 1e-6
relative); through the tiny networks (RMSNorms, 2-4 layers, a 32-wide LM head) that stays
below 1e-5 absolute on logits of magnitude <= a few units. We assert 1e-4 (x10 margin) and
record the measured figure.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache, LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM, MambaConfig,
    MambaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
    Qwen3NextConfig, Qwen3NextForCausalLM,
)

import replayssm.integrations.transformers as rst  # noqa: E402
from helpers import RowDrafter, unpadded_rows  # noqa: E402
from replayssm.integrations.evalkl import eval_kl  # noqa: E402
from replayssm.integrations.speculative import (  # noqa: E402
    ModelDrafter, NGramDrafter, speculative_generate,
)

LOGIT_ATOL = 1e-4
# the same tests run on a GPU (Triton backend) with REPLAYSSM_TEST_DEVICE=cuda
DEVICE = os.environ.get("REPLAYSSM_TEST_DEVICE", "cpu")
NEW_TOKENS = 64
VOCAB = 99


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: threading overhead dominates (x5-x20 slower with 2 threads)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _mamba2():
    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                       expand=2, state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Mamba2ForCausalLM(cfg).eval()


_GDN_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
_GDN_GEOM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4, layer_types=_GDN_LAYERS, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)


def _qwen35():
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_GDN_GEOM)).eval()


def _qwen3next():
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**_GDN_GEOM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, decoder_sparse_step=1)
    return Qwen3NextForCausalLM(cfg).eval()


def _qwen35_moe():
    torch.manual_seed(0)
    geom = {k: v for k, v in _GDN_GEOM.items() if k != "intermediate_size"}
    cfg = Qwen3_5MoeTextConfig(**geom, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16)
    return Qwen3_5MoeForCausalLM(cfg).eval()


MODELS = {"mamba2": _mamba2, "qwen3_5": _qwen35, "qwen3_next": _qwen3next, "qwen3_5_moe": _qwen35_moe}
_cache = {}


def model_of(name):
    if name not in _cache:
        _cache[name] = MODELS[name]().to(DEVICE)
    return _cache[name]


def _greedy(model, ids, attention_mask=None, n=NEW_TOKENS, eos=None):
    ids = ids.to(DEVICE)
    attention_mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(DEVICE)
    return model.generate(ids, attention_mask=attention_mask, max_new_tokens=n, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                          eos_token_id=eos)


def _padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4] = 0  # left padding of the shorter prompt
    mask[1, :4] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------
# greedy parity (batch of 2 with left padding, 64 new tokens = 4 refreshes at L = 16)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity_batch_with_padding(name):
    model = model_of(name)
    ids, mask = _padded_batch()
    ref = _greedy(model, ids, mask)
    with rst.patch(model, precision="s32_rs", window=16) as p:
        out = _greedy(model, ids, mask)
        counters = p.counters()
    assert torch.equal(out.sequences, ref.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.scores, out.scores))
    print(f"{name}: max |logit diff| over {NEW_TOKENS} steps = {diff:.2e}")
    assert diff <= LOGIT_ATOL
    assert len(counters) == len(p.adapters) and counters
    for c in counters.values():  # several refreshes happened, every decoded token went through it
        assert (c["refreshes"] >= 3).all() and (c["tokens"] == NEW_TOKENS - 1).all()


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5"])
def test_one_token_prompt(name):
    """A 1-token prompt: the first forward is a stock single-token step on an empty cache."""
    model = model_of(name)
    ids = torch.tensor([[7]])
    ref = _greedy(model, ids, n=24)
    with rst.patch(model):
        out = _greedy(model, ids, n=24)
    assert torch.equal(out.sequences, ref.sequences)


def test_unpatch_restores_stock():
    model = model_of("mamba2")
    stock_forward = type(model.backbone.layers[0].mixer).forward
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = _greedy(model, ids, n=20)
    p = rst.patch(model)
    assert "forward" in vars(model.backbone.layers[0].mixer)
    p.unpatch()
    p.unpatch()  # idempotent
    assert "forward" not in vars(model.backbone.layers[0].mixer)
    assert "generate" not in vars(model) and rst.get_patch(model) is None
    assert type(model.backbone.layers[0].mixer).forward is stock_forward
    out = _greedy(model, ids, n=20)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, out.scores))  # bit-identical again


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5"])
def test_unpatch_mid_sequence_writes_state_back(name):
    """Decode 20 tokens through ReplaySSM, unpatch, continue the same transformers cache stock."""
    model = model_of(name)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    steps = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7)).to(DEVICE)

    def run(patch_for):
        cache = DynamicCache(config=model.config)
        logits = [model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]]
        p = rst.patch(model) if patch_for else None
        for t in range(steps.shape[1]):
            if p is not None and t == patch_for:
                p.unpatch()
            logits.append(model(input_ids=steps[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
        return torch.stack(logits)

    with torch.no_grad():
        ref, mixed = run(0), run(20)
    assert (ref - mixed).abs().max().item() <= LOGIT_ATOL


def test_multi_token_continuation_after_decode():
    """A stock multi-token forward continuing a cache that ReplaySSM decoded sees the right state."""
    model = model_of("qwen3_5")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0, -4:]
        with rst.patch(model):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :5], cache=cache, use_cache=True)
            for t in range(5, 8):
                model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            out = model(input_ids=ids[:, 8:], cache=cache, use_cache=True).logits[0]
    assert (ref - out).abs().max().item() <= LOGIT_ATOL


def test_token_counts_follow_decode_and_accept():
    """Every layer of the transformers cache counts the tokens it holds (the positions of the next forward
    follow layer 0's count, a linear layer in Qwen3.5): after a ReplaySSM decode and a verify whose
    accept keeps 2 of 4 tokens, the counts agree and a stock continuation sees the right positions."""
    from replayssm.integrations.speculative import _attention_layers
    model = model_of("qwen3_5")
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0, -4:]
        with rst.patch(model) as p:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :4], cache=cache, use_cache=True)
            model(input_ids=ids[:, 4:5], cache=cache, use_cache=True)
            with p.verifying():
                model(input_ids=ids[:, 5:9], cache=cache, use_cache=True)
            p.accept(torch.tensor([2]))
            for _, crop in _attention_layers(cache):
                crop(2)
            if hasattr(cache.layers[0], "cumulative_length_linear"):  # transformers >= 5.25 counts linear layers
                counts = {int(cache.get_seq_length(i)) for i in range(len(cache.layers))}
                assert counts == {7}, counts
            model(input_ids=ids[:, 7:8], cache=cache, use_cache=True)
            out = model(input_ids=ids[:, 8:], cache=cache, use_cache=True).logits[0]
    assert (ref - out).abs().max().item() <= LOGIT_ATOL


def test_two_precision_preset_logprob_difference():
    model = model_of("mamba2")
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    res = eval_kl(model, ids, presets=("s32_rs", "tp8_hi32", "tp4_hi16_sr"), prefix=4)
    for name, r in res.items():
        print(f"{name}: mean KL {r['mean_kl']:.2e}, p95 |dlogp| {r['p95_abs_dlogp']:.2e}")
    assert res["s32_rs"]["p95_abs_dlogp"] < 1e-4
    assert 0 < res["tp8_hi32"]["p95_abs_dlogp"] < 0.5
    assert res["tp8_hi32"]["mean_kl"] <= res["tp4_hi16_sr"]["mean_kl"] + 1e-9
    # generation with a two-precision preset runs end to end
    with rst.patch(model, precision="tp8_hi32"):
        out = _greedy(model, ids[:, :6], n=20)
    assert out.sequences.shape == (1, 26)


# ---------------------------------------------------------------------------------------------
# speculative generation
# ---------------------------------------------------------------------------------------------
def _repetitive_prompt(seed=1):
    base = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:, :5]], 1).to(DEVICE)


def _random_drafter(seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda tokens, k: torch.randint(3, VOCAB, (k,), generator=g).tolist()


class _SelfDrafter:
    """The model's own greedy continuation (stock path on a copy of the context): full acceptance."""

    def __init__(self, reference):
        self.reference = reference

    def __call__(self, tokens, k):
        n = tokens.numel()
        return self.reference[n:n + k].tolist()


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5"])
@pytest.mark.parametrize("drafter", ["ngram", "random", "self"])
def test_speculative_matches_greedy(name, drafter):
    model = model_of(name)
    ids = _repetitive_prompt()
    ref = _greedy(model, ids).sequences
    d = {"ngram": "ngram", "random": _random_drafter(), "self": _SelfDrafter(ref[0])}[drafter]
    out, st = speculative_generate(model, ids, drafter=d, num_draft=4, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, ref)
    assert st.new_tokens == NEW_TOKENS and st.verify_steps > 0
    assert rst.get_patch(model) is None  # patched for the call only
    print(f"{name}/{drafter}: {st.as_dict()}")
    if drafter == "random":  # the rejection paths: almost every draft rejected
        assert st.acceptance_rate < 0.2 and 0 in st.accepted_per_step
    if drafter == "self":  # the full-acceptance path: every step takes all drafts + the bonus token
        assert st.acceptance_rate == 1.0 and st.tokens_per_step > 4


def test_speculative_partial_acceptance_and_conv_rollback():
    """Drafts right for a random number of tokens then wrong: every 0 <= n <= T acceptance occurs."""
    model = model_of("qwen3_5")
    ids = _repetitive_prompt(2)
    ref = _greedy(model, ids).sequences[0]
    g = torch.Generator().manual_seed(4)

    def drafter(tokens, k):
        n = tokens.numel()
        good = int(torch.randint(0, k + 1, (1,), generator=g))
        d = ref[n:n + k].tolist()
        return d[:good] + [(t + 1) % VOCAB for t in d[good:]]

    out, st = speculative_generate(model, ids, drafter=drafter, num_draft=4, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out[0], ref)
    assert {0, 4} <= set(st.accepted_per_step) and len(set(st.accepted_per_step)) >= 4


def test_speculative_model_drafter():
    """A smaller model as drafter (the tiny Mamba-2 drafts for the GDN hybrid; same vocabulary)."""
    model, small = model_of("qwen3_5"), model_of("mamba2")
    ids = _repetitive_prompt(5)
    ref = _greedy(model, ids, n=32).sequences
    out, st = speculative_generate(model, ids, drafter=ModelDrafter(small), num_draft=3, max_new_tokens=32)
    assert torch.equal(out, ref) and st.verify_steps > 0


def test_speculative_with_existing_patch_and_eos():
    model = model_of("mamba2")
    ids = _repetitive_prompt(3)
    ref = _greedy(model, ids, n=30).sequences[0]
    eos = int(ref[ids.shape[1] + 10])
    with rst.patch(model, precision="s32_rs", window=8, max_draft=5) as p:
        out, st = speculative_generate(model, ids, drafter=_SelfDrafter(ref), num_draft=4,
                                       max_new_tokens=30, eos_token_id=eos)
        assert rst.get_patch(model) is p
    stop = ids.shape[1] + int((ref[ids.shape[1]:] == eos).nonzero()[0]) + 1
    assert torch.equal(out[0], ref[:stop])


def _batched_prompts():
    """3 repetitive prompts (n-gram drafts exist), rows 1 and 2 left-padded by 4 and 7."""
    base = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(11))
    ids = torch.cat([base, base], 1)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    ids[2, :7], mask[2, :7] = 0, 0
    return ids, mask


def _early_eos(continuations):
    """A token some row generates first at step 6 .. 30 while another row reaches it later or never."""
    first = [{} for _ in continuations]
    for r, seq in enumerate(continuations):
        for i, t in enumerate(seq):
            first[r].setdefault(t, i)
    for f in first:
        for t, i in sorted(f.items(), key=lambda kv: kv[1]):
            if 6 <= i <= 30 and any(g.get(t, 10**9) > i + 2 for g in first):
                return t
    raise AssertionError("no usable eos token")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("drafter", ["rows", "ngram"])
def test_batched_speculative_matches_greedy(name, drafter):
    """Batch of 3 with left padding: rows draft and accept different counts in the same step, and
    (with the row drafter) one row stops at eos long before the others."""
    model = model_of(name)
    ids, mask = _batched_prompts()
    free = _greedy(model, ids, mask, n=40).sequences
    eos = _early_eos(free[:, ids.shape[1]:].tolist()) if drafter == "rows" else None
    ref = _greedy(model, ids, mask, n=40, eos=eos).sequences
    d = RowDrafter(unpadded_rows(free, mask), VOCAB) if drafter == "rows" else "ngram"
    out, st = speculative_generate(model, ids, attention_mask=mask, drafter=d, num_draft=4, max_new_tokens=40,
                                   eos_token_id=eos)
    assert torch.equal(out, ref)
    print(f"{name}/{drafter}: {st.as_dict()}")
    assert st.verify_steps > 0
    if drafter == "rows":
        assert {0, 4} <= set(st.accepted_per_step)
        assert len(set(st.row_new_tokens)) > 1  # the rows stopped at different lengths


def test_batched_speculative_per_row_acceptance_has_teeth():
    """Per-row accept counts and masking the positions a row rejected (while another row kept them)
    are what keep every row greedy: breaking either breaks the output."""
    model = model_of("qwen3_5")
    ids, mask = _batched_prompts()
    free = _greedy(model, ids, mask, n=24).sequences

    def run():
        return speculative_generate(model, ids, attention_mask=mask, drafter=RowDrafter(unpadded_rows(free, mask), VOCAB),
                                    num_draft=4, max_new_tokens=24)[0]

    assert torch.equal(run(), free)
    orig = rst.ReplayPatch.accept  # 1. every row commits the largest count
    rst.ReplayPatch.accept = lambda self, n: orig(self, torch.as_tensor(n).max().expand(torch.as_tensor(n).shape))
    try:
        assert not torch.equal(run(), free)
    finally:
        rst.ReplayPatch.accept = orig
    stock_forward = model.forward  # 2. generated positions are never masked

    @functools.wraps(stock_forward)
    def unmasked(*args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.shape[1] > ids.shape[1]:
            attention_mask = attention_mask.clone()
            attention_mask[:, ids.shape[1]:] = 1
        return stock_forward(*args, attention_mask=attention_mask, **kwargs)

    model.forward = unmasked
    try:
        assert not torch.equal(run(), free)
    finally:
        del model.forward


def test_ngram_drafter():
    d = NGramDrafter(max_ngram=3)
    assert d(torch.tensor([5, 6, 7, 8, 9, 5, 6, 7]), 3) == [8, 9, 5]
    assert d(torch.tensor([1, 2, 3, 4]), 2) == []
    assert d(torch.tensor([4, 1, 4, 2, 4]), 2) == [2, 4]  # latest match of the 1-gram wins


# ---------------------------------------------------------------------------------------------
# clear errors, never a silent fall back
# ---------------------------------------------------------------------------------------------
def test_unsupported_models_and_options():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2)).eval()
    with pytest.raises(rst.ReplaySSMUnsupported, match="no layer that ReplaySSM supports"):
        rst.patch(llama)
    mamba1 = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                          state_size=4)).eval()
    with pytest.raises(rst.ReplaySSMUnsupported, match="MambaMixer"):
        rst.patch(mamba1)
    model = model_of("mamba2")
    ids = torch.randint(3, VOCAB, (1, 5)).to(DEVICE)
    with rst.patch(model):
        with pytest.raises(RuntimeError, match="already patched"):
            rst.patch(model)
        with pytest.raises(rst.ReplaySSMUnsupported, match="beam search"):
            model.generate(ids, num_beams=2, max_new_tokens=3)
        with pytest.raises(rst.ReplaySSMUnsupported, match="use_cache=False"):
            model.generate(ids, use_cache=False, max_new_tokens=3)
        with pytest.raises(rst.ReplaySSMUnsupported, match="speculative"):
            model.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=3)
    with pytest.raises(ValueError, match="padding on the left"):
        bad = torch.ones(2, 5, dtype=torch.long)
        bad[0, -1] = 0  # right padding
        speculative_generate(model, torch.randint(3, VOCAB, (2, 5)).to(DEVICE), attention_mask=bad.to(DEVICE))
    with pytest.raises(ValueError, match="max_draft"):
        rst.patch(model, window=4, max_draft=8)
    with rst.patch(model, max_draft=2):
        with pytest.raises(ValueError, match="num_draft=4 needs 5"):
            speculative_generate(model, ids, num_draft=4)
    assert rst.get_patch(model) is None


# ---------------------------------------------------------------------------------------------
# the tiny trained byte-level models shipped in models/ (tools/train_tiny.py)
# ---------------------------------------------------------------------------------------------
_MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


@pytest.mark.parametrize("name", ["tiny-mamba2-kjv", "tiny-qwen35-kjv"])
def test_trained_models(name):
    path = os.path.join(_MODELS_DIR, name)
    if not os.path.isdir(path):
        pytest.skip(f"{path} not present")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(DEVICE)
    held = open(os.path.join(_MODELS_DIR, "kjv_heldout.txt"), "rb").read()
    ids = torch.tensor([list(held[1000:1060])], device=DEVICE)
    ref = _greedy(model, ids)
    with rst.patch(model, precision="s32_rs", window=16):
        out = _greedy(model, ids)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.scores, out.scores)) <= LOGIT_ATOL
    spec, st = speculative_generate(model, ids, drafter="ngram", num_draft=4, max_new_tokens=NEW_TOKENS)
    assert torch.equal(spec, ref.sequences)
    print(f"{name}: n-gram acceptance {st.acceptance_rate:.2f}, {st.tokens_per_step:.2f} tokens/step")
    res = eval_kl(model, torch.tensor([list(held[:96])], device=DEVICE), presets=("s32_rs", "tp8_hi32"))
    assert res["s32_rs"]["mean_kl"] < 1e-6 and res["tp8_hi32"]["mean_kl"] < 1e-3
    assert res["s32_rs"]["ppl_stock"] < 8  # trained: far below the 256 of a uniform byte model
