"""End-to-end decode of a transformers model, every step captured in a CUDA graph: tokens/s with the
stock state-space kernels against ReplaySSM, and the share of the step the state-space layers take.

    python3 benchmarks/e2e_decode.py --out e2e.json                 # GPU: both models, batch 1/32/256
    python3 benchmarks/e2e_decode.py --tiny --out e2e.json          # CPU: tiny models, a smoke run

Models (random weights, bf16 on the GPU; a slice of a few layers of each, built from the
transformers configs, vocabulary cut to ``--vocab`` so that the LM head does not outweigh a slice):

- ``nemotron-h``: ``NemotronHForCausalLM`` at the Nemotron-H 8B geometry (the transformers config
  defaults: d_model 4096, Mamba-2 128 heads x 64 x state 128 in 8 groups, which are also the
  Mamba-2 dims of Nemotron-3-Super; attention 32 heads / 8 KV heads of 128; dense ReLU^2 MLP of
  21504), 6 Mamba-2 layers, 6 MLP layers and one attention layer (Nemotron-H's ratio).
- ``qwen3.5``: ``Qwen3_5ForCausalLM`` at the transformers config defaults (d_model 4096, Gated
  DeltaNet 16 key heads / 32 value heads of 128, gated attention 16 heads / 4 KV heads of 256, MLP
  12288), 3 Gated DeltaNet layers and one attention layer (Qwen3.5's period).

Paths, each timed on the same model and prefill:

- ``stock``: transformers' own decode step (its torch fallbacks unless mamba_ssm / causal_conv1d /
  fla are installed; the JSON records which were importable);
- ``conv``: the same layer code with the recurrence replaced by the project's conventional Triton
  kernel (``replayssm.bench.conventional``: read the fp32 state, apply the token, write it back in
  one pass), the baseline the kernel tables use;
- ``s32_rs``, ``tp16_hi32``, ``tp8_hi32``: ``rs.patch`` with that preset (window ``--window``, bf16
  replay buffers), Triton backend.

Each step: embed, every layer, LM head, greedy argmax written back as the next input; a static
transformers cache (``StaticCache``, ``--context`` positions: attention reads all of them, masked).
``--steps`` consecutive steps (one window, so refreshes count once per window) are captured in one
CUDA graph that first resets the positions, then replayed; the figure is the median time per step.
The SSM share is 1 - t(no SSM) / t(path), where "no SSM" is the same graph with every state-space
mixer returning zeros (so it includes the mixers' projections and convolution). Before timing,
each path decodes ``--check-steps`` tokens (past one refresh) eagerly from the same prefill and
reports its largest logit difference from the stock path (a broken path shows as a large value).

``--tiny`` runs tiny fp32 models on the CPU without graphs (eager timing is meaningless there) and
also records every host synchronization of the decode steps (an op whose result the CPU waits
for, which a CUDA graph cannot hold); the CPU-only shortcuts of the PyTorch backend and the Triton
interpreter are not counted. JSON goes to ``--out``; a table is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

if "--tiny" in sys.argv:  # the conventional Triton kernel runs in Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

PRESETS = ("s32_rs", "tp16_hi32", "tp8_hi32")
PATHS = ("stock", "conv") + PRESETS
MIXERS = ("NemotronHMamba2Mixer", "Qwen3_5GatedDeltaNet")


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
def model_config(name: str, tiny: bool, vocab: int, chunk: int):
    """The transformers config of one benchmarked slice."""
    if name == "nemotron-h":
        from transformers import NemotronHConfig
        layers = ["linear_attention", "mlp"] * 3 + ["full_attention"] + ["linear_attention", "mlp"] * 3
        if tiny:
            return NemotronHConfig(vocab_size=vocab, hidden_size=32, layers_block_type=layers[:5] + ["full_attention"],
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                   mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                                   chunk_size=chunk)
        return NemotronHConfig(vocab_size=vocab, layers_block_type=layers, chunk_size=chunk)
    if name == "qwen3.5":
        from transformers import Qwen3_5TextConfig
        layers = ["linear_attention"] * 3 + ["full_attention"]
        if tiny:
            return Qwen3_5TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                     linear_value_head_dim=8, layer_types=layers)
        return Qwen3_5TextConfig(vocab_size=vocab, num_hidden_layers=4, layer_types=layers)
    raise ValueError(f"unknown model {name!r}; choose from nemotron-h, qwen3.5")


def build_model(name, tiny, vocab, chunk, device, dtype):
    from transformers import NemotronHForCausalLM, Qwen3_5ForCausalLM
    cfg = model_config(name, tiny, vocab, chunk)
    cls = NemotronHForCausalLM if name == "nemotron-h" else Qwen3_5ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    return model.to(dtype).eval()


def mixers(model):
    return [m for m in model.modules() if type(m).__name__ in MIXERS]


def describe(model) -> dict:
    c = model.config
    out = {"class": type(model).__name__, "layers": list(c.layer_types), "hidden": c.hidden_size,
           "vocab": c.vocab_size, "params": sum(p.numel() for p in model.parameters())}
    m = mixers(model)[0]
    if type(m).__name__ == "NemotronHMamba2Mixer":
        out["ssm"] = {"heads": m.num_heads, "head_dim": m.head_dim, "state": m.ssm_state_size, "groups": m.n_groups}
    else:
        out["ssm"] = {"k_heads": m.num_k_heads, "v_heads": m.num_v_heads, "k_dim": m.head_k_dim, "v_dim": m.head_v_dim}
    return out


# ---------------------------------------------------------------------------------------------
# the conventional-kernel path and the no-SSM variant
# ---------------------------------------------------------------------------------------------
def use_conventional(p, hf_cache):
    """Replace the recurrence of every adapter of patch ``p`` by the conventional kernel, on an fp32
    state copied from ``hf_cache`` (right after the prefill)."""
    from replayssm.bench.conventional import gdn_conventional, mamba2_conventional

    for ad in p.adapters:
        m = ad.module
        rec = hf_cache.get_recurrent_state(ad.layer_idx)
        if ad.kind == "mamba2":
            state = rec.float().contiguous()

            def core(slots, x, dt, A, B, C, z, verify, _m=m, _state=state):
                one = lambda t: None if t is None else t[:, None].contiguous()  # noqa: E731  [b, ...] -> [b, 1, ...]
                return mamba2_conventional(_state, slots, one(x), one(dt), A, one(B), one(C), _m.D.float(),
                                           _m.dt_bias.float(), one(z))[:, 0]
        else:
            state = rec.float().transpose(-1, -2).contiguous()  # transformers [.., K, V] -> [.., V, K]

            def core(slots, q, k, v, g, beta, verify, _state=state):
                K = q.shape[-1]
                return gdn_conventional(_state, slots, q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                        beta.contiguous(), K ** -0.5)
        ad.recurrence = core


def silence_mixers(model):
    """Every state-space mixer returns zeros: the step without its SSM layers. Returns an undo."""
    ms = mixers(model)
    for m in ms:
        m.forward = lambda hidden_states, *a, **k: torch.zeros_like(hidden_states)

    def undo():
        for m in ms:
            del m.forward
    return undo


# ---------------------------------------------------------------------------------------------
# host synchronizations (CPU check of graph safety)
# ---------------------------------------------------------------------------------------------
def sync_detector():
    """A dispatch mode recording ops whose result the host must wait for (``.item()``, ``bool()``,
    ``nonzero``, ...) and tensors built from Python data. CPU-only shortcuts are not counted: the
    PyTorch backend's refresh skip (``replayssm/step.py``, taken only on the CPU) and Triton's
    interpreter."""
    from torch.utils._python_dispatch import TorchDispatchMode
    aten = torch.ops.aten
    watched = {aten._local_scalar_dense, aten.nonzero, aten._unique2, aten.unique_consecutive,
               aten.masked_select, aten.lift_fresh, aten.equal, aten.is_nonzero}
    cpu_only = (os.path.join("replayssm", "step.py"), os.path.join("triton", "runtime"),
                os.path.join("triton", "language"))

    class Detector(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.hits = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in watched:
                frames = [f for f in traceback.extract_stack()[:-1] if "torch" + os.sep not in f.filename
                          or "_python_dispatch" not in f.filename]
                if not any(any(c in f.filename for c in cpu_only) for f in frames):
                    where = next((f"{f.filename}:{f.lineno}" for f in reversed(frames)
                                  if "torch" + os.sep + "utils" not in f.filename), "?")
                    self.hits.append(f"{func} at {where}")
            return func(*args, **(kwargs or {}))

    return Detector()


# ---------------------------------------------------------------------------------------------
# one timed configuration
# ---------------------------------------------------------------------------------------------
class Decoder:
    """A prefilled model with a static cache and the tensors a graph-captured step reads and writes."""

    def __init__(self, model, batch, prompt, context, device, vocab):
        from transformers import StaticCache
        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=context)
        g = torch.Generator(device="cpu").manual_seed(batch)
        ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
        self.pos = torch.arange(prompt, device=device).expand(batch, prompt).contiguous()
        with torch.no_grad():
            logits = model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=self.pos).logits
        self.tok = logits[:, -1:].argmax(-1)
        self.pos = torch.full((batch, 1), prompt, device=device, dtype=torch.long)
        self.pos0 = self.pos.clone()
        self.lengths = [layer.cumulative_length for layer in self.cache.layers if hasattr(layer, "cumulative_length")]
        self.len0 = [t.clone() for t in self.lengths]
        self.logits = None
        self.graph = None

    def rewind(self):
        """Back to the first decode position (positions and the KV caches' fill; the state-space
        layers go on from where they are)."""
        self.pos.copy_(self.pos0)
        for t, t0 in zip(self.lengths, self.len0):
            t.copy_(t0)

    def step(self):
        self.logits = self.model(input_ids=self.tok, cache=self.cache, use_cache=True, position_ids=self.pos).logits
        self.tok.copy_(self.logits[:, -1:].argmax(-1))
        self.pos.add_(1)

    def _capture(self, steps):
        """One CUDA graph of ``steps`` steps that starts by rewinding; returns its replay."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (Triton compiles, cuBLAS handles) outside the graph
            self.rewind()
            for _ in range(steps + 2):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.rewind()
            for _ in range(steps):
                self.step()
        for _ in range(3):
            self.graph.replay()
        torch.cuda.synchronize()
        return self.graph.replay

    @torch.no_grad()
    def time(self, steps, reps, graph, detect=False):
        """(median, spread) seconds per step over ``reps`` runs of ``steps`` steps, whether a graph
        ran them, why not (a capture error; the steps are then timed eagerly), host syncs seen."""
        hits, error = [], None

        def eager():
            self.rewind()
            for _ in range(steps):
                self.step()
        run = eager
        if graph:
            try:
                run = self._capture(steps)
            except Exception as exc:  # report it and time the same steps without a graph
                error, graph = f"{type(exc).__name__}: {exc}", False
                self.graph = None
                try:
                    torch.cuda.synchronize()
                except Exception:  # a failed capture may leave an error to collect; the eager run says more
                    pass
        if detect:
            det = sync_detector()
            with det:
                eager()
            hits = det.hits
        cuda = self.tok.device.type == "cuda"
        if cuda and not graph:
            eager()  # warm-up
        times = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3 / steps)
            else:
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) / steps)
        self.graph = None
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        return statistics.median(times), (q[2] - q[0]) / 2, graph, error, hits


def run_path(model, path, batch, args, device, ref_logits):
    """Prefill, check, time one path. Returns a result row."""
    import replayssm.integrations.transformers as rst

    graph = device == "cuda"
    patch = None
    if path in PRESETS or path == "conv":
        patch = rst.patch(model, precision=path if path in PRESETS else "s32_rs", window=args.window,
                          max_draft=1, buffer_dtype=torch.bfloat16 if graph else torch.float32,
                          backend="triton" if graph else "torch", check_values=False)
    undo = silence_mixers(model) if path == "no_ssm" else None
    try:
        dec = Decoder(model, batch, args.prompt, args.context, device, model.config.vocab_size)
        if path == "conv":
            use_conventional(patch, dec.cache)
        row = {"path": path, "batch": batch}
        with torch.no_grad():
            for _ in range(args.check_steps):  # eager decode from the prefill: agreement with stock
                dec.step()
        last = dec.logits[:, -1].float()
        if path == "stock":
            ref_logits[batch] = last
        elif path != "no_ssm" and batch in ref_logits:
            row["max_abs_dlogit_vs_stock"] = float((last - ref_logits[batch]).abs().max())
        med, spread, graphed, error, hits = dec.time(args.steps, args.reps, graph, detect=not graph)
        row.update(step_s=med, spread_s=spread, tokens_per_s=batch / med, graph=graphed)
        if error:
            row["graph_error"] = error
        if not graph:
            row["host_syncs"] = hits
        return row
    finally:
        if undo is not None:
            undo()
        if patch is not None:
            patch.unpatch()
        if graph:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def environment(device) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    for mod in ("mamba_ssm", "causal_conv1d", "fla"):
        try:
            __import__(mod)
            env[mod] = True
        except Exception:
            env[mod] = False
    env["commit"] = os.environ.get("REPLAYSSM_COMMIT")
    if not env["commit"]:
        try:
            env["commit"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                           cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
        except Exception:
            env["commit"] = None
    return env


def add_derived(rows):
    """Speed-ups against stock and conv, and the SSM share, per (model, batch)."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["batch"]), {})[r["path"]] = r
    for group in by.values():
        base = group.get("no_ssm")
        for r in group.values():
            if r["path"] == "no_ssm" or "step_s" not in r:
                continue
            for ref in ("stock", "conv"):
                if ref in group and "step_s" in group[ref]:
                    r[f"speedup_vs_{ref}"] = group[ref]["step_s"] / r["step_s"]
            if base is not None and "step_s" in base:
                r["ssm_share"] = max(0.0, 1.0 - base["step_s"] / r["step_s"])


def table(rows) -> str:
    lines = [f"{'model':11s} {'batch':>5s} {'path':10s} {'step ms':>9s} {'tokens/s':>10s} {'vs stock':>8s} "
             f"{'vs conv':>7s} {'SSM share':>9s} {'|dlogit|':>9s}"]
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"], PATHS.index(r["path"]) if r["path"] in PATHS else 9)):
        if "error" in r:
            lines.append(f"{r['model']:11s} {r['batch']:5d} {r['path']:10s} {r['error'][:90]}")
            continue
        f = lambda k, fmt: format(r[k], fmt) if k in r else "-"  # noqa: E731
        lines.append(f"{r['model']:11s} {r['batch']:5d} {r['path']:10s} {r['step_s'] * 1e3:9.3f} "
                     f"{r['tokens_per_s']:10.0f} {f('speedup_vs_stock', '8.2f')} {f('speedup_vs_conv', '7.2f')} "
                     f"{f('ssm_share', '9.2f')} {f('max_abs_dlogit_vs_stock', '9.1e')}"
                     + ("" if r.get("graph", True) or "host_syncs" in r else "  (no graph: see graph_error)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path of the JSON report")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 models on the CPU, no graphs (a smoke run)")
    ap.add_argument("--models", default="nemotron-h,qwen3.5")
    ap.add_argument("--batches", default=None, help="default 256,32,1 (tiny: 2,1)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--window", type=int, default=16, help="ReplaySSM window L")
    ap.add_argument("--steps", type=int, default=None, help="steps per graph (default: the window)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays (default 10; tiny 1)")
    ap.add_argument("--prompt", type=int, default=16, help="prefill tokens")
    ap.add_argument("--context", type=int, default=None, help="static KV cache positions (default 1024; tiny 64)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; tiny 99)")
    ap.add_argument("--check-steps", type=int, default=None,
                    help="eager steps compared with stock before timing (default: window + 4, past one refresh)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip what is left after this many seconds")
    args = ap.parse_args(argv)
    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    if not tiny and not torch.cuda.is_available():
        print("e2e_decode.py needs a CUDA GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    batches = [int(b) for b in (args.batches or ("2,1" if tiny else "256,32,1")).split(",")]
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            ap.error(f"unknown path {p!r}; choose from {', '.join(PATHS)}")
    args.steps = args.steps or args.window
    args.check_steps = args.window + 4 if args.check_steps is None else args.check_steps
    args.reps = args.reps or (1 if tiny else 10)
    args.context = args.context or (64 if tiny else 1024)
    args.vocab = args.vocab or (99 if tiny else 8192)
    if args.context < args.prompt + args.check_steps + args.steps + 2:
        ap.error("--context must hold the prompt, the check steps and one graph of steps")
    dtype = torch.float32 if tiny else torch.bfloat16
    if tiny:
        torch.set_num_threads(1)
    t0 = time.time()
    report = {"environment": environment(device), "args": vars(args), "models": {}, "rows": []}

    def save():
        add_derived(report["rows"])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    models = {}
    for name in args.models.split(","):
        models[name] = build_model(name, tiny, args.vocab, args.prompt, device, dtype)
        report["models"][name] = describe(models[name])
        print(f"== {name}: {report['models'][name]} [{time.time() - t0:.0f}s]", flush=True)
    # batches outermost: a run cut short by --budget-s still has the first batch of every model
    for batch in batches:
        for name, model in models.items():
            ref_logits = {}
            for path in ["stock"] + [p for p in paths if p != "stock"] + ["no_ssm"]:
                row = {"model": name, "batch": batch, "path": path}
                if time.time() - t0 > args.budget_s:
                    row["error"] = "skipped: over --budget-s"
                else:
                    try:
                        row.update(run_path(model, path, batch, args, device, ref_logits))
                        print(f"{name} b={batch} {path}: {row['step_s'] * 1e3:.3f} ms/step "
                              f"[{time.time() - t0:.0f}s]", flush=True)
                    except Exception as exc:  # report and go on: one broken path must not hide the others
                        row["error"] = f"FAILED {type(exc).__name__}: {exc}"
                        traceback.print_exc()
                report["rows"].append(row)
                save()
    save()
    print(table(report["rows"]))
    print(f"[{time.time() - t0:.0f}s] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
