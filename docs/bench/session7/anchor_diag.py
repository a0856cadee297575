"""Where do the GDN anchors of s32_rs and tp16_hi32 part? Snapshot before and after the refreshing step."""
import torch, sys
from replayssm._triton import launch
from replayssm.bench import suite
from replayssm.bench.suite import Problem
dev = "cuda"
dims = suite.GEOMETRIES["qwen35-122b"][1]
batch, window = 8, 16
res = {}
for preset in ("s32_rs", "tp16_hi32", "tp4_hi32", "s32_rs"):
    gen = torch.Generator(device=dev).manual_seed(4)
    p = Problem("gdn", dims, batch, 1)
    prm = suite.make_params(p, dev, gen)
    cache = suite.make_cache(p, batch, preset, window, 4, dev)
    slots = torch.arange(batch, device=dev)
    cache.load_state(slots, torch.randn(batch, *cache.state_shape, device=dev, generator=gen) * 0.1)
    a0 = cache.anchor["values"][:batch].clone()
    launch.TUNING.update(launch.parse_shape(sys.argv[1]) if len(sys.argv) > 1 else {})
    for _ in range(window):
        suite.replay_call(p, cache, slots, suite.make_inputs(p, dev, gen), prm, False, "triton")
    a1 = cache.anchor["values"][:batch].clone()
    bufs = {k: v[:batch].clone() for k, v in cache.buffer.items()}
    inp = suite.make_inputs(p, dev, gen)
    # torch refresh of a copy, from the same pre-refresh state

    ref = torch.cat([cache.materialize(slots[i:i+1]) for i in range(batch)])
    suite.replay_call(p, cache, slots, inp, prm, False, "triton")
    launch.TUNING.clear()
    a2 = cache.anchor["values"][:batch].clone()
    res.setdefault(preset, []).append((a0, a1, bufs, a2, ref))
    print(preset, "load==after16", torch.equal(a0, a1), "refreshes", cache.refreshes[:batch].tolist(), flush=True)
s, t, f = res["s32_rs"][0], res["tp16_hi32"][0], res["tp4_hi32"][0]
s2 = res["s32_rs"][1]
def cmp(n, x, y):
    print(f"{n:28s}", "same" if torch.equal(x, y) else f"DIFFER {(x != y).sum().item()} max {(x.double()-y.double()).abs().max().item():.2e}")
for name, i in (("load", 0), ("after 16 steps", 1), ("after refresh", 3)):
    cmp("s32 vs tp16 anchor " + name, s[i], t[i]); cmp("s32 vs tp4 anchor " + name, s[i], f[i]); cmp("s32 vs s32 again " + name, s[i], s2[i])
for k in s[2]:
    cmp("s32 vs tp16 buffer " + k, s[2][k], t[2][k])
cmp("materialize s32 vs tp16", s[4], t[4])
rs_ = s[3].reshape(s[4].shape); rt = t[3].reshape(t[4].shape)
print("refresh vs materialize: s32 max", (rs_.double() - s[4].double()).abs().max().item(), "tp16", (rt.double() - t[4].double()).abs().max().item())
d = (s[3] != t[3]).reshape(batch, -1, dims[3], dims[2])  # [b, HV, V, K]
print("differing per slot", d.sum(dim=(1, 2, 3)).tolist())
print("differing per head (slot 0)", d[0].sum(dim=(1, 2)).tolist()[:16])
print("differing rows (slot 0, head 0)", d[0, 0].sum(1).tolist())
