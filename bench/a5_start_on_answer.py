"""A5 by elements, one Flash PD-SSM layer (the protocol's recipe and settings): start every head on A5's natural
action (each token's selector logits solved by least squares so that it picks its element's member) and see
whether training keeps it, and whether the readout learns to read it (--freeze: the selection and the members stay as started).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/a5_start_on_answer.py --steps 2000 [--freeze]
"""
import argparse
import json
import time
from dataclasses import replace

import torch

from llm_surgery.bench.state_tracking import group_image, protocol
from llm_surgery.bench.state_tracking import train as st
from llm_surgery.bench.state_tracking.tasks import get_task


def start_on_natural_action(model, task, scale: float, freeze: bool):
    mixer = model.blocks[0].mixer
    H, K = mixer.num_heads, mixer.dict_size
    elements, _ = group_image.symbol_elements(task)
    perms = group_image.group_elements(task)
    got = {}
    with mixer.watching_inputs(lambda u, m: got.setdefault("u", u[0].detach().double())), torch.no_grad():
        model(torch.arange(len(elements))[None])
    U = got["u"]                                                    # [S, d_inner]: the scan input of each token
    P = mixer.transitions().long()
    W = mixer.x_proj.weight.data.view(H, -1, U.shape[1])
    for h in range(H):
        member = {tuple(P[h, k].tolist()): k for k in range(K)}
        target = torch.full((len(elements), K), -scale / K, dtype=torch.float64)
        target[torch.arange(len(elements)), [member[tuple(perms[e])] for e in elements]] = scale
        W[h, :K] = torch.linalg.lstsq(U, target).solution.T.to(W.dtype)
    if freeze:   # everything the selection depends on: the tokens' scan inputs u, the selector rows, the members
        for part in (model.embed, model.blocks[0].norm, mixer.in_proj, mixer.conv1d, mixer.dictionary):
            part.requires_grad_(False)
        keep = torch.ones_like(mixer.x_proj.weight).view(H, -1, U.shape[1])
        keep[:, :K] = 0
        keep = keep.view_as(mixer.x_proj.weight)
        mixer.x_proj.weight.register_hook(lambda g: g * keep)
    return group_image.summary(model, task)["natural_tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=4e-3, help="the protocol's chosen rate for pdssm on a5")
    ap.add_argument("--scale", type=float, default=4.0, help="selector logit of the right member")
    ap.add_argument("--freeze", action="store_true", help="keep the selection and the members as started")
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = get_task("a5")
    cfg = replace(protocol.config("pdssm", "a5", args.seed, args.lr, device="cpu", eval_batch=64),
                  steps=args.steps, eval_every=250)
    build = st.build_model

    def build_started(c):
        model = build(c)
        print("natural tokens per head at the start:", start_on_natural_action(model, task, args.scale, args.freeze))
        return model

    st.build_model = build_started
    t0 = time.time()
    r = st.train_once(cfg, log=print)
    print(json.dumps({"freeze": args.freeze, "seed": args.seed, "steps": r["steps_run"], "loss": r["train_loss"],
                      "acc": r["acc"], "acc_selected": r.get("acc_selected"), "val_best": r.get("val_best"),
                      "group_image": r.get("group_image"), "seconds": round(time.time() - t0)}))


if __name__ == "__main__":
    main()
