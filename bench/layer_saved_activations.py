"""What one mixer layer keeps for its backward, per token (weights and input excluded), on the CPU.

    python bench/layer_saved_activations.py [--widths 256 1024] [--kinds pdssm mamba2 deltanet] [--peak]
    python bench/layer_saved_activations.py --norm     # the gated RMSNorm alone, one piece vs row slices

Autograd's saved tensors are counted once per storage through `saved_tensors_hooks`, in bf16 (the training
dtype). `--peak` also reports the peak of one forward+backward above the resting layer and input (Linux: the
process's peak resident memory, reset through /proc/self/clear_refs, in a fresh process per layer): that
includes the transient buffers of each backward op, which the saved-tensor count does not see. On the CPU
Mamba2 and DeltaNet run their PyTorch paths, which save more than their GPU kernels do, so compare pdssm with
itself across changes; GPU peaks come from bench/layer_compare.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from llm_surgery.layers.registry import build_mixer


def saved_bytes_per_token(kind: str, width: int, seq: int = 64) -> float:
    torch.manual_seed(0)
    layer = build_mixer(kind, width).to(torch.bfloat16)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(1, seq, width, dtype=torch.bfloat16, requires_grad=True)
    skip.add(x.untyped_storage().data_ptr())
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values()) / seq


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _in_fresh_process(call: str) -> float:
    """Evaluate `call` (an expression over this module, named m) in a new Python process and return its float:
    pages freed by earlier measurements must not count."""
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import layer_saved_activations as m; print({call})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _peak_above_rest_bytes(run) -> int:
    """Peak resident memory of run() above the resident memory before it (Linux: /proc/self/clear_refs resets
    the peak, VmHWM, to the current resident set)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rest = _rss_kib("VmRSS")
    run()
    return (_rss_kib("VmHWM") - rest) * 1024


def peak_bytes_per_token(kind: str, width: int, seq: int = 512, batch: int = 2) -> float:
    """Peak resident memory of one bf16 forward+backward above the resting state, per token (fresh process)."""
    return _in_fresh_process(f"m._peak_child({kind!r}, {width}, {seq}, {batch})")


def _peak_child(kind: str, width: int, seq: int, batch: int) -> float:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = build_mixer(kind, width).to(torch.bfloat16)
    x = torch.randn(batch, seq, width, dtype=torch.bfloat16, requires_grad=True)
    layer(x[:, :8]).float().square().mean().backward()  # warm-up: lazy buffers, allocator pools
    layer.zero_grad(set_to_none=False)
    x.grad = torch.zeros_like(x)
    return _peak_above_rest_bytes(lambda: layer(x).float().square().mean().backward()) / (batch * seq)


def norm_peak_gib(tokens: int, dim: int, slice_elements: int) -> float:
    """Peak above rest of GatedRMSNorm forward+backward alone ([tokens, dim] bf16 x and gate), in a fresh process,
    with the given row-slice size (1 << 62: one piece, the previous behaviour)."""
    return _in_fresh_process(f"m._norm_child({tokens}, {dim}, {slice_elements})")


def _norm_child(tokens: int, dim: int, slice_elements: int) -> float:
    from llm_surgery.layers.common import GatedRMSNorm, _GatedRMSNormFn
    torch.set_num_threads(1)
    _GatedRMSNormFn.ROW_SLICE_ELEMENTS = slice_elements
    norm = GatedRMSNorm(dim, group_size=dim).to(torch.bfloat16)
    x = torch.randn(tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, dim, dtype=torch.bfloat16)
    norm(x[:8], z[:8]).backward(g[:8])  # warm-up
    x.grad = torch.zeros_like(x)
    z.grad = torch.zeros_like(z)
    return _peak_above_rest_bytes(lambda: norm(x, z).backward(g)) / 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--kinds", nargs="+", default=["pdssm"])
    ap.add_argument("--peak", action="store_true", help="also the peak of forward+backward (Linux, fresh process)")
    ap.add_argument("--seq", type=int, default=512, help="--peak: tokens per sequence (batch 2)")
    ap.add_argument("--norm", action="store_true",
                    help="only the gated RMSNorm at the GPU benchmark's size (65,536 tokens, Mamba2's width 2048): "
                         "peak of forward+backward in one piece against row slices")
    args = ap.parse_args()
    if args.norm:
        from llm_surgery.layers.common import _GatedRMSNormFn
        print("| gated RMSNorm fwd+bwd, 65,536 x 2048 bf16 | peak above rest, GiB |\n|---|---|")
        for name, el in (("one piece", 1 << 62), ("row slices (default)", _GatedRMSNormFn.ROW_SLICE_ELEMENTS)):
            print(f"| {name} | {norm_peak_gib(65536, 2048, el):.2f} |", flush=True)
        return
    head = "| kind | width | saved for backward, KiB/token |" + (" fwd+bwd peak, KiB/token |" if args.peak else "")
    print(head + "\n|---|---|---|" + ("---|" if args.peak else ""))
    rows = []
    for kind in args.kinds:
        for w in args.widths:
            saved = saved_bytes_per_token(kind, w) / 1024
            peak = peak_bytes_per_token(kind, w, args.seq) / 1024 if args.peak else None
            rows.append(dict(kind=kind, width=w, saved_kib_per_token=saved, peak_kib_per_token=peak))
            print(f"| {kind} | {w} | {saved:.1f} |" + (f" {peak:.1f} |" if args.peak else ""), flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
