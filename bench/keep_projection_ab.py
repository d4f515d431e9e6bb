"""one-off: FlashPDSSM with the x projection kept for the backward vs recomputed, same process (PYTHONPATH=. python bench/keep_projection_ab.py)"""
import sys
sys.path.insert(0, "bench")
import torch
import layer_compare as lc
from llm_surgery.layers.flash_pdssm_fused import _FusedMiddle

width = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
_, pd = lc.build("pdssm", width, None)
print(torch.cuda.get_device_name(), "width", width, "B=32")
print("| L | variant | fwd+bwd ms | fwd ms | peak GiB |\n|---|---|---|---|---|")
for L in (2048, 4096, 8192):
    for name, layer, keep in (("pdssm, projection kept", pd, True), ("pdssm, projection recomputed", pd, False),
                              ("pdssm, projection kept, again", pd, True),
                              ("pdssm, projection recomputed, again", pd, False)):
        _FusedMiddle.KEEP_PROJECTION = keep
        x = torch.randn(32, L, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ms, fwd, peak = lc.measure(layer, x, 10, 3)
        print(f"| {L} | {name} | {ms:.2f} | {fwd:.2f} | {peak / 2**30:.2f} |", flush=True)
        del x
        for p in layer.parameters():
            p.grad = None
        torch.cuda.empty_cache()
_FusedMiddle.KEEP_PROJECTION = True
