"""One training step of a real-size host with inserted layers, per mixer kind, plus CUDA-vs-CPU agreement.

For each kind this
  1. builds a random-weight host with a real configuration (`--host`: any name of llm_surgery.hosts.HOST_CONFIGS,
     dense or hybrid; default granite-4.0-h-micro, all 40 layers, bf16, on the GPU), inserts 4 layers (one
     before each of 4 attention blocks spread over depth), and times full training steps
     (forward + backward + AdamW on the inserted layers, host frozen): tokens/s and peak memory;
  2. builds a smaller real-width host in float32 on the CPU (default granite-4.0-h-350m cut to 14 layers: 2
     attention blocks), inserts layers with non-zero out_proj, and compares its logits with the same weights moved
     to the GPU (relative error).
The host's own Mamba layers run on mamba-ssm's Triton kernels as in training (`host_kernels`, the trainer's
`--host-kernels`; `--no-host-kernels`: transformers' PyTorch path, which at 1 x 2048 tokens of granite-4.0-h-micro
needs more than an H100's 80 GB under transformers 5.17); the inserted layers run their GPU paths (mamba-ssm's and
fla's layers, our pd_scan CUDA) where available.

    PYTHONPATH=$PWD python bench/surgery_step.py [--host granite-4.0-h-micro --layers 40 --batch 1 --seq 2048]
    PYTHONPATH=$PWD python bench/surgery_step.py --host falcon-h1-0.5b --check-host falcon-h1-0.5b --check-layers 4
    python bench/surgery_step.py --device cpu --layers 16 --seq 64 --steps 1   # smoke run without a GPU

`--rounds R` times the kinds R times in turn (mamba2, pdssm, pdssm, mamba2, ...) in one process and reports each
kind's median step: the step is mostly the host, whose time drifts between machines and over minutes by more
than the kinds differ, so kinds timed back to back in one round compare better than kinds timed minutes apart.
`--profile N` adds, per kind, torch.profiler's N ops with the most self device time over one more step, and the
step's wall time beside the sum of its kernels' times: a step whose kernels fill much less than its wall time is
bound by the host issuing them, not by the GPU. `--cuda-graphs` replays each step's forward + backward from a CUDA
graph (`llm_surgery.cuda_graphs`, gradients in flat buffers), as the trainer runs its steps on CUDA by default: the
host's launches are then hidden and the kinds differ by their kernels' time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time

import torch

from llm_surgery.hosts import build_host
from llm_surgery.insert import count_parameters, insert_layers, inserted_layers, remove_inserted
from llm_surgery.insert.host import attention_layers
from llm_surgery.triton_autotune import quick_autotune


def perturb(model, seed: int, std: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in inserted_layers(model).values():
            w = b.mixer.out_proj.weight
            w.copy_((torch.randn(w.shape, generator=g) * std).to(w.dtype))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_steps(model, kind: str, args) -> dict:
    n = min(4, len(attention_layers(model.model)))
    torch.manual_seed(0)
    insert_layers(model, kind, n)
    n_ins, n_total = count_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=torch.device(args.device).type == "cuda")
    model.train()
    x = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), device=args.device)

    def forward_backward(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    graphed = flat = None
    if args.cuda_graphs:   # as the trainer runs steps by default: forward + backward replayed from a CUDA graph
        from llm_surgery.cuda_graphs import GraphedByShape
        from llm_surgery.train.graphs import _flat_grads
        flat = _flat_grads(params)   # the graph's backward adds into these; its addresses must not change
        graphed = GraphedByShape(forward_backward, name="surgery_step")

    def step():
        loss = forward_backward(x) if graphed is None else graphed(x)
        opt.step()
        if flat is None:
            opt.zero_grad(set_to_none=True)
        else:
            for f in flat:
                f.zero_()
        return loss

    t0 = time.perf_counter()
    loss = step()  # first step: kernel builds, autotuning, optimizer state (graphed: the eager warm-up)
    sync(args.device)
    first = time.perf_counter() - t0
    if graphed is not None:
        step()     # the capture, replayed at once
        sync(args.device)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync(args.device)
    dt = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.device(args.device).type == "cuda" else float("nan")
    if args.profile:
        print(profile_step(step, kind, args), flush=True)
    graph_failed = None if graphed is None else graphed.failed
    opt = graphed = None   # frees the optimizer state and the graph (step() refers to both)
    remove_inserted(model)
    for p in params:
        p.grad = None
    return {"kind": kind, "n": n, "inserted_params": n_ins, "total_params": n_total, "first_step_s": first,
            "step_s": dt, "tokens_per_s": args.batch * args.seq / dt, "peak_gib": peak,
            "loss": float(loss.float()),
            **({"cuda_graph": "captured" if graph_failed is None else f"failed, eager: {graph_failed}"}
               if args.cuda_graphs else {})}


def profile_step(step, kind: str, args) -> str:
    """torch.profiler's `args.profile` ops with the most self device time (CPU time without a GPU) over one step,
    headed by the step's wall time and the sum of its kernels' times."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(args.device).type == "cuda"
    sync(args.device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync(args.device)
    wall = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    head = f"\n#### {kind}: one profiled step, wall {wall:.1f} ms"
    if cuda:   # the kernels' own rows (the ops that launch them repeat their time)
        kernels = sum(e.self_device_time_total for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
        head += f", kernels {kernels / 1e3:.1f} ms"
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return head + "\n\n" + events.table(sort_by=sort_by, row_limit=args.profile)


def cuda_vs_cpu(kind: str, args) -> dict:
    torch.manual_seed(1)
    model = build_host(args.check_host, device="cpu", dtype=torch.float32, num_hidden_layers=args.check_layers)
    n = min(4, len(attention_layers(model.model)))
    insert_layers(model, kind, n)
    perturb(model, seed=2)
    model.eval()
    x = torch.randint(3, model.config.vocab_size, (2, args.check_seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x, use_cache=False).logits.double()
        model.to(args.device)
        out = model(x.to(args.device), use_cache=False).logits.double().cpu()
        model.to("cpu")
        remove_inserted(model)
        host = model(x, use_cache=False).logits.double()
    rel = ((out - ref).norm() / ref.norm()).item()
    effect = ((ref - host).norm() / ref.norm()).item()  # how much the inserted layers change the logits
    return {"kind": kind, "n": n, "rel_err": rel, "max_abs_err": (out - ref).abs().max().item(),
            "inserted_effect": effect}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="granite-4.0-h-micro")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--kinds", default="mamba2,deltanet,pdssm")
    ap.add_argument("--rounds", type=int, default=1, help="time the kinds this many times in turn (median reported)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--check-host", default="granite-4.0-h-350m")
    ap.add_argument("--check-layers", type=int, default=14)
    ap.add_argument("--check-seq", type=int, default=128)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--quick-autotune", action="store_true",
                    help="Triton autotuners keep their leanest working config (saves minutes; untuned timings)")
    ap.add_argument("--no-host-kernels", action="store_true",
                    help="leave the host's Mamba2 layers on transformers' PyTorch path")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay each step's forward + backward from a CUDA graph, as the trainer does on CUDA")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="per kind, the N ops with the most self device time over one more step (0: none)")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if args.cuda_graphs and torch.device(args.device).type != "cuda":
        raise SystemExit("--cuda-graphs needs --device cuda")
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --device cpu for a smoke run")
        print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
        if args.quick_autotune and importlib.util.find_spec("triton"):
            quick_autotune()
        if not args.no_host_kernels:
            from llm_surgery.host_kernels import use_mamba_kernels_for_hosts
            print(use_mamba_kernels_for_hosts())
    import transformers
    print("transformers", transformers.__version__)

    results = {"args": vars(args), "train": [], "check": []}
    model = None
    if not args.skip_train:
        t0 = time.perf_counter()
        model = build_host(args.host, device=args.device, dtype=torch.bfloat16, num_hidden_layers=args.layers)
        print(f"host {args.host} ({len(model.model.layers)} layers, attention at {attention_layers(model.model)}) "
              f"built in {time.perf_counter() - t0:.1f}s", flush=True)
    for rnd in range(args.rounds):
        # kind by kind, so that a run cut short still reports whole kinds; every other round in reverse order
        # (A B B A ...), so that a drift over the run does not favour the kind timed first
        for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
            if rnd == 0:
                try:
                    r = cuda_vs_cpu(kind, args)
                except Exception as exc:  # noqa: BLE001 - report and go on with the other kinds
                    r = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"[:500]}
                print(json.dumps(r), flush=True)
                results["check"].append(r)
            if model is None:
                continue
            try:
                r = train_steps(model, kind, args)
            except Exception as exc:  # noqa: BLE001
                r = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"[:500]}
                if inserted_layers(model):
                    remove_inserted(model)
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
            r = {"round": rnd, **r}
            print(json.dumps(r), flush=True)
            results["train"].append(r)

    L = args.layers or "all"
    rounds = f", {args.rounds} rounds in turn, the median round" if args.rounds > 1 else ""
    print(f"\n### Training step: {args.host} ({L} layers), bf16, batch {args.batch} x {args.seq} tokens, "
          f"fwd+bwd+AdamW{', fwd+bwd replayed from CUDA graphs' if args.cuda_graphs else ''}, {args.steps} timed "
          f"steps{rounds}\n")
    print("| kind | inserted | inserted params (share) | first step s | step s | tokens/s | peak GiB | "
          "rounds' step s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in kinds:
        runs = [r for r in results["train"] if r["kind"] == kind]
        errors = [r for r in runs if "error" in r]
        if errors:
            print(f"| {kind} | error: {errors[0]['error'][:120]} | | | | | | |")
            continue
        if not runs:
            continue
        r = sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]   # the median round (lower middle)
        each = " / ".join(f"{x['step_s']:.3f}" for x in runs)
        print(f"| {kind} | {r['n']} | {r['inserted_params'] / 1e6:.1f}M "
              f"({100 * r['inserted_params'] / r['total_params']:.2f}%) | {runs[0]['first_step_s']:.1f} | "
              f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
              f"{each} |")
    print(f"\n### {args.device} vs CPU logits: {args.check_host} ({args.check_layers} layers), float32, "
          f"2 x {args.check_seq} tokens, inserted out_proj ~ N(0, 0.02)\n")
    print("| kind | inserted | relative error | max abs error | inserted layers' effect on logits (relative) |")
    print("| --- | --- | --- | --- | --- |")
    for r in results["check"]:
        if "error" in r:
            print(f"| {r['kind']} | error: {r['error'][:120]} | | | |")
        else:
            print(f"| {r['kind']} | {r['n']} | {r['rel_err']:.2e} | {r['max_abs_err']:.2e} | "
                  f"{r['inserted_effect']:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)


if __name__ == "__main__":
    main()
