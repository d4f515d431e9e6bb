"""What one mixer layer keeps for its backward, per token (weights and input excluded), on the CPU.

    python bench/layer_saved_activations.py [--widths 256 1024] [--kinds pdssm mamba2 deltanet]

Autograd's saved tensors are counted once per storage through `saved_tensors_hooks`, in bf16 (the training
dtype). On the CPU Mamba2 and DeltaNet run their PyTorch paths, which save more than their GPU kernels do, so
compare pdssm with itself across changes; GPU peaks come from bench/layer_compare.py.
"""

from __future__ import annotations

import argparse

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--kinds", nargs="+", default=["pdssm"])
    args = ap.parse_args()
    print("| kind | width | saved for backward, KiB/token |\n|---|---|---|")
    for kind in args.kinds:
        for w in args.widths:
            print(f"| {kind} | {w} | {saved_bytes_per_token(kind, w) / 1024:.1f} |")


if __name__ == "__main__":
    main()
