"""One-off (its finding is in docs/bench/data/selector_tensor_cores_h100_2026-11-27.md): FlashPDSSM with the selector sum on tensor cores vs the gather kernel vs fla DeltaNet, same process"""
import sys
sys.path.insert(0, "bench")  # run from the repository root
import torch
import layer_compare as lc
from llm_surgery.ops.pd_select import triton_ste as ts

dot = ts._selector_dot
def dot16(*a):
    return dot(*a[:-2], dict(ts.SELECTOR_DOT_CONFIG, bf16=True), a[-1])
def gather(planes, P, B, H, L, N, K, strides, x0s, cplx, hx0, hm, bn, cfg, prec):
    return ts._selector(planes, P, B, H, L, N, K, strides, x0s, cplx, hx0, hm, bn, ts.SELECTOR_CONFIG)
width = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
opts = None
_, pd = lc.build("pdssm", width, opts)
_, dn = lc.build("fla-deltanet", width)
print(torch.cuda.get_device_name(), "width", width, "B=32")
print("| L | variant | fwd+bwd ms | fwd ms | peak GiB |\n|---|---|---|---|---|")
for L in (2048, 4096, 8192):
    for name, layer, fn in (("pdssm tensor-core selector (tf32)", pd, dot), ("pdssm gather selector", pd, gather),
                            ("fla deltanet", dn, dot), ("pdssm tensor-core selector (bf16)", pd, dot16),
                            ("pdssm tensor-core selector (tf32) again", pd, dot)):
        ts._selector_dot = fn
        x = torch.randn(32, L, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ms, fwd, peak = lc.measure(layer, x, 10, 3)
        print(f"| {L} | {name} | {ms:.2f} | {fwd:.2f} | {peak / 2**30:.2f} |", flush=True)
        del x
        for p in layer.parameters():
            p.grad = None
        torch.cuda.empty_cache()
ts._selector_dot = dot
