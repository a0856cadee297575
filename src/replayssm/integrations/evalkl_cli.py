"""The command line of ``replayssm eval-kl`` (``evalkl`` has the measurement). Defining the options
imports neither torch nor transformers."""
from __future__ import annotations

import argparse
import json
import os

from ..cli import UsageError, positive_int
from ..precision import PRESET_NAMES, REPRODUCTION_PRESETS


def _presets(text: str) -> list:
    items = list(PRESET_NAMES) if text == "all" else [x for x in text.split(",") if x]
    bad = [x for x in items if x not in PRESET_NAMES]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown preset {','.join(bad) or repr(text)}; "
                                         f"choose from {','.join(PRESET_NAMES)} or all")
    return items


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = ("Teacher-forced quality of the presets: decode a text token by token through the stock "
                      "fp32 path and through each preset; print mean KL(stock || preset), |d log p| of the "
                      "text's tokens and perplexities. Needs transformers (pip install 'replayssm[hf]'). "
                      "One decode step per token per preset: the defaults on the tiny models in models/ "
                      "take about 15 minutes on 2 CPU cores; --max-tokens 256 about 4.")
    ap.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    ap.add_argument("--model", required=True, help="a saved transformers model folder")
    ap.add_argument("--text-file", required=True, help="UTF-8 text; byte-level models read its bytes")
    ap.add_argument("--max-tokens", type=positive_int, default=1024, help="tokens of the text to score")
    ap.add_argument("--prefix", type=positive_int, default=1, help="tokens prefilled before the first decode")
    ap.add_argument("--window", type=positive_int, default=16, help="refresh window L")
    ap.add_argument("--presets", type=_presets, default=list(REPRODUCTION_PRESETS),
                    help=f"comma-separated presets or 'all' ({','.join(PRESET_NAMES)})")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.set_defaults(func=run)


def run(args) -> int:
    for name, path in (("--model", args.model), ("--text-file", args.text_file)):
        if not os.path.exists(path):
            raise UsageError(f"{name} {path}: no such file or folder")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("needs transformers: pip install 'replayssm[hf]'") from None
    import torch
    from transformers import AutoModelForCausalLM

    from .. import _progress
    from .evalkl import eval_kl, format_table

    torch.set_num_threads(min(4, torch.get_num_threads()))
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {args.model}: {str(exc).splitlines()[0]}") from None
    if model.config.vocab_size == 256:  # byte level
        with open(args.text_file, "rb") as f:
            ids = torch.tensor([list(f.read()[: args.max_tokens])], dtype=torch.long)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        with open(args.text_file) as f:
            ids = tok(f.read(), return_tensors="pt").input_ids[:, : args.max_tokens]
    if ids.shape[1] <= args.prefix + 1:
        raise UsageError(f"the text has {ids.shape[1]} tokens: need more than --prefix + 1 = {args.prefix + 1}")
    bar = _progress.bar((1 + len(args.presets)) * (ids.shape[1] - args.prefix - 1), "eval-kl", unit="tok")
    try:
        res = eval_kl(model, ids, presets=args.presets, prefix=args.prefix, window=args.window, progress=bar)
    finally:
        bar.close()
    print(json.dumps(res, indent=1) if args.json else format_table(res))
    return 0
