"""Static view of the warp forward kernel's machine code, no GPU needed: per instantiation, the registers and
spill bytes ptxas reports, and the phase-1 step loop's size in SASS instructions (all, moves, shared loads and
stores). A variant's effect on what a step issues can be read here before a device call times it.

usage: PYTHONPATH=. python bench/sass_loops.py [FILE.cu ...]      (default kernels/pd_scan.cu; needs nvcc and cuobjdump,
                                                    from the CUDA toolkit or Triton's bundled copy)
"""

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"0": "real", "1": "split", "2": "complex"}


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    sys.exit("cuobjdump not found (CUDA toolkit, or Triton's bundled copy)")


def tag(mangled: str) -> str | None:
    m = re.search(r"pd_fwd_warp_kernelILi(\d)E(f|13__nv_bfloat16)Li(\d)E", mangled)
    return m and f"{KINDS[m.group(1)]:7s} {'f32 ' if m.group(2) == 'f' else 'bf16'} E={m.group(3)}"


def opcode(line: str) -> str:
    """A SASS instruction's full mnemonic (e.g. IMAD.MOV.U32), past its predicate if it has one."""
    words = line.split() or ["?"]
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def compile_cubin(src: Path, out: Path) -> dict:
    """ptxas's registers and spill bytes per warp-kernel instantiation, built with the extension's own nvcc flags
    for the H100/H200 (sm_90)."""
    from llm_surgery.ops.pd_scan.cuda import CUDA_CFLAGS
    cmd = ["nvcc", "-arch=sm_90", *CUDA_CFLAGS, "-cubin", "-I", str(ROOT / "kernels"), str(src),
           "-o", str(out), "-Xptxas", "-v"]
    log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    info, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = tag(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            info.setdefault(name, {})["spill"] = f"{m.group(1)}/{m.group(2)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            info.setdefault(name, {})["regs"] = int(m.group(1))
    return info


def step_loop(instrs: list[tuple[int, str]]) -> list[str]:
    """The phase-1 step loop: the smallest backward-branch range holding both the lists' build (shared atomics) and
    the support step's MATCH.ANY."""
    at = {a: i for i, (a, _) in enumerate(instrs)}
    best = None
    for i, (a, text) in enumerate(instrs):
        m = re.search(r"BRA (?:`\(.*?\) )?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) > a or int(m.group(1), 16) not in at:
            continue
        body = [t for _, t in instrs[at[int(m.group(1), 16)]:i + 1]]
        if any("ATOMS" in t for t in body) and any("MATCH.ANY" in t for t in body):
            if best is None or len(body) < len(best):
                best = body
    return best or []


def report(src: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        info = compile_cubin(src, cubin)
        sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    print(f"{src}: form, registers, spill bytes (stores/loads), phase-1 step loop (SASS instructions: all, moves, "
          f"LDS, STS)")
    rows = []
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = tag(part.split("\n")[0])
        if not name:
            continue
        instrs = [(int(m.group(1), 16), m.group(2).strip()) for m in
                  (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", l) for l in part.split("\n")) if m]
        body = step_loop(instrs)
        full = [opcode(t) for t in body]
        ops = collections.Counter(op.split(".")[0] for op in full)
        moves = sum("MOV" in op for op in full)
        r = info.get(name, {})
        rows.append(f"  {name}  regs {r.get('regs', '?'):>3}  spill {r.get('spill', '?'):>7}  loop {len(body):4d}"
                    f"  mov {moves:3d}  lds {ops['LDS']:2d}  sts {ops['STS']:2d}")
    print("\n".join(sorted(rows)))


if __name__ == "__main__":
    for f in sys.argv[1:] or [str(ROOT / "kernels" / "pd_scan.cu")]:
        report(Path(f))
