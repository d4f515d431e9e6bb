"""The cluster forward kernel (kernels/pd_scan_cluster.cuh) on the GPU: float64-reference checks over shapes and
launch configurations, cluster residency, then a timing sweep of (chunk T, CTAs per sequence cs, stages ns,
compose groups ga, replay groups gr) at B=32, N=128 against the warp kernel, and the best configuration over L.

  PYTHONPATH=$PWD python bench/pd_scan_cluster_sweep.py [--phase check|sweep|all] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import pd_scan_bench as PB  # noqa: E402
from pd_scan_bench import K, say  # noqa: E402

KIND_CODE = {"f32": (0, 0), "bf16": (0, 1), "split_f32": (1, 0), "split_bf16": (1, 1), "c64": (2, 0)}


def check():
    dev = "cuda"
    gen = torch.Generator(device=dev)
    gen.manual_seed(99)
    tol = {"f32": 1e-4, "c64": 1e-4, "split_f32": 1e-4, "bf16": 2e-2, "split_bf16": 2e-2}
    cfgs = [None, (8, 4, 2, 1, 1), (16, 2, 4, 2, 2), (4, 8, 4, 2, 2), (32, 1, 1, 1, 1), (1, 3, 3, 1, 3),
            (3, 16, 2, 1, 2), (8, 8, 6, 3, 1)]
    cases = []
    for L in (1, 127, 128, 129, 4096):
        for N in (32, 64, 128, 256):
            for kind in tol:
                if L == 4096 and N != 128 and kind not in ("c64", "split_bf16"):
                    continue
                for cfg in cfgs if (L in (129, 4096) and N == 128) else cfgs[:2]:
                    cases.append((L, N, kind, "random", cfg))
    for pm in ("collide", "zero", "perm"):
        for kind in ("f32", "c64", "split_bf16"):
            for cfg in cfgs[:3]:
                cases.append((1000, 128, kind, pm, cfg))
    cases.append((16384, 128, "split_f32", "random", None))
    say(f"\n## cluster kernel vs float64 loop ({len(cases)} cases, S=3, outputs poisoned)")
    bad = 0
    for L, N, kind, pm, cfg in cases:
        K._state["cluster_cfg"] = cfg
        cplx = kind in ("c64", "split_f32", "split_bf16")
        P, D, b, x0 = PB.make(3, L, N, cplx, dev, pm, gen)
        g = PB.make(3, L, N, cplx, dev, "random", gen)[2]
        if not cplx:
            x0 = x0.float() if kind == "f32" else x0.to(torch.bfloat16)
        try:
            (x, *_), (Ds, bs, xs, gs) = PB.run_kind(kind, P, D, b, x0, g, None, "cluster")
            torch.cuda.synchronize()
        except RuntimeError as e:
            bad += 1
            say(f"| {L} | {N} | {kind} | {pm} | {cfg} | error: {str(e)[:300]} | NO |")
            continue
        x0s = x0.to(torch.complex128) if cplx else x0.double()
        err = PB.rel(x, PB.ref_fwd(P, Ds, bs, x0s))
        ok = err < tol[kind]
        bad += not ok
        if not ok or L >= 4096 or pm != "random":
            say(f"| {L} | {N} | {kind} | {pm} | {cfg} | {err:.1e} | {'yes' if ok else 'NO'} |")
    K._state["cluster_cfg"] = None
    say(f"cluster correctness: {len(cases) - bad}/{len(cases)} passed")
    return bad


def fits():
    ext = K._module()
    say("\n## resident clusters (cudaOccupancyMaxActiveClusters), N=128")
    say("| kind | T | ns | ga | gr | smem KB | cs=1 | cs=2 | cs=4 | cs=8 | cs=16 |")
    for kind in ("split_f32", "split_bf16"):
        kc, bf = KIND_CODE[kind]
        for T, ns, ga, gr in ((8, 2, 1, 1), (8, 4, 2, 2), (8, 3, 1, 3), (16, 2, 1, 1), (16, 4, 2, 2), (32, 2, 1, 2)):
            sm = ext.cluster_smem(kc, bf, 128, T, ns, ga, gr)
            f = [ext.cluster_fit(kc, bf, 128, T, cs, ns, ga, gr) for cs in (1, 2, 4, 8, 16)]
            say(f"| {kind} | {T} | {ns} | {ga} | {gr} | {sm / 1024:.0f} | " + " | ".join(map(str, f)) + " |")


def time_cfgs(kind, L, cfgs, bw, res):
    """Times each config on one input set (fresh inputs per (kind, L); sizes here exceed the L2)."""
    S, N = 32, 128
    e = PB.ELEM[kind]
    must = S * L * N * (2 + 3 * e)
    nsets = max(1, min(8, -(-256_000_000 // must)))
    sets = PB.inputs_for(kind, S, L, N, nsets)
    out = {}
    for cfg in cfgs:
        K._state["cluster_cfg"] = cfg if cfg != "warp" else None
        fns = [PB.fwd_fn(kind, s_, None, "warp" if cfg == "warp" else "cluster") for s_ in sets]

        def all_sets():
            for f in fns:
                f()
        try:
            ms = PB.bench_ms(all_sets, reps=20)[0] / nsets
        except RuntimeError as err:
            say(f"| {kind} | {L} | {cfg} | error {str(err)[:200]} | |")
            continue
        out[cfg] = ms
        res[f"{kind}/{L}/{cfg}"] = ms
        say(f"| {kind} | {L} | {cfg} | {ms:.4f} | {100 * must / (ms * 1e-3) / 1e12 / bw:.0f}% |")
    K._state["cluster_cfg"] = None
    del sets
    return out


def sweep(out):
    ext = K._module()
    bw = PB.d2d_bandwidth()
    say(f"\nD2D copy bandwidth: {bw:.2f} TB/s")
    res = {"d2d": bw}
    say("\n## sweep, B=32, N=128: ms (fraction of D2D in must-move bytes); config = (T, cs, ns, ga, gr)")
    say("| kind | L | config | ms | of D2D |")
    grid = ["warp"]
    for T in (8, 16, 32):
        for ns, ga, gr in ((2, 1, 1), (4, 1, 1), (2, 1, 2), (4, 1, 2), (4, 2, 2), (6, 2, 2), (3, 1, 3), (6, 3, 1)):
            if ext.cluster_smem(1, 0, 128, T, ns, ga, gr) > 227 * 1024:
                continue
            for cs in (2, 4, 8, 16):
                if ext.cluster_fit(1, 0, 128, T, cs, ns, ga, gr) > 0:
                    grid.append((T, cs, ns, ga, gr))
    t = time_cfgs("split_f32", 16384, grid, bw, res)
    top = sorted((v, c) for c, v in t.items() if c != "warp")[:6]
    top = ["warp"] + [c for _, c in top]
    for kind, L in (("split_bf16", 16384), ("c64", 16384), ("split_f32", 2048), ("split_bf16", 2048)):
        time_cfgs(kind, L, top, bw, res)
    best = top[1]
    say(f"\n## best configuration {best} and the default plan over L")
    say("| kind | config | " + " | ".join(f"L={L}" for L in (128, 512, 2048, 8192, 16384)) + " |")
    for kind in ("split_f32", "split_bf16", "c64", "f32", "bf16"):
        for cfg in (best, None):
            K._state["cluster_cfg"] = cfg
            cells = []
            for L in (128, 512, 2048, 8192, 16384):
                ms, tbs, _ = PB.time_kind(kind, 32, L, 128, which="fwd", algo="cluster")
                res[f"over_L/{kind}/{cfg}/{L}"] = ms
                cells.append(f"{ms:.4f} ({100 * tbs / bw:.0f}%)")
            say(f"| {kind} | {cfg or 'default'} | " + " | ".join(cells) + " |")
    K._state["cluster_cfg"] = None
    with open(os.path.join(out, "cluster_sweep.json"), "w") as f:
        json.dump({str(k): v for k, v in res.items()}, f, indent=1)


def anatomy(cfgs):
    """clock64 anatomy per CTA (means over CTAs, cycles per chunk) at B=32, N=128, L=16384."""
    say("\n## anatomy, split_f32, B=32, N=128, L=16384: cycles per chunk (compose: per composed chunk)")
    say("| config | ms | chunks/CTA | compose wait | compose work | replay wait agg | wait state | link | replay | lifetime/chunk |")
    for cfg in cfgs:
        K._state["cluster_cfg"] = cfg
        s_ = PB.inputs_for("split_f32", 32, 16384, 128, 1)[0]
        f = PB.fwd_fn("split_f32", s_, None, "cluster")
        f()
        torch.cuda.synchronize()
        t = PB.bench_ms(f, reps=5)[0]
        K._state["profile"] = True
        f()
        torch.cuda.synchronize()
        K._state["profile"] = False
        pr, S, cs, T = K._state.pop("last_profile")
        pr = pr.double().mean(0).cpu()
        ch = max(pr[7].item(), 1)
        say(f"| {cfg} | {t:.3f} | {ch:.0f} | " + " | ".join(f"{pr[i].item() / ch:.0f}" for i in range(7)) + " |")
    K._state["cluster_cfg"] = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="all", choices=("check", "sweep", "anatomy", "all"))
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    p = torch.cuda.get_device_properties(0)
    say(f"# cluster kernel, {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, CUDA {torch.version.cuda}")
    assert K.available(), K.load_error()
    bad = 0
    if a.phase in ("check", "all"):
        fits()
        bad = check()
    if a.phase == "anatomy":
        anatomy([(8, 8, 2, 1, 1), (8, 8, 4, 2, 2), (16, 8, 2, 1, 1), (16, 4, 4, 2, 2)])
    if a.phase in ("sweep", "all"):
        anatomy([(8, 8, 2, 1, 1), (8, 8, 4, 2, 2), (16, 8, 2, 1, 1), (16, 4, 4, 2, 2)])
        sweep(a.out)
    with open(os.path.join(a.out, f"cluster_{a.phase}.log"), "w") as f:
        f.write("\n".join(PB.LOG) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
