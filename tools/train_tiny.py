"""Train the two tiny byte-level language models shipped in ``models/`` (CPU, a few minutes each).

- ``models/tiny-mamba2-kjv``: ``Mamba2ForCausalLM``, 4 Mamba-2 layers, d_model 128.
- ``models/tiny-qwen35-kjv``: ``Qwen3_5ForCausalLM``, a Qwen3.5-style hybrid: 3 Gated DeltaNet
  layers + 1 full-attention layer (pattern GDN, GDN, GDN, attention), d_model 128.

Vocabulary: the 256 byte values (no tokenizer needed: ids = list(text.encode())).

Text: the King James Version of the Bible (1611), public domain (its copyright has expired; see
Debian's ``/usr/share/doc/bible-kjv/copyright``), as shipped by the Debian package
``bible-kjv-text`` (4.38, Debian bookworm, main) and printed by the ``bible`` program of the
package ``bible-kjv``. ``--fetch-kjv`` does this (Debian/Ubuntu with apt):

    apt-get download bible-kjv-text bible-kjv
    dpkg -x bible-kjv-text_*.deb kjv && dpkg -x bible-kjv_*.deb kjv
    kjv/usr/bin/bible -p kjv/usr/lib "gen1:1-rev22:21" > kjv_raw.txt

The text is normalized (verse numbers dropped, one verse per line) and split by position: the
first 95 % trains, the last 5 % (from the later New Testament) is held out. A 4 KiB excerpt of
the held-out part is written to ``models/kjv_heldout.txt`` for ``evalkl``.

    python tools/train_tiny.py --fetch-kjv --minutes 4
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fetch_kjv(dest: str) -> str:
    """Extract the KJV text from the Debian packages (needs apt-get and dpkg)."""
    tmp = tempfile.mkdtemp()
    subprocess.run(["apt-get", "download", "bible-kjv-text", "bible-kjv"], cwd=tmp, check=True)
    for deb in glob.glob(os.path.join(tmp, "*.deb")):
        subprocess.run(["dpkg", "-x", deb, os.path.join(tmp, "kjv")], check=True)
    root = os.path.join(tmp, "kjv", "usr")
    raw = subprocess.run([os.path.join(root, "bin", "bible"), "-p", os.path.join(root, "lib"),
                          "gen1:1-rev22:21"], check=True, capture_output=True).stdout.decode("ascii")
    with open(dest, "w") as f:
        f.write(raw)
    return dest


def normalize(raw: str) -> str:
    """One verse per line, verse numbers dropped; chapter headings ("Genesis 1") kept."""
    verses, cur = [], []
    for line in raw.splitlines():
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            if cur:
                verses.append(" ".join(cur))
            cur = [m.group(1).strip()]
        elif line.strip() == "":
            continue
        elif cur and not re.match(r"^[1-3]?\s?[A-Z][a-z]+( of [A-Z][a-z]+)?( [A-Z][a-z]+)* \d+$", line.strip()):
            cur.append(line.strip())
        else:
            if cur:
                verses.append(" ".join(cur))
                cur = []
            verses.append(line.strip())
    if cur:
        verses.append(" ".join(cur))
    return "\n".join(verses) + "\n"


def split(data: bytes, held_out: float = 0.05):
    cut = int(len(data) * (1 - held_out))
    cut = data.index(b"\n", cut) + 1
    return data[:cut], data[cut:]


def build(kind: str):
    from transformers import (Mamba2Config, Mamba2ForCausalLM, Qwen3_5ForCausalLM,
                              Qwen3_5TextConfig)
    common = dict(vocab_size=256, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  tie_word_embeddings=True)
    if kind == "mamba2":
        cfg = Mamba2Config(hidden_size=128, num_hidden_layers=4, num_heads=8, head_dim=32, expand=2,
                           state_size=32, n_groups=1, conv_kernel=4, chunk_size=64, **common)
        return Mamba2ForCausalLM(cfg)
    cfg = Qwen3_5TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            layer_types=["linear_attention"] * 3 + ["full_attention"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                            linear_value_head_dim=32, linear_conv_kernel_dim=4,
                            max_position_embeddings=4096, **common)
    return Qwen3_5ForCausalLM(cfg)


def batches(data: torch.Tensor, seq: int, bs: int, gen: torch.Generator):
    while True:
        idx = torch.randint(0, data.numel() - seq - 1, (bs,), generator=gen)
        yield torch.stack([data[i:i + seq + 1] for i in idx.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, n: int = 8) -> float:
    model.eval()
    losses = []
    for k in range(n):
        start = k * (data.numel() - seq - 1) // n
        x = data[start:start + seq + 1][None]
        logits = model(input_ids=x[:, :-1]).logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits, x[0, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


def train(kind: str, train_data, val_data, minutes: float, out_dir: str, seed: int = 0, seq: int = 128,
          bs: int = 16, lr: float = 3e-3):
    torch.manual_seed(seed)
    model = build(kind)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    it = batches(train_data, seq, bs, gen)
    t0, step, log = time.time(), 0, []
    budget = minutes * 60
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for g in opt.param_groups:  # warm-up then cosine to 10 %
            g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        x = next(it)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            log.append((step, round(time.time() - t0, 1), round(loss.item(), 4)))
            print(kind, log[-1], flush=True)
    val = evaluate(model, val_data, 512)
    info = {"kind": kind, "params": nparams, "steps": step, "seconds": round(time.time() - t0, 1),
            "seq_len": seq, "batch": bs, "final_train_loss": log[-1][2] if log else None,
            "heldout_loss_nats_per_byte": val, "heldout_ppl_per_byte": math.exp(val),
            "heldout_bits_per_byte": val / math.log(2), "data": "KJV Bible (public domain), Debian bible-kjv-text 4.38"}
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=os.path.expanduser("~/.cache/replayssm/kjv_raw.txt"),
                    help="raw KJV text as printed by `bible` (created by --fetch-kjv)")
    ap.add_argument("--fetch-kjv", action="store_true")
    ap.add_argument("--models", default="mamba2,qwen35")
    ap.add_argument("--minutes", type=float, default=4.0, help="training time per model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "models"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fetch_kjv:
        os.makedirs(os.path.dirname(args.text), exist_ok=True)
        fetch_kjv(args.text)
    data = normalize(open(args.text).read()).encode("ascii")
    tr, ho = split(data)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kjv_heldout.txt"), "wb") as f:
        f.write(ho[:4096])
    print(f"text: {len(data)} bytes; train {len(tr)}, held out {len(ho)}")
    tr_t = torch.tensor(list(tr), dtype=torch.long)
    ho_t = torch.tensor(list(ho), dtype=torch.long)
    for kind in args.models.split(","):
        name = {"mamba2": "tiny-mamba2-kjv", "qwen35": "tiny-qwen35-kjv"}[kind]
        train(kind, tr_t, ho_t, args.minutes, os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
