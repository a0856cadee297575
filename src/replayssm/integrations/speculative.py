"""Speculative greedy generation with ReplaySSM verify / accept.

    from replayssm.integrations.speculative import speculative_generate
    ids, stats = speculative_generate(model, input_ids, drafter="ngram", num_draft=4, max_new_tokens=64)

Each step feeds the last committed token plus up to ``num_draft`` drafted tokens (T = d + 1) through
the model in one forward: the state-space layers run ``rs.mamba2_verify`` / ``rs.gdn_verify``
(output-only, nothing committed), the attention layers append T keys/values as usual. Under greedy
decoding the longest prefix of drafts that matches the model's argmax is accepted, plus the model's
own next token (the "bonus" token), so one step yields 1 .. d + 1 tokens and the result is the
token sequence that greedy ``generate`` produces. Then:

- every ReplaySSM cache commits the accepted n + 1 inputs with ``accept`` (a pointer move);
- every causal-convolution state becomes the last d_conv inputs of the committed position;
- every attention KV cache is cropped by the rejected T - n - 1 entries.

When the drafter proposes nothing, the step is an ordinary decode (``*_decode``).

Drafters: ``"ngram"`` (prompt lookup: find the latest earlier occurrence of the trailing n-gram of
the context and propose the tokens that followed it) or any callable
``drafter(tokens: LongTensor [n], k: int) -> sequence of at most k token ids``; ``ModelDrafter``
wraps a smaller causal LM (greedy).

Batch size 1 (per-row acceptance with a shared attention KV cache needs per-row cropping, which
transformers' DynamicCache does not offer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .transformers import ReplaySSMUnsupported, get_patch, patch

__all__ = ["NGramDrafter", "ModelDrafter", "SpeculativeStats", "speculative_generate"]


class NGramDrafter:
    """Prompt-lookup drafting: match the trailing n-gram (n = max_ngram .. min_ngram) of the
    context against its earlier text (latest match first) and propose up to k following tokens."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __call__(self, tokens, k: int):
        seq = tokens.tolist() if torch.is_tensor(tokens) else list(tokens)
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = seq[L - n:]
            for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if seq[start:start + n] == tail:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return follow
        return []


class ModelDrafter:
    """Greedy drafts from a (smaller) causal LM that shares the tokenizer. Runs the drafter on the
    whole context each call (simple, not fast)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, tokens, k: int):
        if k <= 0:
            return []
        ids = tokens.reshape(1, -1).to(self.model.device)
        out = self.model.generate(ids, max_new_tokens=k, do_sample=False, num_beams=1,
                                  attention_mask=torch.ones_like(ids), pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()


@dataclass
class SpeculativeStats:
    new_tokens: int = 0           # tokens generated (including the one from the prefill logits)
    steps: int = 0                # model forwards after the prefill (verify + plain decode)
    verify_steps: int = 0
    decode_steps: int = 0         # steps where the drafter proposed nothing
    drafted: int = 0              # draft tokens proposed and verified
    accepted: int = 0             # draft tokens accepted
    accepted_per_step: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per model forward after the prefill."""
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "verify_steps": self.verify_steps,
                "decode_steps": self.decode_steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step}


def _crop_attention(hf_cache, remove: int):
    """Remove the last ``remove`` positions of every attention layer of a transformers cache."""
    if remove <= 0:
        return
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin
    for layer in hf_cache.layers:
        is_lin = isinstance(layer, LinearAttentionCacheLayerMixin)
        is_attn = isinstance(layer, CacheLayerMixin)
        if is_lin and is_attn:
            raise ReplaySSMUnsupported(f"cache layer {type(layer).__name__} mixes linear and full attention")
        if is_attn:
            layer.crop(-remove)


def _new_hf_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


@torch.no_grad()
def speculative_generate(model, input_ids, drafter="ngram", num_draft: int = 4, max_new_tokens: int = 64,
                         eos_token_id=None, precision: str = "s32_rs", window: int = 16, **patch_kwargs):
    """Greedy speculative generation through ReplaySSM verify / accept.

    model: a supported transformers causal LM (see ``replayssm.integrations.transformers``); if it
    is already patched, that patch (and its precision) is used, else it is patched for the call
    and unpatched after. input_ids: LongTensor [1, n]. drafter: "ngram", an ``NGramDrafter``, a
    ``ModelDrafter`` or any callable (tokens [n], k) -> at most k ids. num_draft: most drafts per
    step (the patch needs max_draft >= num_draft + 1). eos_token_id: stop after it (int or list).

    Returns (ids [1, n + new], SpeculativeStats).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ReplaySSMUnsupported("speculative_generate supports batch size 1 (input_ids [1, n])")
    if num_draft < 1:
        raise ValueError("num_draft must be >= 1")
    if drafter == "ngram":
        drafter = NGramDrafter()
    elif not callable(drafter):
        raise ValueError(f"drafter must be 'ngram' or a callable, got {drafter!r}")
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))

    existing = get_patch(model)
    ctx = existing or patch(model, precision=precision, window=window, max_draft=num_draft + 1, **patch_kwargs)
    try:
        if ctx.options["max_draft"] < num_draft + 1:
            raise ValueError(f"the model's patch has max_draft={ctx.options['max_draft']}; "
                             f"num_draft={num_draft} needs {num_draft + 1}")
        stats = SpeculativeStats()
        device = input_ids.device
        hf_cache = _new_hf_cache(model)
        out = model(input_ids=input_ids, cache=hf_cache, use_cache=True)  # prefill: the stock path
        tokens = input_ids[0].tolist()
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        stats.new_tokens = 1
        while stats.new_tokens < max_new_tokens and nxt not in eos:
            remaining = max_new_tokens - stats.new_tokens
            k = min(num_draft, remaining - 1)
            drafts = [int(t) for t in drafter(torch.tensor(tokens, device=device), k)][:k] if k > 0 else []
            stats.steps += 1
            if not drafts:
                out = model(input_ids=torch.tensor([[nxt]], device=device), cache=hf_cache, use_cache=True)
                nxt = int(out.logits[0, -1].argmax())
                new = [nxt]
                stats.decode_steps += 1
            else:
                inp = torch.tensor([[nxt] + drafts], device=device)
                with ctx.verifying():
                    out = model(input_ids=inp, cache=hf_cache, use_cache=True)
                pred = out.logits[0].argmax(-1).tolist()
                n = 0  # accepted drafts: the longest prefix equal to the model's argmax
                while n < len(drafts) and drafts[n] == pred[n]:
                    n += 1
                    if drafts[n - 1] in eos:
                        break
                new = drafts[:n]
                if not (new and new[-1] in eos):
                    new.append(pred[n])  # the model's own next token after the accepted prefix
                ctx.accept([n + 1])  # commit the fed token and the n accepted drafts
                _crop_attention(hf_cache, len(drafts) - n)
                stats.verify_steps += 1
                stats.drafted += len(drafts)
                stats.accepted += n
                stats.accepted_per_step.append(n)
                nxt = new[-1]
            for t in new:
                tokens.append(t)
                stats.new_tokens += 1
                if t in eos:
                    break
            nxt = tokens[-1]
        return torch.tensor([tokens], device=device), stats
    finally:
        if existing is None:
            ctx.unpatch()
