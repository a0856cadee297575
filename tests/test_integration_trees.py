"""Draft trees in ``speculative_generate``: tree drafters (random trees around the greedy
continuation, ``NGramTreeDrafter``, ``ModelDrafter(k > 1)``) give exactly greedy ``generate``'s
tokens on the Mamba-2 and Gated DeltaNet hybrid models, batched with left padding, rows of
different tree shapes, rows that accept nothing, eos; a tree attention mask that shows siblings,
a committed path other than the walked one, index positions or a skipped KV reorder each break
that; a cache that does not verify trees is refused naming the drafter.

Tiny random-weight configs in fp32 on CPU (those of ``test_integration_transformers``), PyTorch
backend; the oracle is stock greedy ``generate``. On the tiny trained model ``tiny-qwen35-kjv``
(``models/``) the n-gram trie needs fewer forwards than the n-gram chain of as many nodes.
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TreeRowDrafter, unpadded_rows  # noqa: E402
from test_integration_transformers import (  # noqa: E402
    VOCAB,
    _batched_prompts,
    _early_eos,
    _greedy,
    _repetitive_prompt,
    model_of,
)

import replayssm.integrations.speculative as spec  # noqa: E402
import replayssm.integrations.transformers as rst  # noqa: E402
from replayssm.integrations.speculative import (  # noqa: E402
    ModelDrafter,
    NGramDrafter,
    NGramTreeDrafter,
    speculative_generate,
)

NEW = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _spec(model, ids, mask, drafter, n=NEW, eos=None, num_draft=5):
    return speculative_generate(model, ids, attention_mask=mask, drafter=drafter, num_draft=num_draft,
                                max_new_tokens=n, eos_token_id=eos, backend="torch")


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_tree_speculative_matches_greedy(name):
    """Batch of 3 with left padding; per step each row drafts its own random tree (every third
    call a chain), accepts 0 .. depth drafts along its own path; one row stops at eos early."""
    model = model_of(name)
    ids, mask = _batched_prompts()
    free = _greedy(model, ids, mask, n=40).sequences
    # (Qwen3.5-MoE's rows all reach the chosen eos token within a few steps: it runs without)
    eos = _early_eos(free[:, ids.shape[1]:].tolist()) if name != "qwen3_5_moe" else None
    ref = _greedy(model, ids, mask, n=40, eos=eos).sequences
    drafter = TreeRowDrafter(unpadded_rows(free, mask), VOCAB, chain_every=3)
    out, st = _spec(model, ids, mask, drafter, n=40, eos=eos)
    print(f"{name}: {st.as_dict()}")
    assert torch.equal(out, ref)
    assert st.tree_steps > 0
    assert 0 in st.accepted_per_step and max(st.accepted_per_step) >= 3
    assert (len(set(st.row_new_tokens)) > 1) == (eos is not None)  # the eos row stopped first
    assert rst.get_patch(model) is None


def test_ngram_tree_drafter_trie():
    d = NGramTreeDrafter(max_ngram=2, max_candidates=3, depth=2)
    #           0  1  2  3  4  5  6  7  8  9 10
    ctx = [5, 6, 1, 2, 5, 6, 3, 4, 5, 6, 1, 9, 5, 6]
    toks, parents = d(torch.tensor(ctx), 5)
    # matches of (5, 6), latest first: continuations [1, 9], [3, 4], [1, 2]; [1, 2] shares the 1
    assert (toks, parents) == ([1, 9, 3, 4, 2], [-1, 0, -1, 2, 0])
    assert d(torch.tensor(ctx), 3) == ([1, 9, 3], [-1, 0, -1])  # the budget cuts the trie
    assert d(torch.tensor([1, 2, 3]), 4) == ([], [])


@pytest.mark.parametrize("name", ["mamba2", "qwen3_5"])
def test_ngram_tree_drafter_matches_greedy(name):
    model = model_of(name)
    ids, mask = _batched_prompts()
    ref = _greedy(model, ids, mask, n=NEW).sequences
    out, st = _spec(model, ids, mask, NGramTreeDrafter(depth=2, max_candidates=3), num_draft=4)
    assert torch.equal(out, ref)
    assert st.tree_steps > 0


def test_model_drafter_tree():
    """A top-k tree from the tiny Mamba-2 drafting for the GDN hybrid: at most k nodes per level,
    depth levels, the call's budget; k = 1 is the greedy chain. Both give greedy's tokens."""
    model, small = model_of("qwen3_5"), model_of("mamba2")
    ids = _repetitive_prompt(5)
    tree = ModelDrafter(small, k=2, depth=3)
    toks, parents = tree(ids[0], 5)
    assert len(toks) == 5 and parents[:2] == [-1, -1]  # the root's two best children, then 2 + 1
    assert all(0 <= p < i for i, p in enumerate(parents) if i >= 2)
    assert len(ModelDrafter(small, k=3, max_nodes=4)(ids[0], 6)[0]) == 4
    chain = ModelDrafter(small)(ids[0], 3)
    assert isinstance(chain, list) and len(chain) == 3
    assert chain[0] == toks[0]  # the greedy token leads both
    ref = _greedy(model, ids, n=24).sequences
    for drafter in (tree, ModelDrafter(small, k=1, depth=3)):
        out, st = speculative_generate(model, ids, drafter=drafter, num_draft=5, max_new_tokens=24, backend="torch")
        assert torch.equal(out, ref)
        assert (st.tree_steps > 0) == (drafter.k > 1)
        print(f"{drafter!r}: {st.as_dict()}")


def test_bad_tree_names_the_drafter():
    model = model_of("mamba2")
    ids = _repetitive_prompt()

    def bad(tokens, k):
        return [3, 4], [-1, 1]

    with pytest.raises(ValueError, match=r"drafter bad: parents\[1\] = 1 must be in \[-1, 1\)"):
        speculative_generate(model, ids, drafter=bad, num_draft=3, max_new_tokens=8, backend="torch")

    def uneven(tokens, k):
        return [3, 4], [-1]

    with pytest.raises(ValueError, match="drafter uneven returned 2 tokens but 1 parents"):
        speculative_generate(model, ids, drafter=uneven, num_draft=3, max_new_tokens=8, backend="torch")
    assert rst.get_patch(model) is None
    with rst.patch(model) as p:
        with pytest.raises(ValueError, match="parents must be an int32 or int64 tensor"), \
                p.verifying(parents=torch.zeros(1, 2)):
            pass
        assert p.mode == "decode" and p.parents is None
        with pytest.raises(ValueError, match="path must be an int32 or int64 tensor"):
            p.accept(torch.tensor([1]), path=torch.zeros(1, 2))


# ---------------------------------------------------------------------------------------------
# teeth: each piece of the tree step is needed
# ---------------------------------------------------------------------------------------------
def _run_rows(model, n=24, **patch_kwargs):
    ids, mask = _batched_prompts()
    free = _greedy(model, ids, mask, n=n).sequences
    out = speculative_generate(model, ids, attention_mask=mask, num_draft=5, max_new_tokens=n, backend="torch",
                               drafter=TreeRowDrafter(unpadded_rows(free, mask), VOCAB, seed=1), **patch_kwargs)[0]
    return out, free


def test_tree_pieces_have_teeth(monkeypatch):
    model = model_of("qwen3_5")
    out, free = _run_rows(model)
    assert torch.equal(out, free)

    def broken(patch_target, name, replacement, **patch_kwargs):
        with monkeypatch.context() as m:
            m.setattr(patch_target, name, replacement)
            assert not torch.equal(_run_rows(model, **patch_kwargs)[0], free), name

    # 1. siblings visible: a causal mask over the fed tokens instead of the ancestor mask
    orig_mask = spec._tree_mask
    broken(spec, "_tree_mask", lambda past, allowed, dtype: orig_mask(
        past, torch.tril(torch.ones_like(allowed)) & allowed.diagonal(dim1=1, dim2=2)[:, None, :], dtype))
    # 2. the attention layers keep the fed order instead of the accepted path's
    broken(spec, "_reorder_tail", lambda layers, order: None)
    # 3. a wrong path committed to the state-space layers: fed tokens 0, 1, 2, ... (with value
    # checks on, accept refuses it as no root path of the tree; without, the output is wrong)
    orig_accept = rst.ReplayPatch.accept
    broken(rst.ReplayPatch, "accept", lambda self, n, path=None: orig_accept(
        self, n, None if path is None else torch.arange(path.shape[1]).expand_as(path).contiguous()),
        check_values=False)
    # 4. the state-space layers verify a chain (siblings in their history)
    orig_verifying = rst.ReplayPatch.verifying
    broken(rst.ReplayPatch, "verifying", lambda self, parents=None: orig_verifying(self, None), check_values=False)


def test_tree_positions_and_conv_have_teeth(monkeypatch):
    """Mamba-2 (no attention): the causal convolution must read along the ancestors."""
    model = model_of("mamba2")
    out, free = _run_rows(model)
    assert torch.equal(out, free)
    orig = rst._conv_step
    monkeypatch.setattr(rst, "_conv_step", lambda *a, parents=None, **k: orig(*a, **k))
    assert not torch.equal(_run_rows(model)[0], free)


# ---------------------------------------------------------------------------------------------
# the tiny trained models: a tree beats the chain of as many nodes (benchmarks/tree_acceptance.py)
# ---------------------------------------------------------------------------------------------
_MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


def _heldout_prompts(count=8, length=128):
    """``count`` prompts of ``length`` bytes at evenly spaced offsets of the held-out text, as
    ``benchmarks/tree_acceptance.py --prompts count`` takes them: LongTensor [1, length] each."""
    with open(os.path.join(_MODELS_DIR, "kjv_heldout.txt"), "rb") as f:
        text = f.read()
    step = (len(text) - length) // (count - 1)
    return [torch.tensor([list(text[i * step:i * step + length])]) for i in range(count)]


def test_trained_model_tree_beats_chain_at_equal_budget():
    """The GDN + attention hybrid ``tiny-qwen35-kjv``, budget 8 nodes, 64 new tokens after each of
    8 held-out prompts: ``NGramTreeDrafter()`` (its defaults) against ``NGramDrafter()``. The trie's
    first branch is the chain's continuation; the other earlier matches take the nodes the chain
    leaves unused, so at an equal node budget the comparison is like for like. Both give greedy's
    token ids, and the tree needs strictly fewer model forwards for the same tokens. The step
    counts depend only on the greedy tokens (n-gram drafts come from the context), not on float
    values. (ModelDrafter's top-k and dynamic trees do not beat its chain by a clear margin on these
    models: docs/bench/trees.json.)"""
    path = os.path.join(_MODELS_DIR, "tiny-qwen35-kjv")
    if not os.path.isdir(path):
        pytest.skip(f"{path} not present")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    budget, new = 8, 64
    prompts = _heldout_prompts()
    refs = [_greedy(model, ids, n=new).sequences for ids in prompts]
    steps = {}
    for name, drafter in (("chain", NGramDrafter()), ("tree", NGramTreeDrafter())):
        total = tree_steps = tokens = 0
        for ids, ref in zip(prompts, refs):
            out, st = speculative_generate(model, ids, drafter=drafter, num_draft=budget, max_new_tokens=new,
                                           backend="torch")
            assert torch.equal(out, ref), name
            total, tree_steps, tokens = total + st.steps, tree_steps + st.tree_steps, tokens + st.new_tokens
        steps[name] = total
        assert tokens == 8 * new
        assert (tree_steps > 0) == (name == "tree")
    print(f"tiny-qwen35-kjv, budget {budget}: forwards chain {steps['chain']}, tree {steps['tree']}")
    assert steps["tree"] < steps["chain"]  # same tokens, fewer forwards: more tokens per step


# ---------------------------------------------------------------------------------------------
# ModelDrafter(dynamic=True): a tree grown best-first by the draft model's path probability
# ---------------------------------------------------------------------------------------------
class _TableLM:
    """A stand-in causal LM over 3 tokens: the next token's probabilities depend on the last token
    only (``table[last]``)."""

    device = torch.device("cpu")

    def __init__(self, table):
        self.logp = torch.tensor(table, dtype=torch.float64).log()

    def __call__(self, input_ids, use_cache=False):
        from types import SimpleNamespace
        return SimpleNamespace(logits=self.logp[input_ids])


def test_model_drafter_dynamic_tree_is_best_first():
    """Worked by hand: after token 2 the draft model is unsure (0.6 / 0.35), after 0 sure (0.9),
    after 1 fairly sure (0.8). Path probabilities: 0 (0.6), 0 0 (0.54), 0 0 0 (0.486), then 1 (0.35)
    beats every other offer once the depth cap (3) stops the chain, and 1 1 (0.28) comes next."""
    lm = _TableLM([[0.9, 0.06, 0.04], [0.1, 0.8, 0.1], [0.6, 0.35, 0.05]])
    ctx = torch.tensor([1, 2])
    assert ModelDrafter(lm, k=2, depth=3, dynamic=True)(ctx, 5) == ([0, 0, 0, 1, 1], [-1, 0, 1, -1, 3])
    # no depth cap: 0.6 * 0.9^j stays above 0.35 for the first 6 nodes: the greedy chain
    assert ModelDrafter(lm, k=2, dynamic=True)(ctx, 6) == ([0] * 6, [-1, 0, 1, 2, 3, 4])
    assert ModelDrafter(lm, k=2, dynamic=True)(ctx, 7)[1][-1] == -1  # 0.6 * 0.9^6 = 0.319 < 0.35
    assert ModelDrafter(lm, k=2, max_nodes=2, dynamic=True)(ctx, 6) == ([0, 0], [-1, 0])
    assert ModelDrafter(lm, k=1, depth=3, dynamic=True)(ctx, 5) == ([0, 0, 0], [-1, 0, 1])  # k = 1: a chain
    assert not ModelDrafter(lm, k=1, dynamic=True).drafts_trees
    assert "dynamic=True" in repr(ModelDrafter(lm, k=2, dynamic=True))


def test_model_drafter_dynamic_tree_matches_greedy():
    """Batch of 3 with left padding; the target's own weights draft (a copy, so each tree holds
    the target's next token), and the tiny Mamba-2 drafts for the GDN hybrid: both
    give greedy ``generate``'s tokens."""
    from test_integration_transformers import MODELS

    model = model_of("qwen3_5")
    ids, mask = _batched_prompts()
    ref = _greedy(model, ids, mask, n=NEW).sequences
    for twin, small in ((True, MODELS["qwen3_5"]()), (False, model_of("mamba2"))):
        drafter = ModelDrafter(small, k=3, dynamic=True)
        out, st = _spec(model, ids, mask, drafter, num_draft=5)
        print(f"{drafter!r}: {st.as_dict()}")
        assert torch.equal(out, ref)
        assert st.tree_steps > 0
        if twin:  # the root's likeliest child is the first node and the target's argmax: each
            # verify accepts it; the random weights' flat distributions make the tree wide and shallow
            assert min(st.accepted_per_step) >= 1 and max(st.accepted_per_step) >= 2
