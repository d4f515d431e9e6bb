"""Library kernels vs our torch paths, on the same weights and inputs.

For each mixer kind (mamba2, deltanet, and pdssm when its layer exists) this builds the layer at its default
(parameter-matched) size with fixed random weights, runs forward + backward through
  * the CUDA library-kernel path (mamba-ssm Triton / fla Triton / our pd_scan CUDA kernels),
  * the pure-torch path on the same GPU,
  * the pure-torch path on the CPU,
and prints relative errors of the output, the final state and every parameter gradient, plus
prefill-then-decode vs one full call, a bf16 kernel run against the float32 CPU reference, and fwd+bwd times.

    PYTHONPATH=$PWD python bench/mixers_cuda_vs_cpu.py [--width 1024 --batch 2 --lengths 512,48]

The errors, not the speed, are the point here: by default Triton autotuning stops at the leanest config that
runs (--full-autotune restores it), which keeps the first call to ~seconds per kernel instead of minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib
import json
import os
import sys
import time

import torch

from llm_surgery.layers.registry import MIXER_KINDS, build_mixer, default_options
from llm_surgery.triton_autotune import quick_autotune
from versions import versions


@contextlib.contextmanager
def path(kind: str, layer: torch.nn.Module, mode: str):
    """mode 'kernel' or 'torch' for the layer's scan. pdssm's torch mode also turns off the CUDA kernels of its
    ops (pd_scan, the straight-through sums), which all ask `ops.fast_path.cuda_fast_path`."""
    from llm_surgery.ops import fast_path
    old, ask = layer.backend, fast_path.cuda_fast_path
    layer.backend = mode
    if kind == "pdssm" and mode == "torch":
        fast_path.cuda_fast_path = lambda t, **needs: False
    try:
        yield
    finally:
        layer.backend, fast_path.cuda_fast_path = old, ask


def kernels_available(kind: str) -> bool:
    if kind == "mamba2":
        from llm_surgery.layers.mamba2 import mamba_kernels
        return mamba_kernels() is not None
    if kind == "deltanet":
        from llm_surgery.layers.deltanet import fla_kernels
        return fla_kernels() is not None
    from llm_surgery.layers.flash_pdssm_fused import usable
    return usable(torch.zeros(1, 1, device="cuda"))


def fwd_bwd(kind, layer, x, dy, mode):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with path(kind, layer, mode):
        y, (_, state) = layer(x, return_state=True)
        (y.float() * dy.float()).sum().backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in layer.named_parameters() if p.grad is not None}
    return {"y": y.detach().float().cpu(), "state": state.detach().cpu(), "grads": grads,
            "dx": x.grad.detach().float().cpu()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(a, b) -> dict:
    gerr = {n: rel(a["grads"][n], b["grads"][n]) for n in b["grads"]}
    worst = max(gerr, key=gerr.get)
    missing = sorted(set(b["grads"]) - set(a["grads"]))
    return {"y": rel(a["y"], b["y"]), "state": rel(a["state"], b["state"]), "dx": rel(a["dx"], b["dx"]),
            "grad_max": gerr[worst], "grad_worst": worst, "missing_grads": missing}


@torch.no_grad()
def decode_error(kind, layer, x, mode, steps=3) -> float:
    """Prefill L-steps tokens, then `steps` one-token calls, against one full call (same path)."""
    with path(kind, layer, mode):
        full = layer(x)
        L = x.shape[1]
        y, state = layer(x[:, :L - steps], return_state=True)
        outs = [y]
        for t in range(L - steps, L):
            y, state = layer(x[:, t:t + 1], state=state, return_state=True)
            outs.append(y)
    return rel(torch.cat(outs, 1).float(), full.float())


def cuda_time(fn, iters=5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_kind(kind, width, batch, L, seed=0) -> dict:
    torch.manual_seed(seed)
    layer = build_mixer(kind, width)
    n_params = sum(p.numel() for p in layer.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, L, width, generator=g)
    dy = torch.randn(batch, L, width, generator=g)
    cpu = fwd_bwd(kind, layer, x, dy, "torch")
    gpu_layer = copy.deepcopy(layer).cuda()
    xg, dyg = x.cuda(), dy.cuda()
    t0 = time.time()
    kern = fwd_bwd(kind, gpu_layer, xg, dyg, "kernel")
    first_call_s = time.time() - t0
    tgpu = fwd_bwd(kind, gpu_layer, xg, dyg, "torch")
    row = {"kind": kind, "width": width, "batch": batch, "L": L, "params": n_params,
           "options": default_options(kind, width), "first_kernel_call_s": round(first_call_s, 1),
           "kernel_vs_torch_gpu": compare(kern, tgpu), "torch_gpu_vs_cpu": compare(tgpu, cpu),
           "kernel_vs_cpu": compare(kern, cpu),
           "decode_vs_full_kernel": decode_error(kind, gpu_layer, xg, "kernel"),
           "decode_vs_full_torch_gpu": decode_error(kind, gpu_layer, xg, "torch")}
    bf16_layer = copy.deepcopy(gpu_layer).to(torch.bfloat16)
    try:
        row["kernel_bf16_vs_cpu_fp32"] = compare(fwd_bwd(kind, bf16_layer, xg.bfloat16(), dyg, "kernel"), cpu)
    except Exception as exc:  # noqa: BLE001
        row["kernel_bf16_vs_cpu_fp32"] = {"error": repr(exc)[:300]}
    for mode in ("kernel", "torch"):
        for name, lay, xin in (("fp32", gpu_layer, xg), ("bf16", bf16_layer, xg.bfloat16())):
            def step():
                with path(kind, lay, mode):
                    lay(xin).float().pow(2).mean().backward()
            try:
                row[f"ms_fwd_bwd_{mode}_{name}"] = round(cuda_time(step), 3)
            except Exception as exc:  # noqa: BLE001
                row[f"ms_fwd_bwd_{mode}_{name}"] = f"error {type(exc).__name__}"
    return row


def fmt(row: dict) -> str:
    kv, tc, kc, bf = (row["kernel_vs_torch_gpu"], row["torch_gpu_vs_cpu"], row["kernel_vs_cpu"],
                      row["kernel_bf16_vs_cpu_fp32"])
    bf_txt = f"{bf['y']:.1e} / {bf['grad_max']:.1e}" if "y" in bf else bf["error"][:60]
    return (f"| {row['kind']} | {row['L']} | {row['params'] / 1e6:.2f}M | {kv['y']:.1e} | {kv['state']:.1e} | "
            f"{kv['grad_max']:.1e} ({kv['grad_worst']}) | {tc['y']:.1e} / {tc['grad_max']:.1e} | "
            f"{kc['y']:.1e} | {bf_txt} | {row['decode_vs_full_kernel']:.1e} | "
            f"{row['decode_vs_full_torch_gpu']:.1e} | {row['ms_fwd_bwd_kernel_fp32']} / "
            f"{row['ms_fwd_bwd_torch_fp32']} | {row['ms_fwd_bwd_kernel_bf16']} / {row['ms_fwd_bwd_torch_bf16']} |")


HEADER = ("| kind | L | params | kernel vs torch (GPU): y | state | worst grad | torch GPU vs CPU: y / grad | "
          "kernel vs CPU: y | bf16 kernel vs fp32 CPU: y / grad | decode vs full (kernel) | (torch) | "
          "fwd+bwd ms fp32 kernel / torch | bf16 kernel / torch |\n" + "|---" * 14 + "|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lengths", default="512,48", help="comma-separated sequence lengths")
    ap.add_argument("--kinds", default=",".join(MIXER_KINDS))
    ap.add_argument("--budget-s", type=float, default=400, help="skip what is left after this many seconds")
    ap.add_argument("--full-autotune", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "mixers.json") if "OUT" in os.environ else None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    if not args.full_autotune:
        quick_autotune()
    start = time.time()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), **versions()}
    print(json.dumps(info), flush=True)
    rows, notes = [], []
    for kind in args.kinds.split(","):
        try:
            importlib.import_module("llm_surgery.layers.registry").mixer_class(kind)
        except ImportError as exc:
            notes.append(f"{kind}: layer not importable ({exc})")
            continue
        if not kernels_available(kind):
            notes.append(f"{kind}: no library kernels on this machine")
            continue
        for L in (int(v) for v in args.lengths.split(",")):
            if time.time() - start > args.budget_s:
                notes.append(f"{kind} L={L}: skipped (time budget)")
                continue
            try:
                row = bench_kind(kind, args.width, args.batch, L)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other kinds
                notes.append(f"{kind} L={L}: failed: {exc!r}"[:600])
                print(notes[-1], flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n" + HEADER)
    for row in rows:
        print(fmt(row))
    for note in notes:
        print("note:", note)
    print(f"total {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "notes": notes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
