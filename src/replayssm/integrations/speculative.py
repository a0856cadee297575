"""Speculative greedy generation with ReplaySSM verify / accept, for a batch of sequences.

    from replayssm.integrations.speculative import speculative_generate
    ids, stats = speculative_generate(model, input_ids, attention_mask=mask, drafter="ngram",
                                      num_draft=4, max_new_tokens=64)

Each step feeds, for every row, its last committed token plus up to ``num_draft`` drafted tokens
(T = 1 + the most drafts any row got) through the model in one forward: the state-space layers run
``rs.mamba2_verify`` / ``rs.gdn_verify`` / ``rs.kda_verify`` (output-only, nothing committed), the
attention layers append T keys/values as usual. Under greedy decoding each row accepts the longest
prefix of its drafts that matches the model's argmax, plus the model's own next token (the "bonus"
token), so a row gains 1 .. d + 1 tokens per step and its tokens are the ones greedy ``generate``
produces for it. Then:

- every ReplaySSM cache commits each row's accepted count with ``accept`` (a pointer move per row);
- every causal-convolution state becomes the last d_conv inputs of that row's committed position;
- attention: the positions that no row kept are cropped from every KV cache; the positions that
  some rows kept and others rejected stay in the cache and are masked out (0 in the 2D attention
  mask) for the rows that rejected them, so each row attends to exactly its own committed tokens.
  Each row's position ids count only its committed tokens, as ``generate`` counts them from the
  attention mask (``cumsum - 1``), so RoPE positions are the same as greedy decoding's.

Rows differ in what they draft (a row with fewer drafts is padded; the padding is never accepted),
in how many drafts they accept, and in when they stop (``eos_token_id``): a finished row rides along
with masked inputs and accepts nothing; its output is filled with ``pad_token_id``, as ``generate``
fills it. Left padding of the prompts is given by ``attention_mask``. When no row has a draft, the
step is an ordinary decode (``*_decode``).

Drafters: ``"ngram"`` (prompt lookup: find the latest earlier occurrence of the trailing n-gram of
the row's context and propose the tokens that followed it) or any callable
``drafter(tokens: LongTensor [n], k: int) -> sequence of at most k token ids``, called once per
unfinished row with that row's tokens (prompt without padding + generated); ``ModelDrafter`` wraps
a smaller causal LM (greedy).

Not supported (``ReplaySSMUnsupported``): attention layers with a sliding window (masked positions
would count towards the window).
"""
from __future__ import annotations

import inspect
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
    """Counts over all rows. ``accepted_per_step`` has one entry per (step, row that had drafts)."""

    new_tokens: int = 0           # tokens generated, all rows (each row's first comes from the prefill)
    steps: int = 0                # model forwards after the prefill (verify + plain decode)
    verify_steps: int = 0
    decode_steps: int = 0         # steps where no row had a draft
    drafted: int = 0              # draft tokens proposed and verified
    accepted: int = 0             # draft tokens accepted
    accepted_per_step: list = field(default_factory=list)
    rows: int = 1
    row_new_tokens: list = field(default_factory=list)  # tokens generated per row

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per row per model forward after the prefill."""
        return (self.new_tokens - self.rows) / (self.steps * self.rows) if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "verify_steps": self.verify_steps,
                "decode_steps": self.decode_steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "rows": self.rows, "row_new_tokens": list(self.row_new_tokens)}


def _attention_layers(hf_cache):
    """The KV parts of a transformers cache: (layer, crop function) for every layer with keys."""
    from transformers.cache_utils import (CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer,
                                          LinearAttentionCacheLayerMixin)
    out = []
    for layer in hf_cache.layers:
        if not isinstance(layer, CacheLayerMixin):
            continue  # linear-attention / SSM state only, or a placeholder layer
        if isinstance(layer, DynamicSlidingWindowLayer) or getattr(layer, "is_sliding", False):
            raise ReplaySSMUnsupported(f"cache layer {type(layer).__name__} has a sliding window: masked "
                                       "draft positions would count towards it")
        if not isinstance(layer, DynamicLayer):
            raise ReplaySSMUnsupported(f"cache layer {type(layer).__name__} is not a dynamic KV cache layer")
        # a hybrid layer (linear state + KV, FalconH1 / Zamba2) crops only its keys and values: its
        # convolution state is committed by accept()
        crop = (lambda n, _l=layer: DynamicLayer.crop(_l, -n)) if isinstance(
            layer, LinearAttentionCacheLayerMixin) else (lambda n, _l=layer: _l.crop(-n))
        out.append(crop)
    return out


def _new_hf_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def _eos_set(eos_token_id):
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


@torch.no_grad()
def speculative_generate(model, input_ids, drafter="ngram", num_draft: int = 4, max_new_tokens: int = 64,
                         eos_token_id=None, attention_mask=None, pad_token_id: int = 0,
                         precision: str = "s32_rs", window: int = 16, **patch_kwargs):
    """Greedy speculative generation through ReplaySSM verify / accept, batched.

    model: a supported transformers causal LM (see ``replayssm.integrations.transformers``); if it
    is already patched, that patch (and its precision) is used, else it is patched for the call
    and unpatched after. input_ids: LongTensor [b, n]; attention_mask: [b, n] of 0/1, 0 marking
    left padding (None: no padding). drafter: "ngram", an ``NGramDrafter``, a ``ModelDrafter`` or
    any callable (tokens [m], k) -> at most k ids, called per unfinished row. num_draft: most
    drafts per step (the patch needs max_draft >= num_draft + 1). eos_token_id: a row stops after
    it (int or list). pad_token_id: fills a row after it stopped.

    Returns (ids [b, n + new], SpeculativeStats), new = the most tokens any row generated; row r is
    the sequence greedy ``generate(input_ids, attention_mask=attention_mask, ...)`` returns for it.
    """
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError("input_ids must be a LongTensor [batch, n] with batch, n >= 1")
    if num_draft < 1:
        raise ValueError("num_draft must be >= 1")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if drafter == "ngram":
        drafter = NGramDrafter()
    elif not callable(drafter):
        raise ValueError(f"drafter must be 'ngram' or a callable, got {drafter!r}")
    device = input_ids.device
    b, n = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != (b, n):
        raise ValueError(f"attention_mask must have shape {(b, n)}, got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device=device, dtype=torch.long)
    if not bool(((mask == 0) | (mask == 1)).all()) or not bool((mask[:, -1] == 1).all()):
        raise ValueError("attention_mask must be 0/1 with the padding on the left (last column all 1)")
    eos = _eos_set(eos_token_id)

    existing = get_patch(model)
    ctx = existing or patch(model, precision=precision, window=window, max_draft=num_draft + 1, **patch_kwargs)
    try:
        if ctx.options["max_draft"] < num_draft + 1:
            raise ValueError(f"the model's patch has max_draft={ctx.options['max_draft']}; "
                             f"num_draft={num_draft} needs {num_draft + 1}")
        takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        stats = SpeculativeStats(rows=b)
        hf_cache = _new_hf_cache(model)

        def forward(ids, cols, pos):
            kw = dict(input_ids=ids, attention_mask=cols, cache=hf_cache, use_cache=True)
            if takes_positions:
                kw["position_ids"] = pos
            return model(**kw).logits

        # prefill (the stock path); positions as generate makes them: cumsum of the mask - 1
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        logits = forward(input_ids, mask, pos)
        crops = _attention_layers(hf_cache)
        context = [input_ids[r][mask[r] == 1].tolist() for r in range(b)]  # each row's own tokens
        generated = [[] for _ in range(b)]
        committed = mask.sum(-1)  # [b] tokens each row has committed: its next position id
        nxt = logits[:, -1].argmax(-1).tolist()
        done = [False] * b

        def emit(r, toks):
            for t in toks:
                generated[r].append(t)
                context[r].append(t)
                if t in eos or len(generated[r]) >= max_new_tokens:
                    done[r] = True
                    break

        for r in range(b):
            emit(r, [nxt[r]])
        while not all(done):
            drafts = [[] for _ in range(b)]
            for r in range(b):
                k = min(num_draft, max_new_tokens - len(generated[r]) - 1)
                if not done[r] and k > 0:
                    drafts[r] = [int(t) for t in drafter(torch.tensor(context[r], device=device), k)][:k]
            T = 1 + max(len(d) for d in drafts)
            last = [context[r][-1] for r in range(b)]
            feed = torch.tensor([[last[r]] + drafts[r] + [last[r]] * (T - 1 - len(drafts[r])) for r in range(b)],
                                device=device)
            live = torch.tensor([not d for d in done], device=device)
            lens = torch.tensor([len(d) for d in drafts], device=device)
            j = torch.arange(T, device=device)
            # a finished row's inputs and a row's draft padding are masked for every later step
            fed_valid = live[:, None] & (j[None, :] <= lens[:, None])
            cols = torch.cat([mask, fed_valid.long()], 1)
            pos = committed[:, None] + j[None, :]
            stats.steps += 1
            if T == 1:
                pred = forward(feed, cols, pos).argmax(-1).tolist()
                stats.decode_steps += 1
                keep = live.long()
                for r in range(b):
                    if not done[r]:
                        emit(r, [pred[r][0]])
            else:
                with ctx.verifying():
                    pred = forward(feed, cols, pos).argmax(-1).tolist()
                stats.verify_steps += 1
                keep = torch.zeros(b, dtype=torch.long)
                for r in range(b):
                    if done[r]:
                        continue  # accepts nothing: its caches stay as they were
                    d = drafts[r]
                    a = 0  # accepted drafts: the longest prefix equal to the model's argmax
                    while a < len(d) and d[a] == pred[r][a]:
                        a += 1
                        if d[a - 1] in eos:
                            break
                    new = d[:a]
                    if not (new and new[-1] in eos):
                        new.append(pred[r][a])  # the model's own next token after the accepted prefix
                    keep[r] = a + 1  # the fed token and the a accepted drafts enter the caches
                    if d:
                        stats.drafted += len(d)
                        stats.accepted += a
                        stats.accepted_per_step.append(a)
                    emit(r, new)
                keep = keep.to(device)
                ctx.accept(keep)
            kept = j[None, :] < keep[:, None]  # [b, T]: positions that row committed
            mask = torch.cat([mask, kept.long()], 1)
            committed = committed + keep
            drop = T - int(keep.max())  # positions no row kept: cropped from the KV caches
            if drop > 0:
                for crop in crops:
                    crop(drop)
                mask = mask[:, :-drop]
        stats.row_new_tokens = [len(g) for g in generated]
        stats.new_tokens = sum(stats.row_new_tokens)
        width = max(stats.row_new_tokens)
        out = torch.full((b, n + width), pad_token_id, dtype=input_ids.dtype, device=device)
        out[:, :n] = input_ids
        for r in range(b):
            out[r, n:n + len(generated[r])] = torch.tensor(generated[r], dtype=input_ids.dtype, device=device)
        return out, stats
    finally:
        if existing is None:
            ctx.unpatch()
