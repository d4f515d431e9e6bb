"""Does a Flash PD-SSM state grow with length where the model fails to length-generalise? Trains the Table 1
model (2 complex layers, width 128) on the CPU under a time limit, validating as the trainer does, then reports
the accuracy per length and, per layer and head, the mean norm of the last state |x_L| at L = 40 and 256.

With the `tracking` preset an entry whose |D| is snapped to 1 still takes input b_t at every token, so its
state can grow with length and, after the output norm, dilute what the automaton keeps; `b_gate="decay"`
scales b_t by 1 - |D_t|, so such entries take nothing in (issue 9's one-layer fix).

    PYTHONPATH=$PWD python bench/state_growth.py [--variant tracking+decay] --task parity --seed 2 --seconds 600

(no --variant: the CLI's defaults, i.e. the tracking preset; variants are state_tracking_gpu.py's VARIANTS)
"""

from __future__ import annotations

import argparse
import json

import torch

from state_tracking_gpu import VARIANTS  # this folder's sweep script: the named option sets

from llm_surgery.bench.state_tracking.tasks import TASKS, get_task
from llm_surgery.bench.state_tracking.train import TrainRun, cli_defaults, evaluate, held_out_generator


@torch.no_grad()
def last_state_norms(model, task, length: int, batch: int = 128) -> list[list[float]]:
    """Per layer, per head: mean over a batch of |x_L| (the state after `length` tokens)."""
    tokens, _ = task.batch(batch, length, length, torch.Generator().manual_seed(5))
    h, norms = model.embed(tokens), []
    for block in model.blocks:
        _, (_, last) = block.mixer(block.norm(h), return_state=True)
        norms.append([round(v, 3) for v in last.abs().pow(2).sum(-1).sqrt().mean(0).tolist()])
        h = block(h)
    return norms


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default=None)
    ap.add_argument("--task", choices=sorted(TASKS), default="parity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=600.0, help="training time (the schedules run on time)")
    ap.add_argument("--batch-size", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    task = get_task(args.task)
    options = dict(VARIANTS[args.variant]) if args.variant else {}
    options.update(task=args.task, seed=args.seed, batch_size=args.batch_size, time_limit_s=args.seconds,
                   eval_every=250, eval_batch=128)
    cfg = cli_defaults("pdssm", **options)
    run = TrainRun(cfg, args.seed, task, torch.device("cpu"))
    run.advance(1.0)
    model = run.model.eval()
    acc = evaluate(model, task, cfg.eval_lengths, 128, held_out_generator(args.seed), torch.device("cpu"))
    print(json.dumps({"variant": args.variant or "CLI defaults", "task": args.task, "seed": args.seed,
                      "steps": run.step, "train_loss": run.train_loss(), "val_curve": run.val_curve,
                      "acc": {L: round(a, 3) for L, a in acc.items()},
                      "state_norm_40": last_state_norms(model, task, 40),
                      "state_norm_256": last_state_norms(model, task, 256)}))


if __name__ == "__main__":
    main()
