"""ReplaySSM with Hugging Face transformers: patch a model, generate, speculate, measure.

    pip install 'replayssm[hf]'
    python examples/hf_generate.py                      # the tiny KJV-trained models in models/
    python examples/hf_generate.py --quick              # without the teacher-forced tables
    python examples/hf_generate.py --model path/to/checkpoint --precision tp8_hi32

Any checkpoint of a supported family works (``replayssm.integrations.transformers.SUPPORTED_MODELS``:
Mamba-2, Nemotron-H, FalconH1, Bamba, GraniteMoeHybrid, Zamba2, Qwen3.5, Qwen3.5-MoE, Qwen3-Next).
Byte-level models (vocab 256, the ones in models/) take raw bytes; other models use their tokenizer.
On 2 CPU cores the tiny models take about 2 minutes with --quick; the teacher-forced tables (one
decode step per byte per preset) add about 7 minutes per model at the default --kl-tokens 512.
"""
from __future__ import annotations

import argparse
import os
import time

import sys

import torch

try:
    from transformers import AutoModelForCausalLM
except ImportError:
    sys.exit("this example needs transformers: pip install 'replayssm[hf]'")

import replayssm.integrations.transformers as rst
from replayssm import _progress
from replayssm.integrations.evalkl import eval_kl, format_table
from replayssm.integrations.speculative import NGramTreeDrafter, speculative_generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = ("And God said, Let there be light: and there was light.\n"
          "And God saw the light, that it was good: and God divided the light from the darkness.\n"
          "And God said, Let")
BATCH = ["And God said, Let there be a firmament in the midst of the waters, and let it divide",
         "In the beginning God created the heaven and the earth.\nAnd the earth was",
         "And the LORD said unto Moses,"]


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if model.config.vocab_size == 256:  # byte level
        return model, (lambda s: torch.tensor([list(s.encode())])), (lambda ids: bytes(ids).decode("ascii", "replace"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return model, (lambda s: tok(s, return_tensors="pt").input_ids), tok.decode


def left_padded(enc, texts, pad=0):
    """(ids [b, n], attention_mask [b, n]) of the texts, padded on the left."""
    rows = [enc(t)[0] for t in texts]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, n - len(r):], mask[i, n - len(r):] = r, 1
    return ids, mask


def main():
    ap = argparse.ArgumentParser(description="ReplaySSM inside transformers: generate, speculate, measure.")
    ap.add_argument("--model", action="append",
                    default=None, help="model folder (repeatable); default: the two in models/")
    ap.add_argument("--precision", default="s32_rs")
    ap.add_argument("--new-tokens", type=int, default=120, help="tokens to generate per prompt")
    ap.add_argument("--kl-tokens", type=int, default=512, help="held-out bytes of the teacher-forced tables")
    ap.add_argument("--quick", action="store_true", help="skip the teacher-forced tables")
    args = ap.parse_args()
    torch.set_num_threads(min(4, torch.get_num_threads()))
    paths = args.model or [os.path.join(ROOT, "models", n) for n in ("tiny-mamba2-kjv", "tiny-qwen35-kjv")]
    for path in paths:
        model, enc, dec = load(path)
        ids = enc(PROMPT)
        n = ids.shape[1]
        print(f"== {os.path.basename(path)} ({type(model).__name__})")
        kw = dict(max_new_tokens=args.new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0)

        t = time.time()
        stock = model.generate(ids, **kw)
        t_stock = time.time() - t

        # 1. one call: decode steps go through rs.mamba2_decode / rs.gdn_decode
        with rst.patch(model, precision=args.precision, window=16) as p:
            t = time.time()
            out = model.generate(ids, **kw)
            t_rs = time.time() - t
            refreshes = {i: int(c["refreshes"][0]) for i, c in p.counters().items()}
        print(f"stock     ({t_stock:.2f}s): {dec(stock[0, n:].tolist())!r}")
        print(f"replayssm ({t_rs:.2f}s): {dec(out[0, n:].tolist())!r}")
        print(f"same tokens as stock: {torch.equal(out, stock)}; refreshes per layer: {refreshes}")

        # 2. speculative decoding with prompt-lookup drafts; exact greedy output
        spec, st = speculative_generate(model, ids, drafter="ngram", num_draft=4,
                                        max_new_tokens=args.new_tokens, precision=args.precision)
        print(f"speculative == greedy: {torch.equal(spec, stock)}; acceptance {st.acceptance_rate:.2f}, "
              f"{st.tokens_per_step:.2f} tokens per step ({st.steps} steps)")
        # the same node budget as a tree: several earlier matches merged into a trie (tree verifies
        # run on the PyTorch backend for now)
        tspec, tst = speculative_generate(model, ids, drafter=NGramTreeDrafter(depth=2, max_candidates=3),
                                          num_draft=4, max_new_tokens=args.new_tokens, precision=args.precision,
                                          backend="torch")
        print(f"tree speculative == greedy: {torch.equal(tspec, stock)}; accepted per verify "
              f"{tst.accepted_per_verify:.2f} (chain {st.accepted_per_verify:.2f}), "
              f"{tst.tokens_per_step:.2f} tokens per step ({tst.steps} steps)")

        # 3. the same, batched: prompts of different lengths (left padding), rows accepting different
        # numbers of drafts per step; each row is what greedy generate gives it
        bids, bmask = left_padded(enc, BATCH)
        bkw = dict(max_new_tokens=args.new_tokens // 2, do_sample=False, attention_mask=bmask, pad_token_id=0)
        bstock = model.generate(bids, **bkw)
        bspec, bst = speculative_generate(model, bids, attention_mask=bmask, drafter="ngram", num_draft=4,
                                          max_new_tokens=args.new_tokens // 2, precision=args.precision)
        print(f"batched speculative (3 rows) == batched greedy: {torch.equal(bspec, bstock)}; acceptance "
              f"{bst.acceptance_rate:.2f}, {bst.tokens_per_step:.2f} tokens per row per step")

        # 4. teacher-forced agreement of the presets with the fp32 stock path
        held = os.path.join(ROOT, "models", "kjv_heldout.txt")
        if not args.quick and model.config.vocab_size == 256 and os.path.exists(held):
            with open(held, "rb") as f:
                text = torch.tensor([list(f.read()[:args.kl_tokens])])
            presets = ("s32_rs", "tp8_hi32", "tp4_hi16_sr", "f4_sr_rs")
            bar = _progress.bar((1 + len(presets)) * (text.shape[1] - 2), "teacher-forced KL", unit="tok")
            try:
                print(format_table(eval_kl(model, text, presets=presets, prefix=1, progress=bar)))
            finally:
                bar.close()
        print()


if __name__ == "__main__":
    main()
