"""Registers and spills of the tensor-core selector kernel (`triton_ste._selector_dot_kernel`) compiled for sm_90
on any machine, GPU or not: Triton compiles ahead of time and its bundled `cuobjdump` reads the cubin's resource
usage. Why `triton_ste.SELECTOR_DOT_MAX_BLOCK_N` is 32.

    python bench/selector_dot_registers.py --sizes 32x32 40x64 --block-t 64 32 --rows 4 2
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llm_surgery.ops.pd_select.triton_ste import SELECTOR_DOT_CONFIG, _selector_dot_kernel, selector_dot_sizes

POINTERS = {"mask_ptr": "*i8", "p_ptr": "*i32"}


def resources(N: int, K: int, block_t: int, rows: int, num_warps: int = 4) -> str:
    """'REG:n STACK:bytes' of the kernel for a complex layer's planes at state N and K members (TF32)."""
    names = list(_selector_dot_kernel.arg_names)
    sizes = selector_dot_sizes(N, K, dict(SELECTOR_DOT_CONFIG, block_t=block_t, rows=rows))
    const = dict(K=K, N=N, **sizes, REPEAT=1, PRECISION="tf32", BF16=False, COMPLEX=True, HAS_X0=False,
                 HAS_MASK=False)
    sig = {a: "constexpr" if a in const else POINTERS.get(a, "*fp32" if a.endswith(("_re", "_im", "_ptr")) else "i32")
           for a in names}
    src = ASTSource(_selector_dot_kernel, sig, constexprs={(names.index(a),): v for a, v in const.items()})
    cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["cubin"]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return " ".join(re.findall(r"(?:REG|STACK):\d+", out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["32x32", "32x64", "40x64", "64x64"], help="state N x members K")
    ap.add_argument("--block-t", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 2, 1])
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, 4 warps")
    print("| N x K | tokens per block | rows of Q | registers, stack bytes a thread |\n|---|---|---|---|")
    for size, block_t, rows in itertools.product(args.sizes, args.block_t, args.rows):
        N, K = map(int, size.split("x"))
        print(f"| {size} | {block_t} | {rows} | {resources(N, K, block_t, rows)} |", flush=True)


if __name__ == "__main__":
    main()
