"""Training steps per second of the state-tracking models (Table 1 setting: 2 layers, width 128, batch 256),
eager vs one CUDA graph per sequence length, one run alone and R runs in parallel processes on one GPU.

    PYTHONPATH=$PWD python bench/state_tracking_speed.py --kinds pdssm,mamba2,deltanet --procs 1,16

Each run first steps twice at every length 1..40 (the eager step and the capture), then is timed for --seconds
on batches cycling through those lengths; parallel runs start their timed part together (a barrier).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch


def worker(kind: str, graphs: bool, seconds: float, preset: str, barrier, results, rank: int) -> None:
    torch.set_num_threads(1)
    from llm_surgery.bench.state_tracking.tasks import get_task
    from llm_surgery.bench.state_tracking.train import TrainRun, cli_defaults, quick_triton_autotune
    quick_triton_autotune()
    task = get_task("cycle_navigation")
    cfg = cli_defaults(kind, preset=preset, task="cycle_navigation", device="cuda", cuda_graphs=graphs)
    run = TrainRun(cfg, rank, task, torch.device("cuda"))
    gen = torch.Generator().manual_seed(rank)
    batches = [task.batch(cfg.batch_size, L, L, gen) for L in range(1, cfg.max_len + 1)]
    run.set_lr(1e-4)
    for b in batches + batches:
        run.train_step(*b)
    torch.cuda.synchronize()
    barrier.wait()
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for b in batches[steps % 8::8]:  # a spread of lengths, as uniform sampling gives
            run.train_step(*b)
            steps += 1
    torch.cuda.synchronize()
    results.put((rank, steps, time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30))


def measure(kind: str, graphs: bool, procs: int, seconds: float, preset: str) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=worker, args=(kind, graphs, seconds, preset, barrier, results, r)) for r in range(procs)]
    for p in ps:
        p.start()
    got = [results.get(timeout=900) for _ in ps]
    for p in ps:
        p.join()
    total = sum(s / t for _, s, t, _ in got)
    return total, max(m for *_, m in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kinds", default="pdssm,mamba2,deltanet")
    ap.add_argument("--procs", default="1,16")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--modes", default="eager,graphed")
    ap.add_argument("--preset", default="layer", help="pdssm options (BENCHMARKS.md's table: layer, the fused path)")
    args = ap.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {when}")
    print("| kind | steps | processes | steps/s per run | steps/s total | peak GiB per run |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for procs in (int(p) for p in args.procs.split(",")):
            for graphs in (m == "graphed" for m in args.modes.split(",")):
                total, mem = measure(kind, graphs, procs, args.seconds, args.preset)
                print(f"| {kind} | {'graphed' if graphs else 'eager'} | {procs} | {total / procs:.1f} | "
                      f"{total:.1f} | {mem:.2f} |", flush=True)


if __name__ == "__main__":
    main()
