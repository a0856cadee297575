"""Does the GDN read copy feed the anchor at a refresh? Same pre-refresh state, read copy perturbed."""
import sys, torch
from replayssm._triton import launch
from replayssm.bench import suite
from replayssm.bench.suite import Problem
dev = sys.argv[1]
dims = suite.GEOMETRIES["qwen35-122b"][1] if dev == "cuda" else (1, 2, 128, 128)
batch, window = 8 if dev == "cuda" else 2, 16
for arch_preset in sys.argv[3].split(","):
  for tuning in sys.argv[2].split(","):
    preset = arch_preset
    gen = torch.Generator(device=dev).manual_seed(4)
    p = Problem("gdn", dims, batch, 1)
    cache = suite.make_cache(p, batch, preset, window, 4, dev)
    slots = torch.arange(batch, device=dev)
    cache.load_state(slots, torch.randn(batch, *cache.state_shape, device=dev, generator=gen) * 0.1)
    launch.TUNING.clear(); launch.TUNING.update(launch.parse_shape(tuning) if tuning != "default" else {})
    for _ in range(window):
        suite.replay_call(p, cache, slots, suite.make_inputs(p, dev, gen), {}, False, "triton")
    snap = {k: v.clone() for k, v in cache.state_dict().items() if torch.is_tensor(v)}
    inp = suite.make_inputs(p, dev, gen)
    outs = []
    for mode in ("as is", "again", "read copy perturbed", "u perturbed"):
        for k, v in cache._tensors().items():
            v.copy_(snap[k])
        if mode == "read copy perturbed" and cache.read_copy is not None:
            rc = cache.read_copy["values"]
            rc.copy_((rc.float() * 1.01 + 0.001).to(rc.dtype)) if rc.is_floating_point() else rc.copy_(rc ^ 1)
        if mode == "u perturbed":
            cache.buffer["u"].mul_(1.01)
        suite.replay_call(p, cache, slots, inp, {}, False, "triton")
        outs.append((mode, cache.anchor["values"][:batch].clone().view(torch.int32)))
    launch.TUNING.clear()
    base = outs[0][1]
    print(preset, tuning, "; ".join(f"{m}: {'same' if torch.equal(base, a) else 'DIFFER %d' % (base != a).sum().item()}" for m, a in outs[1:]), flush=True)
