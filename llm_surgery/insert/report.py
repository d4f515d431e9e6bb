"""Parameter report: insert 4 layers of each kind into the real host configurations (`llm_surgery.hosts.HOST_CONFIGS`,
built on the meta device, so nothing is allocated) and print a markdown table of the inserted share of the model, and
the pdssm layers' heads (count x state size), marked where they are wider than the fused CUDA op serves
(`layers.flash_pdssm_fused.MAX_HEAD_SIZE`: such layers run the torch path on CUDA).

    python -m llm_surgery.insert.report [--n 4]
"""

from __future__ import annotations

import argparse

from llm_surgery.hosts import HOST_CONFIGS, build_host
from llm_surgery.layers import flash_pdssm_fused
from llm_surgery.layers.registry import MIXER_KINDS

from .host import attention_layers, decoder_layers
from .surgery import count_parameters, insert_layers, inserted_layers, inserted_specs, remove_inserted


def parameter_rows(n: int = 4, hosts=None) -> list[dict]:
    """One row per host: its size, where the n layers go, (inserted, total) parameters per kind, and the pdssm
    layers' (heads, state size, head width)."""
    rows = []
    for name in hosts or HOST_CONFIGS:
        model = build_host(name, device="meta")
        host_params = sum(p.numel() for p in model.parameters())
        row = {"host": name, "host_params": host_params, "attention_layers": attention_layers(model.model),
               "layers": len(decoder_layers(model.model))}
        for kind in MIXER_KINDS:
            insert_layers(model, kind, n)
            row["positions"] = [s.layer_idx for s in inserted_specs(model)]
            row[kind] = count_parameters(model)
            if kind == "pdssm":
                mixer = next(iter(inserted_layers(model).values())).mixer
                row["pdssm_heads"] = (mixer.num_heads, mixer.state_size, mixer.head_dim)
            remove_inserted(model)
        rows.append(row)
    return rows


def heads_cell(heads: int, state_size: int, head_dim: int) -> str:
    """`64 x 32`, with `(torch path)` where the fused op does not serve heads of that size."""
    fused = flash_pdssm_fused.fits(state_size, head_dim)
    return f"{heads} x {state_size}" + ("" if fused else " (torch path)")


def markdown(rows: list[dict], n: int) -> str:
    head = "| host | params | attention layers | inserted before | " + " | ".join(
        f"{k} ({n} layers)" for k in MIXER_KINDS) + " | pdssm heads x state |"
    lines = [head, "|" + " --- |" * (5 + len(MIXER_KINDS))]
    for r in rows:
        cells = [f"{r[k][0] / 1e6:.1f}M ({100 * r[k][0] / r[k][1]:.2f}%)" for k in MIXER_KINDS]
        attn = r["attention_layers"]
        attn = f"all {len(attn)}" if len(attn) == r.get("layers") else attn
        lines.append(f"| {r['host']} | {r['host_params'] / 1e9:.2f}B | {attn} | {r['positions']} | "
                     + " | ".join(cells) + f" | {heads_cell(*r['pdssm_heads'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4, help="layers to insert per host (default 4)")
    args = ap.parse_args(argv)
    print(markdown(parameter_rows(args.n), args.n))
    print("\nShare = inserted / (host + inserted). Default options: llm_surgery.layers.registry.default_options.")


if __name__ == "__main__":
    main()
