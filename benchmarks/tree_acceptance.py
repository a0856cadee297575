"""Draft trees against draft chains of as many nodes, on the tiny trained byte-level models of
``models/`` (``tiny-mamba2-kjv``: Mamba-2; ``tiny-qwen35-kjv``: Gated DeltaNet + attention), with
``speculative_generate`` on the CPU (PyTorch backend, greedy).

    PYTHONPATH=src python benchmarks/tree_acceptance.py                 # writes docs/bench/trees.json

For each model and node budget (``--budgets``, the ``num_draft`` of every call), each drafter
generates ``--new`` tokens after each of ``--prompts`` prompts (``--prompt-len`` bytes of
``models/kjv_heldout.txt`` at evenly spaced offsets, one prompt per call, a batch of one) and its
output is compared with greedy ``generate``'s token ids. Drafters, as chain / tree pairs of one
node budget:

- ``NGramDrafter()`` against ``NGramTreeDrafter(depth=budget // 2)`` (up to 4 earlier matches of
  the trailing n-gram, each continuation at most budget // 2 tokens, merged into a trie, so that
  the budget is shared by at least two continuations) and against ``NGramTreeDrafter()`` (depth =
  the budget: the first match's continuation takes the whole budget when it is long enough, so the
  trie is mostly that one chain);
- ``ModelDrafter(other, k=1)`` (the other tiny model's greedy chain) against
  ``ModelDrafter(other, k=2)`` and ``ModelDrafter(other, k=3)`` (top-k trees of k nodes per level)
  and ``ModelDrafter(other, k=3, dynamic=True)`` (the tree grown best-first by the draft model's
  path probability, each node offering its 3 likeliest children, no depth cap but the budget).

Figures per (model, drafter, budget), summed over the prompts: tokens_per_step = (new tokens - 1
per prompt, which comes from the prefill) / model forwards after the prefill; accepted_per_verify
= drafts accepted / verify steps; verify, tree and decode steps; drafted and accepted nodes. JSON
(``--out``): {"command", "commit", "environment", "settings", "pairs", "rows", "runtime_s"}; a
table is printed. Exit code 1 if any output differs from greedy ``generate``'s.

Runtime: about 6 minutes on 2 CPU cores with the defaults (363 s measured), by load (one thread: the tensors are too small
for threads to help).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

import torch

from replayssm.integrations.speculative import ModelDrafter, NGramDrafter, NGramTreeDrafter, speculative_generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("tiny-mamba2-kjv", "tiny-qwen35-kjv")

#: label -> (kind, maker(budget, draft model)); labels name the drafter independently of the budget
DRAFTERS = {
    "NGramDrafter()": ("chain", lambda b, dm: NGramDrafter()),
    "NGramTreeDrafter(depth=budget//2)": ("tree", lambda b, dm: NGramTreeDrafter(depth=max(1, b // 2))),
    "NGramTreeDrafter()": ("tree", lambda b, dm: NGramTreeDrafter()),
    "ModelDrafter(k=1)": ("chain", lambda b, dm: ModelDrafter(dm, k=1)),
    "ModelDrafter(k=2)": ("tree", lambda b, dm: ModelDrafter(dm, k=2)),
    "ModelDrafter(k=3)": ("tree", lambda b, dm: ModelDrafter(dm, k=3)),
    "ModelDrafter(k=3, dynamic=True)": ("tree", lambda b, dm: ModelDrafter(dm, k=3, dynamic=True)),
}
#: (pair name, chain label, tree label)
PAIRS = [
    ("n-gram, trie of depth budget/2", "NGramDrafter()", "NGramTreeDrafter(depth=budget//2)"),
    ("n-gram, trie of full depth", "NGramDrafter()", "NGramTreeDrafter()"),
    ("draft model, top-2 tree", "ModelDrafter(k=1)", "ModelDrafter(k=2)"),
    ("draft model, top-3 tree", "ModelDrafter(k=1)", "ModelDrafter(k=3)"),
    ("draft model, dynamic tree", "ModelDrafter(k=1)", "ModelDrafter(k=3, dynamic=True)"),
]


def _commit():
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def load_models(names=MODELS):
    from transformers import AutoModelForCausalLM
    return {n: AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "models", n), dtype=torch.float32).eval()
            for n in names}


def prompts_of(text: bytes, count: int, length: int):
    """``count`` prompts of ``length`` bytes at evenly spaced offsets: (offsets, LongTensor [1, length] each)."""
    step = (len(text) - length) // max(1, count - 1) if count > 1 else 0
    offsets = [i * step for i in range(count)]
    return offsets, [torch.tensor([list(text[o:o + length])]) for o in offsets]


@torch.no_grad()
def greedy(model, ids, new):
    """Stock greedy ``generate``: LongTensor [1, n + new]."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          num_beams=1, pad_token_id=0)


def measure(model, drafter, prompts, refs, budget, new):
    """Sums of ``SpeculativeStats`` over the prompts, and whether every output equals its reference."""
    tot = dict(new_tokens=0, steps=0, verify_steps=0, tree_steps=0, decode_steps=0, drafted=0, accepted=0,
               verified_rows=0)
    identical, per_prompt = True, []
    for ids, ref in zip(prompts, refs):
        out, st = speculative_generate(model, ids, drafter=drafter, num_draft=budget, max_new_tokens=new,
                                       backend="torch")
        identical &= torch.equal(out, ref)
        for k in ("new_tokens", "steps", "verify_steps", "tree_steps", "decode_steps", "drafted", "accepted"):
            tot[k] += getattr(st, k)
        tot["verified_rows"] += len(st.accepted_per_step)
        per_prompt.append(round(st.tokens_per_step, 4))
    n = len(prompts)
    # each prompt's first token comes from the prefill, not from a step
    tot["tokens_per_step"] = (tot["new_tokens"] - n) / tot["steps"] if tot["steps"] else 0.0
    tot["accepted_per_verify"] = tot["accepted"] / tot["verified_rows"] if tot["verified_rows"] else 0.0
    tot["tokens_per_step_per_prompt"] = per_prompt
    tot["greedy_identical"] = bool(identical)
    return tot


def table(rep) -> str:
    rows = {(r["model"], r["budget"], r["drafter"]): r for r in rep["rows"]}
    lines = [f"{'model':16s} {'budget':>6s} {'pair':31s} {'tok/step chain':>14s} {'tree':>6s} "
             f"{'acc/verify chain':>16s} {'tree':>6s} {'steps chain':>11s} {'tree':>5s} identical"]
    for model in rep["settings"]["models"]:
        for b in rep["settings"]["budgets"]:
            for pair, c, t in PAIRS:
                rc, rt = rows.get((model, b, c)), rows.get((model, b, t))
                if rc is None or rt is None:
                    continue
                same = "yes" if rc["greedy_identical"] and rt["greedy_identical"] else "NO"
                lines.append(f"{model:16s} {b:6d} {pair:31s} {rc['tokens_per_step']:14.3f} {rt['tokens_per_step']:6.3f} "
                             f"{rc['accepted_per_verify']:16.3f} {rt['accepted_per_verify']:6.3f} "
                             f"{rc['steps']:11d} {rt['steps']:5d} {same}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="4,8", help="node budgets (num_draft), comma-separated")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per model")
    ap.add_argument("--prompt-len", type=int, default=128, help="bytes per prompt")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help="labels of DRAFTERS, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/bench/trees.json")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    names = [m for m in args.models.split(",") if m]
    labels = [d.strip() for d in re.split(r",(?![^()]*\))", args.drafters) if d.strip()]  # not inside (..)
    for d in labels:
        if d not in DRAFTERS:
            ap.error(f"unknown drafter {d!r}; known: {', '.join(DRAFTERS)}")
    torch.set_num_threads(args.threads)
    start = time.time()
    models = load_models(MODELS)  # both: each drafts for the other
    with open(os.path.join(ROOT, "models", "kjv_heldout.txt"), "rb") as f:
        text = f.read()
    offsets, prompts = prompts_of(text, args.prompts, args.prompt_len)
    rep = {"command": " ".join(["PYTHONPATH=src", "python", "benchmarks/tree_acceptance.py", *sys.argv[1:]]),
           "commit": os.environ.get("REPLAYSSM_COMMIT") or _commit(),
           "environment": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                           "python": platform.python_version(), "threads": args.threads, "backend": "torch"},
           "settings": {"models": names, "budgets": budgets, "new_tokens": args.new, "prompts": args.prompts,
                        "prompt_len": args.prompt_len, "prompt_offsets": offsets, "text": "models/kjv_heldout.txt",
                        "decoding": "greedy"},
           "pairs": [{"pair": p, "chain": c, "tree": t} for p, c, t in PAIRS if c in labels and t in labels],
           "rows": []}
    for name in names:
        model = models[name]
        draft_name = next(m for m in MODELS if m != name)
        refs = [greedy(model, ids, args.new) for ids in prompts]
        for b in budgets:
            for label in labels:
                kind, make = DRAFTERS[label]
                drafter = make(b, models[draft_name])
                t0 = time.time()
                r = measure(model, drafter, prompts, refs, b, args.new)
                r.update(model=name, budget=b, drafter=label, kind=kind, repr=repr(drafter),
                         draft_model=draft_name if label.startswith("ModelDrafter") else None,
                         prompts=len(prompts), seconds=round(time.time() - t0, 2))
                rep["rows"].append(r)
                print(f"{name} budget {b} {label}: {r['tokens_per_step']:.3f} tokens/step, "
                      f"{r['accepted_per_verify']:.3f} accepted/verify, identical={r['greedy_identical']} "
                      f"({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    rep["runtime_s"] = round(time.time() - start, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
        f.write("\n")
    print(table(rep))
    print(f"wrote {args.out} ({rep['runtime_s']:.0f} s)")
    return 0 if all(r["greedy_identical"] for r in rep["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
