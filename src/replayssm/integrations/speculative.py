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

Drafters are called once per unfinished row as ``drafter(tokens: LongTensor [n], k: int)`` with
that row's tokens (prompt without padding + generated) and k, the most draft tokens this step
(``num_draft``, fewer near ``max_new_tokens``). A drafter returns either

- a **chain**: a sequence of at most k token ids, each following the previous one; or
- a **tree**: a pair ``(tokens, parents)`` of two equal-length sequences, ``parents[i]`` in
  [-1, i) the node that node i follows (-1: the row's last committed token). Nodes beyond k, or
  deeper than k, are dropped.

Built in: ``"ngram"`` / ``NGramDrafter`` (prompt lookup: the latest earlier occurrence of the
trailing n-gram, a chain), ``NGramTreeDrafter`` (several earlier occurrences merged into a trie),
``ModelDrafter(draft_model, k=1)`` (a smaller causal LM, greedy chain) and
``ModelDrafter(draft_model, k=2.., depth=.., max_nodes=..)`` (a top-k tree from that model).

A step with a tree (any row's drafts not a chain) runs the same forward with three differences:

- the state-space layers get ``parents=`` over the T fed tokens: fed token 0 (the last committed
  token) has parent -1 (the last token the caches committed), draft node i is fed token 1 + i and
  its parent is 1 + parents[i] (0 for a child of the root); each causal convolution reads along
  the fed token's ancestors;
- the attention layers get a 4D tree mask: each fed token attends to the row's committed context,
  its ancestors and itself, never its siblings or their subtrees; position ids are the committed
  length + the token's depth (0 for the root), not its index;
- acceptance walks from the root, each time to the child whose token is the model's argmax at the
  current node; the walked path ``[0, 1 + node, ...]`` goes to ``accept(.., path=...)`` of every
  ReplaySSM cache and each conv state takes the path's last d_conv inputs; in every KV cache each
  row's last T positions are reordered to the path first (in committed order), the rest behind it
  masked or cropped as for a chain.

A step whose drafts are all chains runs as a chain verify.

Not supported (``ReplaySSMUnsupported``): attention layers with a sliding window (masked positions
would count towards the window).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .transformers import ReplaySSMUnsupported, get_patch, patch

__all__ = ["NGramDrafter", "NGramTreeDrafter", "ModelDrafter", "SpeculativeStats", "speculative_generate"]


class NGramDrafter:
    """Prompt-lookup drafting: match the trailing n-gram (n = max_ngram .. min_ngram) of the
    context against its earlier text (latest match first) and propose up to k following tokens
    (a chain)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __repr__(self):
        return f"NGramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

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


def _trie(continuations, budget: int):
    """Merge token sequences into a draft tree (tokens, parents) of at most ``budget`` nodes:
    shared prefixes become one path; earlier sequences are inserted first."""
    tokens, parents, index = [], [], {}
    for seq in continuations:
        at = -1
        for t in seq:
            node = index.get((at, t))
            if node is None:
                if len(tokens) >= budget:
                    break
                node = index[(at, t)] = len(tokens)
                tokens.append(t)
                parents.append(at)
            at = node
    return tokens, parents


class NGramTreeDrafter:
    """Prompt lookup with several candidates: up to ``max_candidates`` earlier occurrences of the
    trailing n-gram (n = max_ngram .. min_ngram, latest first; one per continuation start) each
    propose the at most ``depth`` tokens that followed them (None: k); the continuations are merged
    into a trie of at most k nodes, the best match's branch first. Returns (tokens, parents)."""

    drafts_trees = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 4, depth: int | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")
        if depth is not None and depth < 1:
            raise ValueError("depth must be None or >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_candidates, self.depth = max_candidates, depth

    def __repr__(self):
        return (f"NGramTreeDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, "
                f"max_candidates={self.max_candidates}, depth={self.depth})")

    def __call__(self, tokens, k: int):
        seq = tokens.tolist() if torch.is_tensor(tokens) else list(tokens)
        L = len(seq)
        depth = k if self.depth is None else min(k, self.depth)
        found, seen = [], set()
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = seq[L - n:]
            for start in range(L - n - 1, -1, -1):
                follow = start + n  # where the continuation starts: shorter n-grams find it again
                if follow in seen or seq[start:follow] != tail:
                    continue
                seen.add(follow)
                found.append(seq[follow:follow + depth])
                if len(found) == self.max_candidates:
                    return _trie(found, k)
        return _trie(found, k)


class ModelDrafter:
    """Drafts from a (smaller) causal LM that shares the tokenizer; runs the draft model on the
    whole context each call (simple, not fast).

    k = 1: the draft model's greedy continuation, a chain of at most min(depth, max_nodes, budget)
    tokens. k > 1: a top-k tree (EAGLE-2 style): the root's k most likely children form the first
    level; at each next level every frontier node proposes its k most likely children, and the k
    candidates of highest cumulative log-probability (over the whole level) become the next
    frontier, for at most ``depth`` levels (None: until the budget is spent) and at most
    ``max_nodes`` nodes (None: the call's budget; the node count is never above the call's budget,
    so T stays within the cache's ``max_draft``). Returns (tokens, parents).

    dynamic=True: a tree grown best-first by path probability instead of k per level (EAGLE-2's
    dynamic tree): each node added to the tree offers its k most likely children, scored by its
    path log-probability (the parent's + log p(child)), and the candidate of highest score among
    all offered so far is added next, until the node budget (min(budget, max_nodes)) is spent;
    no node deeper than ``depth`` (None: the budget) is added. A path's score only falls with
    depth, so the nodes taken are the most probable ones of the top-k tree: the greedy chain
    while its path stays the most probable, with side branches where the draft model's top-1
    probability is low. One draft-model forward per node expanded (batch 1, the whole context).
    """

    def __init__(self, model, k: int = 1, depth: int | None = None, max_nodes: int | None = None,
                 dynamic: bool = False):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be None or >= 1, got {depth!r}")
        if max_nodes is not None and max_nodes < 1:
            raise ValueError(f"max_nodes must be None or >= 1, got {max_nodes!r}")
        self.model, self.k, self.depth, self.max_nodes = model, k, depth, max_nodes
        self.dynamic = bool(dynamic)
        self.drafts_trees = k > 1

    def __repr__(self):
        extra = ", dynamic=True" if self.dynamic else ""
        return (f"ModelDrafter({type(self.model).__name__}, k={self.k}, depth={self.depth}, "
                f"max_nodes={self.max_nodes}{extra})")

    def _next_logp(self, ids, path):
        """The draft model's next-token log-probabilities after the context ``ids`` [1, n] and
        ``path`` (token ids): float [vocab]."""
        x = torch.cat([ids, torch.tensor([path], dtype=ids.dtype, device=ids.device)], 1) if path else ids
        return self.model(input_ids=x, use_cache=False).logits[0, -1].float().log_softmax(-1)

    def _best_first(self, ids, nodes: int, levels: int):
        """The dynamic tree (class docstring): (tokens, parents) of at most ``nodes`` nodes, none
        deeper than ``levels``."""
        import heapq

        toks, parents, paths, depth = [], [], [], []
        heap, order = [], 0  # entries (-score, order, parent node, token): candidates offered so far

        def offer(node, score, path):
            nonlocal order
            logp = self._next_logp(ids, path)
            top = logp.topk(min(self.k, logp.shape[-1]))
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                heapq.heappush(heap, (-(score + v), order, node, t))
                order += 1  # ties: the earlier offer, and the likelier child, first

        offer(-1, 0.0, [])
        while heap and len(toks) < nodes:
            neg, _, parent, t = heapq.heappop(heap)
            d = 1 if parent < 0 else depth[parent] + 1
            node = len(toks)
            toks.append(t)
            parents.append(parent)
            paths.append(([] if parent < 0 else paths[parent]) + [t])
            depth.append(d)
            if d < levels and len(toks) < nodes:
                offer(node, -neg, paths[node])
        return toks, parents
    @torch.no_grad()
    def __call__(self, tokens, budget: int):
        nodes = budget if self.max_nodes is None else min(budget, self.max_nodes)
        levels = nodes if self.depth is None else min(self.depth, nodes)
        if levels <= 0:
            return []
        ids = tokens.reshape(1, -1).to(self.model.device)
        if self.dynamic:
            return self._best_first(ids, nodes, levels)
        if self.k == 1:
            out = self.model.generate(ids, max_new_tokens=levels, do_sample=False, num_beams=1,
                                      attention_mask=torch.ones_like(ids), pad_token_id=0)
            return out[0, ids.shape[1]:].tolist()
        toks, parents = [], []
        frontier = [(-1, 0.0, [])]  # (node, cumulative log-probability, its root path's tokens)
        for _ in range(levels):
            room = nodes - len(toks)
            if room <= 0 or not frontier:
                break
            batch = torch.cat([ids.expand(len(frontier), -1),
                               torch.tensor([p for _, _, p in frontier], dtype=ids.dtype,
                                            device=ids.device).reshape(len(frontier), -1)], 1)
            logp = self.model(input_ids=batch, use_cache=False).logits[:, -1].float().log_softmax(-1)
            top = logp.topk(min(self.k, logp.shape[-1]), -1)
            cands = [(score + float(v), node, int(t), path)
                     for (node, score, path), vals, idx in zip(frontier, top.values, top.indices)
                     for v, t in zip(vals.tolist(), idx.tolist())]
            cands.sort(key=lambda c: -c[0])  # stable: ties keep the frontier's order
            frontier = []
            for score, node, t, path in cands[:min(self.k, room)]:
                frontier.append((len(toks), score, path + [t]))
                toks.append(t)
                parents.append(node)
        return toks, parents


def _name(drafter) -> str:
    return getattr(drafter, "__name__", None) or repr(drafter)


def _is_seq(x) -> bool:
    return (torch.is_tensor(x) and x.dim() == 1) or isinstance(x, (list, tuple))


def _as_tree(out, name: str):
    """One row's drafts as (tokens, parents) lists: a chain (a sequence of ids, parents s - 1) or
    a tree (a pair of equal-length sequences, -1 <= parents[i] < i)."""
    if isinstance(out, tuple) and len(out) == 2 and _is_seq(out[0]) and _is_seq(out[1]):
        toks = [int(t) for t in (out[0].tolist() if torch.is_tensor(out[0]) else out[0])]
        parents = [int(p) for p in (out[1].tolist() if torch.is_tensor(out[1]) else out[1])]
        if len(toks) != len(parents):
            raise ValueError(f"drafter {name} returned {len(toks)} tokens but {len(parents)} parents")
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"drafter {name}: parents[{i}] = {p} must be in [-1, {i}) "
                                 "(a node follows an earlier node or the last committed token)")
        return toks, parents
    toks = [int(t) for t in (out.tolist() if torch.is_tensor(out) else out)]
    return toks, list(range(-1, len(toks) - 1))


def _prune(toks, parents, max_nodes: int, max_depth: int):
    """Keep the nodes of depth <= max_depth whose parent is kept, the first max_nodes of them,
    renumbered (parents stay earlier than their children)."""
    new_index, depth, out_t, out_p = {-1: -1}, {-1: 0}, [], []
    for i, (t, p) in enumerate(zip(toks, parents)):
        if len(out_t) >= max_nodes:
            break
        if p not in new_index or depth[p] + 1 > max_depth:
            continue
        new_index[i], depth[i] = len(out_t), depth[p] + 1
        out_t.append(t)
        out_p.append(new_index[p])
    return out_t, out_p


@dataclass
class SpeculativeStats:
    """Counts over all rows. ``accepted_per_step`` has one entry per (verify step, row that had
    drafts): the drafts that row accepted; ``accepted_per_verify`` is their mean, the figure to
    compare drafters at an equal node budget (``num_draft``)."""

    new_tokens: int = 0           # tokens generated, all rows (each row's first comes from the prefill)
    steps: int = 0                # model forwards after the prefill (verify + plain decode)
    verify_steps: int = 0
    tree_steps: int = 0           # verify steps where some row's drafts were a tree, not a chain
    decode_steps: int = 0         # steps where no row had a draft
    drafted: int = 0              # draft tokens (tree nodes) proposed and verified
    accepted: int = 0             # draft tokens accepted
    accepted_per_step: list = field(default_factory=list)
    rows: int = 1
    row_new_tokens: list = field(default_factory=list)  # tokens generated per row

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_verify(self) -> float:
        """Drafts accepted per row per verify step (rows that drafted)."""
        return self.accepted / len(self.accepted_per_step) if self.accepted_per_step else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per row per model forward after the prefill."""
        return (self.new_tokens - self.rows) / (self.steps * self.rows) if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "verify_steps": self.verify_steps,
                "tree_steps": self.tree_steps, "decode_steps": self.decode_steps, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "accepted_per_verify": self.accepted_per_verify, "tokens_per_step": self.tokens_per_step,
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
        out.append((layer, crop))
    return out


def _reorder_tail(layers, order):
    """Permute each row's last T key/value positions of every KV layer: position j takes the one
    at order[b, j] (int64 [b, T]), so an accepted tree path lands first, in committed order."""
    T = order.shape[1]
    for layer, _ in layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is None or t.dim() != 4 or t.shape[-2] < T:
                continue  # a layer that never stored this step's keys
            idx = order.to(t.device)[:, None, :, None].expand(t.shape[0], t.shape[1], T, t.shape[3])
            t[:, :, -T:] = torch.gather(t[:, :, -T:], 2, idx)


def _tree_mask(past, allowed, dtype):
    """4D additive attention mask [b, 1, T, P + T]: 0 where a fed token may attend, the dtype's
    minimum elsewhere. past 0/1 [b, P] (the row's committed positions); allowed bool [b, T, T]
    (fed token s sees fed token a)."""
    b, T = allowed.shape[:2]
    see = torch.cat([past.bool()[:, None, :].expand(b, T, past.shape[1]), allowed], -1)
    out = torch.zeros(see.shape, dtype=dtype, device=see.device)
    return out.masked_fill(~see, torch.finfo(dtype).min)[:, None]


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
    left padding (None: no padding). drafter: "ngram", an ``NGramDrafter``, ``NGramTreeDrafter``,
    ``ModelDrafter`` or any callable (tokens [m], k) -> a chain of at most k ids or a tree
    (tokens, parents) (module docstring), called per unfinished row. num_draft: most draft tokens
    (tree nodes) per row per step (the patch needs max_draft >= num_draft + 1). eos_token_id: a
    row stops after it (int or list). pad_token_id: fills a row after it stopped.

    Returns (ids [b, n + new], SpeculativeStats), new = the most tokens any row generated; row r is
    the sequence greedy ``generate(input_ids, attention_mask=attention_mask, ...)`` returns for it.
    """
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError("input_ids must be a LongTensor [batch, n] with batch, n >= 1")
    if num_draft < 1:
        raise ValueError("num_draft must be >= 1")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if isinstance(drafter, str) and drafter == "ngram":
        drafter = NGramDrafter()
    elif not callable(drafter):
        raise ValueError(f"drafter must be 'ngram' or a callable, got {drafter!r}")
    name = _name(drafter)
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
        kv_layers = _attention_layers(hf_cache)
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
            trees = [([], []) for _ in range(b)]
            for r in range(b):
                k = min(num_draft, max_new_tokens - len(generated[r]) - 1)
                if not done[r] and k > 0:
                    out = drafter(torch.tensor(context[r], device=device), k)
                    trees[r] = _prune(*_as_tree(out, name), k, k)
            sizes = [len(t) for t, _ in trees]
            T = 1 + max(sizes)
            chain = all(p == list(range(-1, len(p) - 1)) for _, p in trees)
            last = [context[r][-1] for r in range(b)]
            feed = torch.tensor([[last[r]] + trees[r][0] + [last[r]] * (T - 1 - sizes[r]) for r in range(b)],
                                device=device)
            # fed token 0 is the root (the last committed token, parent -1: the caches' last
            # committed one); draft node i is fed token 1 + i. Padding continues a chain, or
            # hangs off the root of a tree, where no real node sees it.
            parents = [[-1] + [p + 1 for p in trees[r][1]]
                       + (list(range(sizes[r], T - 1)) if chain else [0] * (T - 1 - sizes[r])) for r in range(b)]
            depth = [[0] * T for _ in range(b)]
            for r in range(b):
                for s in range(1, T):
                    depth[r][s] = depth[r][parents[r][s]] + 1
            live = torch.tensor([not d for d in done], device=device)
            lens = torch.tensor(sizes, device=device)
            j = torch.arange(T, device=device)
            # a finished row's inputs and a row's draft padding are masked for every later step
            fed_valid = live[:, None] & (j[None, :] <= lens[:, None])
            cols = torch.cat([mask, fed_valid.long()], 1)
            pos = committed[:, None] + torch.tensor(depth, device=device)
            stats.steps += 1
            if T == 1:
                pred = forward(feed, cols, pos).argmax(-1).tolist()
                stats.decode_steps += 1
                keep = live.long()
                for r in range(b):
                    if not done[r]:
                        emit(r, [pred[r][0]])
            else:
                tree = None
                if not chain:
                    tree = torch.tensor(parents, dtype=torch.int64, device=device)
                    if kv_layers:  # each fed token sees its ancestors and itself, never its siblings
                        from ..step import ancestors
                        cols = _tree_mask(mask, ancestors(tree) & fed_valid[:, None, :], model.dtype)
                    stats.tree_steps += 1
                with ctx.verifying(parents=tree):
                    pred = forward(feed, cols, pos).argmax(-1).tolist()
                stats.verify_steps += 1
                keep = torch.zeros(b, dtype=torch.long)
                paths = []
                for r in range(b):
                    path = [0]
                    paths.append(path)
                    if done[r]:
                        continue  # accepts nothing: its caches stay as they were
                    children = [[] for _ in range(T)]
                    for s in range(1, 1 + sizes[r]):
                        children[parents[r][s]].append(s)
                    new = []  # accepted drafts: walk to the child equal to the model's argmax
                    while True:
                        want = pred[r][path[-1]]
                        child = next((c for c in children[path[-1]] if int(feed[r, c]) == want), None)
                        if child is None:
                            break
                        path.append(child)
                        new.append(want)
                        if want in eos:
                            break
                    a = len(new)
                    if not (new and new[-1] in eos):
                        new.append(pred[r][path[-1]])  # the model's own next token after the accepted path
                    keep[r] = a + 1  # the fed token and the a accepted drafts enter the caches
                    if sizes[r]:
                        stats.drafted += sizes[r]
                        stats.accepted += a
                        stats.accepted_per_step.append(a)
                    emit(r, new)
                keep = keep.to(device)
                if chain:
                    ctx.accept(keep)
                else:
                    order = [p + [s for s in range(T) if s not in p] for p in paths]  # path first
                    path_t = torch.tensor(order, dtype=torch.int64, device=device)
                    ctx.accept(keep, path=path_t)
                    _reorder_tail(kv_layers, path_t)
            kept = j[None, :] < keep[:, None]  # [b, T]: positions that row committed
            mask = torch.cat([mask, kept.long()], 1)
            committed = committed + keep
            drop = T - int(keep.max())  # positions no row kept: cropped from the KV caches
            if drop > 0:
                for _, crop in kv_layers:
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
