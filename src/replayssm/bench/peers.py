"""Tables from a same-run comparison with the decode kernels of other projects.

The comparison harness times, in one process on one GPU and with the same shapes, CUDA graphs and
state pool, the conventional kernels serving engines run (vLLM's ``selective_state_update`` and
GDN packed decode, flash-linear-attention's ``fused_recurrent``), the ReplaySSM kernels of the
method's paper as vLLM carries them (bf16 operands in their folds, a bf16 residual cache: state
errors of 1.7e-3 to 2.6e-3 against float64), and this library through its public API. Its JSON
has one entry per timed configuration: ``kernel``, ``model``, ``B``, ``mode``, ``us_per_step``.
This module turns that JSON into markdown; ``replayssm.bench.report --peers`` puts it into
BENCHMARKS.md and the README.
"""
from __future__ import annotations

import json

#: Per layer kind: (title, conventional baseline, other conventional kernels, paper's kernel for
#: decode (staggered, aligned), ours decode prefix, conventional speculative, paper's speculative,
#: ours speculative prefix).
LAYERS = {
    "mamba2": ("Mamba-2", "vllm_selective_state_update", ("mamba_ssm_selective_state_update",),
               ("replayssm_m2_output_only", "decode L=16 desync", "decode L=16"), "rs_lib_m2_decode",
               "vllm_selective_state_update_spec", "replayssm_m2_spec(+commit)", "rs_lib_m2_spec"),
    "gdn": ("Gated DeltaNet", "vllm_packed_decode", ("fla_fused_recurrent_vfirst",),
            ("replayssm_gdn_decode", "decode L=16 desync", "decode L=16"), "rs_lib_gdn_decode",
            "vllm_sigmoid_gating_spec", "replayssm_gdn_spec(+commit)", "rs_lib_gdn_spec"),
}
NAMES = {"vllm_selective_state_update": "vLLM `selective_state_update`",
         "mamba_ssm_selective_state_update": "mamba_ssm `selective_state_update`",
         "vllm_packed_decode": "vLLM packed GDN decode", "fla_fused_recurrent_vfirst": "fla `fused_recurrent` (V-first)",
         "replayssm_m2_output_only": "paper's ReplaySSM kernel", "replayssm_gdn_decode": "paper's ReplaySSM kernel",
         "vllm_selective_state_update_spec": "vLLM, one state per draft",
         "vllm_sigmoid_gating_spec": "vLLM, one state per draft",
         "replayssm_m2_spec(+commit)": "paper's ReplaySSM kernel", "replayssm_gdn_spec(+commit)": "paper's ReplaySSM kernel"}


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _index(report: dict) -> dict:
    return {(r["kernel"], r["model"], r["mode"], r["B"]): r["us_per_step"] for r in report["results"]
            if r.get("us_per_step") is not None and r.get("finite", True)}


def step_bytes(row: dict) -> float | None:
    """Bytes a timed step moves by a traffic model: the conventional kernels read and write every
    state (one per draft for verify), the paper's kernels as the comparison harness models them,
    this library's from its storage formats (``suite.replay_bytes``: staggered windows, the
    accepted tokens' share of the slots refreshing); None where the row carries no sizes."""
    if row["kernel"].startswith(("rs_lib_m2_", "rs_lib_gdn_")) and "bytes_per_slot" in row:
        from .suite import replay_bytes

        spec = row["mode"].startswith("spec")
        T = int(row["mode"].split("T=")[1].split()[0]) if spec else 1
        accepted = int(row["mode"].split("acc=")[1].split()[0]) if spec else 1
        window = row.get("L") or 16
        return replay_bytes(row["bytes_per_slot"], row["B"], T, window, accepted / window)
    return row.get("rs_state_bytes") or row.get("conv_state_bytes_per_step")


def _models(report: dict, arch: str) -> list[str]:
    prefix = LAYERS[arch][4]
    return sorted({r["model"] for r in report["results"] if r["kernel"].startswith(prefix)})


def _batches(report: dict) -> list[int]:
    return sorted({r["B"] for r in report["results"]})


def _cell(us, base):
    if us is None:
        return "–"
    return f"{us:.1f}" if base is None else f"{us:.1f} · {base / us:.2f}×"


def _rows(report, arch, model, batches, spec_accept=None, ceiling=None):
    """Markdown rows [kernel, mode, cells...] of one model: decode, or speculative rounds of T = 4
    with ``spec_accept`` drafts accepted; × = the conventional baseline's time / this one's. With
    ``ceiling`` (the run's copy bandwidth, bytes/s) a last cell at the largest batch: MB per step
    (``step_bytes``) and their rate's share of the ceiling."""
    idx = _index(report)
    sized = {(r["kernel"], r["model"], r["mode"], r["B"]): step_bytes(r) for r in report["results"]}
    title, conv, others, (paper, paper_stag, paper_align), ours, conv_spec, paper_spec, ours_spec = LAYERS[arch]
    if spec_accept is None:
        base_key = (conv, "decode")
        entries = [(conv, "decode"), *((k, "decode") for k in others), (paper, paper_stag), (paper, paper_align)]
        ours_prefix, ours_modes = ours, ("decode L=16 stagger", "decode L=16 aligned")
    else:
        mode = f"spec T=4 acc={spec_accept}"
        base_key = (conv_spec, mode)
        entries = [(conv_spec, mode), (paper_spec, mode)]
        ours_prefix, ours_modes = ours_spec, (f"{mode} stagger", f"{mode} aligned")
    base = {B: idx.get((base_key[0], model, base_key[1], B)) for B in batches}
    presets = []  # in the order the run timed them
    for r in report["results"]:
        if r["kernel"].startswith(ours_prefix + "[") and r["model"] == model and r["kernel"] not in presets:
            presets.append(r["kernel"])
    rows = []
    for kernel, mode in entries + [(p, m) for p in presets for m in ours_modes]:
        cells = [idx.get((kernel, model, mode, B)) for B in batches]
        if all(c is None for c in cells):
            continue
        name = NAMES.get(kernel) or f"ReplaySSM `{kernel.split('[')[1].rstrip(']')}`"
        row = [name, _windows(kernel, mode), *(_cell(c, base[B]) for c, B in zip(cells, batches))]
        if ceiling:
            nbytes, us = sized.get((kernel, model, mode, batches[-1])), cells[-1]
            row.append("–" if nbytes is None or us is None else
                       f"{nbytes / 1e6:.0f} · {100 * nbytes / (us * 1e-6) / ceiling:.0f}%")
        rows.append(row)
    return rows


def _windows(kernel, mode) -> str:
    """How the slots' windows lie in a timed configuration: staggered (a share of the slots
    refreshes each step), aligned (all in the same step), or "–" for kernels without windows."""
    if "stagger" in mode or "desync" in mode:
        return "staggered"
    if "aligned" in mode or (mode.startswith("decode L=") and kernel.startswith("replayssm_")):
        return "aligned"
    return "–"


def _md(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratios(report: dict, arch: str, model: str, B: int, spec_accept=None) -> dict:
    """{preset: our time / the paper kernel's time} at batch B, staggered windows (< 1: ours faster)."""
    idx = _index(report)
    title, conv, others, (paper, paper_stag, _), ours, conv_spec, paper_spec, ours_spec = LAYERS[arch]
    if spec_accept is None:
        ref, prefix, mode = idx.get((paper, model, paper_stag, B)), ours, "decode L=16 stagger"
    else:
        m = f"spec T=4 acc={spec_accept}"
        ref, prefix, mode = idx.get((paper_spec, model, m, B)), ours_spec, f"{m} stagger"
    out = {}
    for (kernel, mdl, md, b), us in idx.items():
        if kernel.startswith(prefix + "[") and mdl == model and md == mode and b == B and ref:
            out[kernel.split("[")[1].rstrip("]")] = us / ref
    return out


def _largest(models: list) -> str:
    return max(models, key=lambda m: ("122b" in m or "super" in m, m))


def tables(report: dict) -> str:
    """Each layer kind's largest model at every batch of the report, staggered windows: decode, then
    verify of 4 drafts, all accepted (the JSON has the aligned windows, 2 accepted and other models)."""
    batches = _batches(report)
    env = report.get("env", {})
    copy = report.get("hbm", {}).get("d2d_copy_4GiB", {}).get("GBps")
    ceiling = copy * 1e9 if copy else None
    parts = []
    for arch in LAYERS:
        models = _models(report, arch)
        if not models:
            continue
        model, title = _largest(models), LAYERS[arch][0]
        head = ["kernel", "windows", *(f"B={B}: µs · ×" for B in batches)]
        head += [f"B={batches[-1]}: MB per step · % of copy ceiling"] if ceiling else []
        for acc in (None, 4):
            rows = [r for r in _rows(report, arch, model, batches, acc, ceiling) if r[1] != "aligned"]
            what = "decode" if acc is None else "verify of 4 drafts, all accepted (per round)"
            if rows:
                parts.append(f"### {title}, {model}: {what}\n\n" + _md(head, rows))
    note = ("µs per step (per round for verify) · × = the vLLM conventional kernel's time / this one's. "
            f"GPU: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, triton {env.get('triton', '?')}.")
    if copy:  # what a kernel that reads and writes every byte once can reach on this GPU
        note += (f" The GPU's copy ceiling in the same run: {copy / 1000:.2f} TB/s (a 4 GiB device-to-device copy)."
                 " MB per step: the bytes a step moves by a traffic model (the conventional kernels read and write"
                 " every state, one per draft for verify; the paper's kernels as the comparison harness models"
                 " them; ReplaySSM's from its storage formats: the read copy every step, the anchor read and"
                 " written by the refreshing share of the slots, the replay buffer at its average occupancy), and"
                 " their rate at the measured time as a share of the copy ceiling.")
    return "\n\n".join(parts) + "\n\n" + note + "\n"


def headline(report: dict, B: int = 256) -> str:
    """One table at batch B: per layer's largest model, decode and 4-of-4 verify, staggered windows."""
    rows = []
    for arch in LAYERS:
        models = _models(report, arch)
        if not models:
            continue
        model = _largest(models)
        for spec in (None, 4):
            for r in _rows(report, arch, model, [B], spec):
                if r[1] == "aligned":
                    continue
                rows.append([f"{LAYERS[arch][0]} ({model})", "decode" if spec is None else "verify T=4", r[0], r[2]])
    return _md(["layer", "step", "kernel", f"µs at batch {B} · × vLLM"], rows) + "\n"
