"""One mixer layer, side by side with the libraries' own layers, bf16, on one GPU: forward + backward time,
forward-only time, peak memory, and (--decode) one-token decode steps.

    PYTHONPATH=. python bench/layer_compare.py --width 1024 --batch 8 32 --lengths 1024 2048 4096 8192
    PYTHONPATH=. python bench/layer_compare.py --host granite-4.0-h-micro --batch 1 8 --lengths 2048   # its layers

Layers (--kinds; all built in bf16, train mode, parameter-matched through the libraries' own knobs):
  pdssm           this project's FlashPDSSM at its registry defaults (pdssm-ref: the same with `backend="torch"`;
                  pdssm-one: its middle as one kernel per (sequence, head) at every length, ops/pd_select/triton_middle.py)
  fla-deltanet    fla.layers.DeltaNet with key/value heads of 128 (expand_k = expand_v = heads * 128 / width), the
                  head count whose parameters come nearest the pdssm layer's (with --pdssm-options): at width 1024
                  14 heads, expand 1.75 (7.38M vs 7.48M)
  mamba2          mamba_ssm.modules.mamba2.Mamba2(d_state=128, headdim=64, expand=2) at its defaults (one B/C
                  group: 12% fewer parameters than the pdssm layer at width 1024, 24% at 2048): the fused training
                  path (mamba_split_conv1d_scan_combined) when causal-conv1d is importable, else
                  use_mem_eff_path=False (nn.Conv1d + the Triton chunk scan); the label says which
  lib-mamba2 / lib-deltanet   mamba-ssm's Mamba2 / fla's DeltaNet alone, at the shapes the registry gives the
                  project's kinds (`library_options()` of the mixer: the same layer the kind runs on CUDA).
                  lib-mamba2 is the parameter-matched Mamba2: the same module with as many B/C groups as bring its
                  count nearest the pdssm layer's (4 at width 1024: 7.39M vs 7.48M; 16 at 2048: 33.73M vs 33.84M)
  block-mamba2 / block-deltanet   the project's kinds `mamba2` / `deltanet` (layers/registry.py), which run those
                  library layers on their own parameters: compare with lib-*
Time: median of CUDA-event timings after warm-up (the first calls compile and run the Triton autotuners in full
unless --quick-autotune), with a sync after each call (every call starts on an idle GPU, so host time the GPU waits
for counts) or, --back-to-back, none between calls, as the issues' tables were taken. Peak: max_memory_allocated
during one step minus what was allocated before it (weights + input). One step: out = layer(x); out.backward(g)
with a fixed random g.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import platform
import sys
import types

import torch
from cuda_timing import median_ms
from versions import installed

from llm_surgery.hosts import HOST_CONFIGS


def import_mamba2():
    """mamba_ssm's Mamba2 module. mamba_ssm/__init__ imports the compiled Mamba-1 selective scan, which Mamba2 does
    not use; when that is not built, the package is registered bare and the submodule imported directly."""
    try:
        import mamba_ssm  # noqa: F401
    except ImportError:
        for k in [k for k in sys.modules if k == "mamba_ssm" or k.startswith("mamba_ssm.")]:
            del sys.modules[k]
        spec = importlib.util.find_spec("mamba_ssm")
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = pkg
    from mamba_ssm.modules import mamba2
    return mamba2


def deltanet(width: int, heads: int, device):
    """fla's DeltaNet with `heads` key/value heads of 128 (fla's models' head size)."""
    from fla.layers import DeltaNet
    expand = heads * 128 / width
    with device:
        layer = DeltaNet(hidden_size=width, num_heads=heads, expand_k=expand, expand_v=expand, mode="chunk")
    if (layer.key_dim, layer.value_dim) != (heads * 128, heads * 128):   # fla rounds width * expand down
        raise ValueError(f"DeltaNet at width {width}: {heads} heads of 128 not representable by expand {expand}")
    return layer


def deltanet_heads(width: int, pdssm_options: dict | None) -> int:
    """The DeltaNet head count whose parameter count is nearest the pdssm layer's (counted on the meta device)."""
    from llm_surgery.layers.registry import build_mixer

    def count(m):
        return sum(p.numel() for p in m.parameters())
    with torch.device("meta"):
        target = count(build_mixer("pdssm", width, **(pdssm_options or {})))
    meta = torch.device("meta")
    c1, c2 = count(deltanet(width, 1, meta)), count(deltanet(width, 2, meta))   # affine in the head count
    return max(1, round(1 + (target - c1) / (c2 - c1)))


def build(kind: str, width: int, pdssm_options: dict | None = None, dtype=torch.bfloat16):
    """(label, module) for one --kinds entry; pdssm_options: FlashPDSSM options over the registry's defaults."""
    torch.manual_seed(0)
    if kind in ("pdssm", "pdssm-ref", "pdssm-one"):
        from llm_surgery.layers.registry import build_mixer
        backend = "torch" if kind == "pdssm-ref" else "auto"
        layer = build_mixer("pdssm", width, backend=backend, **(pdssm_options or {}))
        label = "FlashPDSSM" + {"pdssm": "", "pdssm-ref": " (torch reference path)",
                                "pdssm-one": " (one kernel per sequence and head at every length)"}[kind]
        label += f" {json.dumps(pdssm_options)}" if pdssm_options else ""
    elif kind == "fla-deltanet":
        heads = deltanet_heads(width, pdssm_options)
        layer = deltanet(width, heads, torch.device("cpu"))
        label = f"fla DeltaNet(heads={heads}, expand {heads * 128 / width:.4g})"
    elif kind == "mamba2":
        m2 = import_mamba2()
        from mamba_ssm.ops.triton import ssd_combined
        fused = ssd_combined.causal_conv1d_fwd_function is not None
        layer = m2.Mamba2(d_model=width, d_state=128, headdim=64, expand=2, use_mem_eff_path=fused)
        label = ("mamba_ssm Mamba2 fused (causal-conv1d)" if fused
                 else "mamba_ssm Mamba2 unfused (no causal-conv1d: nn.Conv1d + Triton scan)")
    elif kind in ("lib-mamba2", "lib-deltanet"):
        from llm_surgery.layers.registry import build_mixer
        with torch.device("meta"):
            options = build_mixer(kind[4:], width).library_options()
        if kind == "lib-mamba2":
            m2 = import_mamba2()
            from mamba_ssm.ops.triton import ssd_combined
            fused = ssd_combined.causal_conv1d_fwd_function is not None
            layer = m2.Mamba2(**options, use_mem_eff_path=fused)
            label = f"mamba_ssm Mamba2 {'fused' if fused else 'unfused'} (ngroups={options['ngroups']})"
        else:
            from fla.layers import DeltaNet
            layer = DeltaNet(**options)
            label = (f"fla DeltaNet(heads={options['num_heads']}, expand_k={options['expand_k']:.4g}, "
                     f"gate={options['use_gate']})")
    elif kind.startswith("block-"):
        from llm_surgery.layers.registry import build_mixer
        layer = build_mixer(kind[6:], width, backend="kernel")
        label = f"project block {kind[6:]}"
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return label, layer.cuda().to(dtype).train()


@contextlib.contextmanager
def one_kernel(on: bool):
    """FlashPDSSM's middle as one kernel per (sequence, head) at every length, decode included (on), or its default
    (off)."""
    from llm_surgery.ops.pd_select import triton_middle
    saved = dict(triton_middle.CONFIG)
    if on:
        triton_middle.CONFIG.update(min_pairs_per_sm=4, decode=True)
    try:
        yield
    finally:
        triton_middle.CONFIG.update(saved)


def first(o):
    return o[0] if isinstance(o, (tuple, list)) else o


def step_and_forward(layer, x):
    """The two calls every bench times: one step (out = layer(x); out.backward(g), a fixed random g, gradients
    cleared first) and the forward alone."""
    g = torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=torch.Generator("cuda").manual_seed(1))

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        first(layer(x)).backward(g)

    def fwd():
        first(layer(x))

    return step, fwd


def measure(layer, x, iters: int, warmup: int, back_to_back: bool = False):
    """(fwd+bwd ms, forward ms, peak bytes above weights + input); back_to_back: `median_ms`'s."""
    step, fwd = step_and_forward(layer, x)
    for _ in range(warmup):
        step()
    step()
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return (median_ms(step, iters, warmup=1, back_to_back=back_to_back),
            median_ms(fwd, iters, warmup=1, back_to_back=back_to_back), peak)


def decode_ms(kind: str, layer, batch: int, width: int, iters: int, dtype=torch.bfloat16):
    """One token for a batch, from a state after an 8-token prefill, through the layer's own cached path."""
    x = torch.randn(batch, 8, width, device="cuda", dtype=dtype)
    tok = torch.randn(batch, width, device="cuda", dtype=dtype)
    with torch.no_grad():
        if kind.startswith("pdssm"):
            layer.eval()
            _, state = layer(x, return_state=True)
            return median_ms(lambda: layer.step(tok, state), iters, warmup=3)
        if kind.startswith("block-"):  # as the surgery's generation cache runs it: the state updated in place
            layer.eval()
            _, state = layer(x, return_state=True)
            t1 = tok.unsqueeze(1)
            return median_ms(lambda: layer(t1, state=state, return_state=True, inplace=True), iters, warmup=3)
        if kind in ("fla-deltanet", "lib-deltanet"):
            from fla.models.utils import Cache
            layer.eval()
            layer.layer_idx = 0
            cache = Cache()
            layer(x, past_key_values=cache, use_cache=True)
            t1 = tok.unsqueeze(1)

            def one():  # the cache grows nothing for DeltaNet: each call overwrites the layer's states
                layer(t1, past_key_values=cache, use_cache=True)
            return median_ms(one, iters, warmup=3)
        if kind in ("mamba2", "lib-mamba2"):
            layer.eval()
            conv, ssm = layer.allocate_inference_cache(batch, 1, dtype=dtype)
            return median_ms(lambda: layer.step(tok.unsqueeze(1), conv, ssm), iters, warmup=3)
    return float("nan")


def profile(kind, args) -> None:
    """Where one fwd+bwd (--profile-forward: one forward) of a layer spends its GPU time (the first batch and length
    given)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    label, layer = build(kind, args.width, args.pdssm_options, args.dtype)
    B, L = args.batch[0], args.lengths[0]
    x = torch.randn(B, L, args.width, device="cuda", dtype=args.dtype, requires_grad=True)
    with one_kernel(kind == "pdssm-one"):
        ms, fwd, peak = measure(layer, x, args.iters, args.warmup)
    print(f"{label}: B={B} L={L} width={args.width}: fwd+bwd {ms:.2f} ms, forward {fwd:.2f} ms, "
          f"peak {peak / 2**30:.2f} GiB")
    g = torch.randn_like(x)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, one_kernel(kind == "pdssm-one"):
        for _ in range(3):
            out = first(layer(x))
            if not args.profile_forward:
                out.backward(g)
            del out
        torch.cuda.synchronize()
    print(f"(3 {'forwards' if args.profile_forward else 'steps'}; divide by 3 for one)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--host", choices=sorted(HOST_CONFIGS), default=None,
                    help="take the width from this host's configuration (llm_surgery.hosts): the layers the surgery "
                         "inserts into it")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--kinds", nargs="+", default=["pdssm", "fla-deltanet", "mamba2"])
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the layers' and inputs' dtype (a recipe launched without mixed precision trains float32 layers)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--decode", type=int, default=0, help="batch of the one-token decode timing (0: none)")
    ap.add_argument("--decode-only", action="store_true", help="only the decode timing, no forward/backward table")
    ap.add_argument("--quick-autotune", action="store_true",
                    help="Triton autotuners keep their leanest working config (saves minutes; untuned timings)")
    ap.add_argument("--pdssm-slice-mib", type=int, default=0,
                    help="batch-slice budget of the fused Flash PD-SSM op in MiB (0: its default)")
    ap.add_argument("--pdssm-options", type=json.loads, default=None,
                    help='FlashPDSSM options over the registry defaults, a JSON object, e.g. \'{"dict_size": 32}\'')
    ap.add_argument("--profile", default="", help="kind: print torch.profiler's top CUDA ops of one fwd+bwd and exit")
    ap.add_argument("--profile-forward", action="store_true", help="with --profile: the forward alone")
    ap.add_argument("--json", default="", help="append one JSON line per measurement to this file")
    ap.add_argument("--back-to-back", action="store_true",
                    help="no sync between timed calls, as the issues' tables were taken (bench_layers.py): a layer "
                         "whose host work per call is shorter than its GPU work is timed by its GPU work")
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.host:
        args.width = HOST_CONFIGS[args.host]["hidden_size"]
    if args.pdssm_slice_mib:
        from llm_surgery.layers.flash_pdssm_fused import _FusedMiddle
        _FusedMiddle.SLICE_BYTES = args.pdssm_slice_mib << 20
    if args.quick_autotune:
        from llm_surgery.triton_autotune import quick_autotune
        quick_autotune()
    if args.profile:
        profile(args.profile, args)
        return
    import triton
    if args.host:
        print(f"# {args.host}'s inserted layers: width {args.width}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, triton "
          f"{triton.__version__}, python {platform.python_version()}, flash-linear-attention "
          f"{installed('flash-linear-attention')}, fla-core {installed('fla-core')}, mamba_ssm "
          f"{installed('mamba-ssm')}, "
          f"causal-conv1d {'importable' if importlib.util.find_spec('causal_conv1d_cuda') else 'absent'}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, Triton autotuning "
          f"{'cut to the leanest config that runs' if args.quick_autotune else 'full'}, timed "
          f"{'back to back (no sync between calls)' if args.back_to_back else 'with a sync after each call'}, "
          f"{str(args.dtype)[6:]} layers")
    layers = {}
    for kind in args.kinds:
        try:
            layers[kind] = build(kind, args.width, args.pdssm_options, args.dtype)
        except Exception as e:  # report, keep measuring the others
            print(f"{kind}: could not build ({type(e).__name__}: {e})")
    print("\n| kind | layer | params |\n|---|---|---|")
    for kind, (label, layer) in layers.items():
        print(f"| {kind} | {label} | {sum(p.numel() for p in layer.parameters()) / 1e6:.2f} M |")
    print("\nms = forward + backward (forward alone), GiB = peak above weights + input\n")
    print("| B | L | " + " | ".join(f"{k} ms | {k} GiB" for k in layers) + " |")
    print("|---|---|" + "---|---|" * len(layers), flush=True)
    for B in [] if args.decode_only else args.batch:
        for L in args.lengths:
            row = [str(B), str(L)]
            for kind, (label, layer) in layers.items():
                x = torch.randn(B, L, args.width, device="cuda", dtype=args.dtype, requires_grad=True)
                try:
                    with one_kernel(kind == "pdssm-one"):
                        ms, fwd, peak = measure(layer, x, args.iters, args.warmup, args.back_to_back)
                    row += [f"{ms:.2f} ({fwd:.2f})", f"{peak / 2**30:.2f}"]
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps({"kind": kind, "layer": label, "B": B, "L": L, "width": args.width,
                                                "fwd_bwd_ms": ms, "fwd_ms": fwd, "peak_GiB": peak / 2**30}) + "\n")
                except Exception as e:
                    row += [f"error: {type(e).__name__}", "-"]
                    print(f"{kind} B={B} L={L}: {type(e).__name__}: {str(e)[:300]}")
                del x
                for p in layer.parameters():
                    p.grad = None
                torch.cuda.empty_cache()
            print("| " + " | ".join(row) + " |", flush=True)
    if args.decode:
        print(f"\none-token decode step, batch {args.decode}, after an 8-token prefill:\n")
        for kind, (label, layer) in layers.items():
            try:
                with one_kernel(kind == "pdssm-one"):
                    ms = decode_ms(kind, layer, args.decode, args.width, 50, args.dtype)
                print(f"| {kind} | {ms:.3f} ms |", flush=True)
            except Exception as e:
                print(f"| {kind} | error: {type(e).__name__}: {str(e)[:200]} |")


if __name__ == "__main__":
    main()
