"""Teacher-forced quality of the precision presets on a transformers model.

A text is decoded token by token (teacher forcing: the next input is the text's token, not the
model's) through the stock fp32 path and through ReplaySSM with each preset; the per-position
next-token distributions are compared:

- ``mean_kl``: mean over positions of KL(stock || preset), in nats;
- ``p95_abs_dlogp``: 95th percentile over positions of |log p_stock(x_t) - log p_preset(x_t)|
  for the text's actual next token x_t;
- ``max_abs_dlogp``; ``ppl`` (perplexity of the preset on the text) and ``ppl_stock``.

The first ``prefix`` tokens are a prefill (the stock path, whose final state becomes the checkpoints); every
later position is a decode step, so refreshes happen every ``window`` tokens as in generation.

    replayssm eval-kl --model models/tiny-mamba2-kjv --text-file models/kjv_heldout.txt
"""
from __future__ import annotations

import math
import sys

import torch

from ..precision import REPRODUCTION_PRESETS as DEFAULT_PRESETS

__all__ = ["teacher_forced_logprobs", "eval_kl", "DEFAULT_PRESETS"]


@torch.no_grad()
def teacher_forced_logprobs(model, ids, prefix: int = 1, progress=None):
    """Log-probs [n - prefix, V] (fp32) of positions prefix .. n-1 given the text before them:
    one prefill of ``prefix`` tokens, then one decode step per token. ids: LongTensor [1, n].
    ``progress``: an object with ``update(n)``, told of every position."""
    from transformers import DynamicCache
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError("ids must be [1, n]")
    n = ids.shape[1]
    if not 1 <= prefix < n:
        raise ValueError(f"need 1 <= prefix < n, got prefix={prefix}, n={n}")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
    rows = [out.logits[0, -1].float().log_softmax(-1)]
    for t in range(prefix, n - 1):
        out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
        rows.append(out.logits[0, -1].float().log_softmax(-1))
        if progress is not None:
            progress.update(1)
    return torch.stack(rows)


def _summary(ref, lp, targets):
    kl = (ref.exp() * (ref - lp)).sum(-1).clamp(min=0)
    d = (ref.gather(-1, targets[:, None]) - lp.gather(-1, targets[:, None]))[:, 0].abs()
    nll = -lp.gather(-1, targets[:, None]).mean().item()
    return {"mean_kl": kl.mean().item(), "p95_abs_dlogp": torch.quantile(d, 0.95).item(),
            "max_abs_dlogp": d.max().item(), "ppl": math.exp(nll)}


def eval_kl(model, ids, presets=DEFAULT_PRESETS, prefix: int = 1, window: int = 16, seed: int = 0,
            buffer_dtype=None, progress=None) -> dict:
    """{preset: {mean_kl, p95_abs_dlogp, max_abs_dlogp, ppl, ppl_stock, positions}} for one text.

    ``model`` must not be patched (the stock reference runs first). ``ids`` LongTensor [1, n].
    ``progress`` is told of every decoded position ((1 + len(presets)) * (n - prefix - 1) in all).
    """
    from .transformers import patch  # lazy: the CLI can register eval-kl without transformers
    ref = teacher_forced_logprobs(model, ids, prefix, progress)
    targets = ids[0, prefix:].to(ref.device)
    ppl_stock = math.exp(-ref.gather(-1, targets[:, None]).mean().item())
    out = {}
    for name in presets:
        with patch(model, precision=name, window=window, seed=seed, buffer_dtype=buffer_dtype):
            lp = teacher_forced_logprobs(model, ids, prefix, progress)
        out[name] = {**_summary(ref, lp, targets), "ppl_stock": ppl_stock, "positions": int(targets.numel())}
    return out


def format_table(results: dict) -> str:
    lines = ["| preset | mean KL (nats) | p95 abs dlogp | max abs dlogp | ppl | ppl (stock fp32) |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| `{name}` | {r['mean_kl']:.3e} | {r['p95_abs_dlogp']:.3e} | {r['max_abs_dlogp']:.3e} "
                     f"| {r['ppl']:.3f} | {r['ppl_stock']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m replayssm.integrations.evalkl`` = ``replayssm eval-kl``."""
    from ..cli import main as cli_main
    return cli_main(["eval-kl", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
