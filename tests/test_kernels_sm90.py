"""The step kernels as built for an H100/H200 (sm_90a), compiled on this CPU machine by Triton and
the ptxas in its wheel (``benchmarks/ptxas_report.py``): what can be checked about the GPU code
without a GPU. Speed is measured on the GPU only (BENCHMARKS.md)."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS_REPORT = os.path.join(ROOT, "benchmarks", "ptxas_report.py")


def _compile_for_sm90(tmp_path, *args) -> str:
    """stdout of ``python args...`` with a real Triton compile (no interpreter), src on the path and
    a fresh Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _rows(stdout):
    return [line.split() for line in stdout.splitlines() if "_step_kernel" in line]


def test_step_kernels_assemble_without_spills_and_the_pin_saves_shuffles(tmp_path):
    """With the benchmarks' bf16 inputs, the default decode step kernels of every layer kind, refresh branch included, fit in registers
    (no spills), but for GDN's step launch over the slots due only (``launch.DUE_ONLY``: a sixteenth
    of a staggered step's programs, each refreshing its rows first), which may spill a few words
    (24 bytes on sm_90a; measured faster than a refresh launch of its own, ``launch.SHAPES``); GDN's
    pinned read-copy load (16 elements per thread) reduces its rows in fewer warp shuffles than the
    same kernel unpinned; nor do the verify step kernels of 4 drafts. Fails if a kernel spills or
    ignores PIN."""
    rows = _rows(_compile_for_sm90(tmp_path, PTXAS_REPORT, "--presets", "s32_rs"))
    assert {r[0] for r in rows} == {"mamba2", "gdn", "kda"}
    assert [r[3] for r in rows if r[0] == "gdn"] == ["_gdn_step_kernel:due", "_gdn_step_kernel"]
    for arch, preset, shape, kernel, regs, spills, stack, smem, sass, shfl in rows:
        stores, loads = (int(n) for n in spills.split("/"))
        allowed = 32 if kernel.endswith(":due") else 0
        assert 0 < int(regs) <= 255 and stores <= allowed and loads <= allowed, (arch, kernel, regs, spills)
        assert int(sass) > int(shfl) > 0, (arch, sass, shfl)  # the step kernels reduce across lanes
    # verify of 4 drafts: GDN's step kernel runs under a 168-register cap there (launch.SHAPES), so
    # what the program does last (the row's advance) must not need registers of its own. Mamba-2's,
    # with its refresh branch's fold pipelined over 2 column chunks at 255 registers, spills one word
    # with bf16 inputs (none with fp32 ones or a 1-stage fold; measured faster pipelined)
    verify = _rows(_compile_for_sm90(tmp_path, PTXAS_REPORT, "--presets", "s32_rs", "--draft", "4"))
    assert {r[0] for r in verify} == {"mamba2", "gdn", "kda"}
    for arch, preset, shape, kernel, regs, spills, *_ in verify:
        stores, loads = (int(n) for n in spills.split("/"))
        allowed = 4 if arch == "mamba2" else 0
        assert 0 < int(regs) <= 255 and stores <= allowed and loads <= allowed, (arch, kernel, regs, spills)
    unpinned = _rows(_compile_for_sm90(tmp_path, PTXAS_REPORT, "--arch", "gdn", "--presets", "s32_rs",
                                       "--tuning", "pin=0"))
    pinned = [r for r in rows if r[0] == "gdn"]
    assert int(pinned[-1][-1]) < int(unpinned[-1][-1]), (pinned, unpinned)  # the launch over the slots not due


PDL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import ptxas_report as pr
from replayssm._triton import launch

launch.FUSED_MAX_BATCH = 0  # the recorded two-slot steps take every launch of a larger batch
for arch in ("mamba2", "gdn", "kda"):
    for kernel, args, kw in pr.record_step(arch, "s32_rs"):
        for pdl in ((False, True) if kernel.fn.__name__.endswith("scores_kernel") else (True,)):
            code = pr.compile_sm90(kernel, args, dict(kw, PDL=pdl)).asm["ptx"]
            wait, load = code.find("griddepcontrol.wait"), code.find("ld.global")
            print(arch, kernel.fn.__name__, pdl, wait >= 0 and 0 <= load and wait < load, code.count("griddepcontrol"))
"""


def test_programmatic_launch_waits_before_any_memory_access(tmp_path):
    """With programmatic dependent launch (launch.programmatic; GPU only, so compiled here for
    sm_90 rather than run) a kernel may start before the previous launch of the step has
    finished: every kernel must wait for it before its first global load. Without it, no wait."""
    from replayssm._triton import launch

    assert not launch.programmatic(torch.arange(2))  # never on the CPU
    stdout = _compile_for_sm90(tmp_path, "-c", PDL_SCRIPT, os.path.join(ROOT, "benchmarks"))
    rows = [line.split() for line in stdout.splitlines()]
    assert len(rows) == 11, rows  # scores (twice) and step kernels of every architecture, GDN's and KDA's solve
    for arch, name, pdl, waits_first, count in rows:
        if pdl == "True":
            assert waits_first == "True" and count == "2", (arch, name)  # the wait and the go-ahead
        else:
            assert count == "0", (arch, name)


def test_nvfp4_step_kernels_of_several_row_blocks_assemble(tmp_path):
    """NVFP4 step programs of 64 rows own two global-scale blocks, each row reading its own
    (``formats.global_scale_index`` returns one index per row there, a scalar for one block): the
    kernels of both layer kinds, refresh branch included, compile for sm_90a at both shapes, with
    row reductions and with the read-copy products on tensor cores (``formats.streamed_products``),
    in one launch over every slot (GDN's decode puts the slots due beside the others by default),
    and fit in registers (GDN's 64-row programs with row reductions, a shape the policy does not
    take, at 255 registers and up to 32 bytes spilled in the refresh branch). Fails if the two forms
    of the index or the fp16 decode do not build."""
    for shape in ("32x4", "64x4", "64x4ok3"):
        rows = _rows(_compile_for_sm90(tmp_path, PTXAS_REPORT, "--arch", "mamba2,gdn", "--presets", "tp4_hi32",
                                       "--shapes", shape, "--tuning", "split=0", "--tuning", "beside=0"))
        assert {r[0] for r in rows} == {"mamba2", "gdn"}, rows
        for arch, preset, label, kernel, regs, spills, *_ in rows:
            stores, loads = (int(n) for n in spills.split("/"))
            allowed = 32 if (arch, shape) == ("gdn", "64x4") else 0
            assert label == shape[:4] and 0 < int(regs) <= 255 and stores <= allowed and loads <= allowed, \
                (arch, label, kernel, regs, spills)


def test_steps_of_one_launch_assemble_without_spills(tmp_path):
    """The smallest steps (``launch.FUSED_MAX_BATCH``), decode and verify of up to 4 drafts, are the
    step launch alone, whose programs prepare their inputs and solve their refresh themselves: both
    layer kinds fit in registers, or nearly, at the policy's 32 rows (GDN 2 warps, Mamba-2 4 at batch
    1, ``launch.FUSED_WIDE_WARPS``; GDN's keys' products taken 32 columns at a time,
    ``gdn.triton._gram``: a whole [16, 128] tile of keys spilled 0.5 KB). At 255 registers GDN's
    verify of 2 drafts may spill up to 32 bytes in its refresh branch, whose products take the keys
    as buffered (``formats.exact_b_products``; measured no slower: H100, batch 1, 16.9 against 17.2
    us per round with 3-pass tf32), its verify of 4 drafts 16 bytes (the keys' norms as tensor-core
    products, ``window._square_norm``, took the last registers) and its decode 20 (the refresh's
    chunks of keys all in flight at once, ``gdn.triton._gram``: measured faster, H100, batch 1, 6.9
    -> 5.9 us per step with the loads issued first; then every load before the cursor,
    ``window.fused_item``, 8 bytes more)."""
    allowances = {("gdn", "1"): 20, ("gdn", "2"): 32, ("gdn", "4"): 16}
    for draft in ("1", "2", "3", "4"):
        rows = [line.split() for line in _compile_for_sm90(
            tmp_path, PTXAS_REPORT, "--arch", "mamba2,gdn", "--presets", "s32_rs", "--batch", "1", "--draft",
            draft).splitlines()[1:]]
        assert [r[3] for r in rows] == ["_mamba2_step_kernel", "_gdn_step_kernel"], rows
        for arch, preset, shape, kernel, regs, spills, *_ in rows:
            stores, loads = (int(n) for n in spills.split("/"))
            allowed = allowances.get((arch, draft), 0)
            assert shape == ("32x4" if arch == "mamba2" else "32x2"), (arch, draft, shape)
            assert 0 < int(regs) <= 255 and stores <= allowed and loads <= allowed, (arch, draft, shape, regs, spills)


def _listing(path):
    """The SASS listing at ``path`` as (op, branch target, predicated) per instruction and ("label",
    name, False) per label, in order."""
    items = []
    for line in path.read_text().splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if label:
            items.append(("label", label.group(1), False))
        elif op:
            target = re.search(r"`\((\.L_x_\d+)\)", op.group(3))
            items.append((op.group(2), target.group(1) if target else None, op.group(1) is not None))
    return items


def _path_loads(items, i, end):
    """The global loads on the path from instruction ``i`` to ``end`` that follows fall-throughs and
    unconditional branches (not loops: the paths checked have none)."""
    loads = []
    while i < end:
        op, target, predicated = items[i]
        if op == "BRA" and not predicated:
            i = items.index(("label", target, False))
            continue
        if op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR")):
            loads.append(op)
        i += 1
    return loads


def test_steps_of_one_launch_issue_their_loads_before_their_cursor(tmp_path):
    """A decode step of one launch (batch 1 and 2) is a chain of round trips to memory: the slot id,
    then what its storage row locates. The step programs of both layer kinds issue their read copy,
    the whole window and the new tokens' inputs before the first branch, which waits for the
    committed count (the refresh's: ``window.fused_item``), and on the path that does not refresh
    no global load after it up to the advance (whose cursors every program loads before its count):
    a load the compiler places after a barrier (a tensor-core product's, or a layout conversion's)
    waits for every load before it. The code before issued the read copy after the branch, and 16
    (GDN) and 18 (Mamba-2) loads after a barrier."""
    listings = tmp_path / "sass"
    _compile_for_sm90(tmp_path, PTXAS_REPORT, "--arch", "mamba2,gdn", "--presets", "s32_rs", "--batch", "1",
                      "--draft", "1", "--sass", str(listings))
    for arch in ("mamba2", "gdn"):
        items = _listing(listings / f"{arch}_s32_rs_default_T1.sass")
        ops = [op for op, _, _ in items]
        tile = ops.index(next(op for op in ops if op.startswith("LDG.E.EF")))  # the read copy (evict-first)
        branch = ops.index("BRA")
        assert tile < branch and items[branch][2], (arch, tile, branch)
        atomic = ops.index(next(op for op in ops if op.startswith("ATOMG")))
        advance = max(i for i in range(atomic) if ops[i].startswith("BAR.SYNC"))  # the advance's barrier
        taken = _path_loads(items, items.index(("label", items[branch][1], False)), advance)
        fall = _path_loads(items, branch + 1, advance)
        assert [] in (taken, fall), (arch, taken, fall)  # one of them is the refresh's
