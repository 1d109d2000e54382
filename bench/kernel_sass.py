"""Compile one quant_splitk config for sm90 on a machine without a GPU and count its SASS.

    PYTHONPATH=. python bench/kernel_sass.py QUANT DOT BLOCK_M BLOCK_N BLOCK_K SPLIT WARPS [W_DTYPE]
        [--stages S] [--no-asm]
    e.g. bench/kernel_sass.py 2 1 16 64 256 4 4      (int4, tensor cores, [64, 256] tiles, split 4)

Needs Triton (its bundled ptxas, cuobjdump and nvdisasm); no CUDA device. Prints the registers,
spills and shared memory, the instruction mix and the memory instructions with their widths: a
static check (vectorized loads, no spills, instructions per weight) before spending device time.
Integer arguments are marked divisible by 16, as Triton specializes them at a real launch.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenforge.kernels import quant_splitk

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_config(a: argparse.Namespace):
    wdt = a.w_dtype or ("*i32" if a.quant == 2 else "*i8")
    sdt = "*bf16" if a.quant == 2 else "*fp32"
    sig = {"x_ptr": "*bf16", "w_ptr": wdt, "s_ptr": sdt, "z_ptr": sdt, "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "g_stride": "i32", "stride_ym": "i32", "split_k": "i32"}
    cons = dict(QUANT=a.quant, GROUP=128, HAS_BIAS=False, DOT=bool(a.dot), BLOCK_M=a.block_m, BLOCK_N=a.block_n,
                BLOCK_K=a.block_k, SPLIT=a.split > 1, USE_PDL=True, F32=False, PREFETCH=a.stages == 1,
                ASM=not a.no_asm and a.quant == 2 and bool(a.dot))
    sig.update(dict.fromkeys(cons, "constexpr"))
    names = list(sig)
    divisible = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("N", "K", "stride_xm", "stride_wn",
                                                                               "g_stride", "stride_ym")]
    src = ASTSource(fn=quant_splitk._splitk_kernel, signature=sig, constexprs=cons,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=a.warps, num_stages=a.stages))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("quant", "dot", "block_m", "block_n", "block_k", "split", "warps"):
        p.add_argument(name, type=int)
    p.add_argument("w_dtype", nargs="?", help="the weight pointer type, e.g. *fp8e4nv")
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--no-asm", action="store_true")
    a = p.parse_args()
    cubin = Path("/tmp/kernel_sass.cubin")
    cubin.write_bytes(compile_config(a).asm["cubin"])
    usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True)
    print(usage.stdout.strip().splitlines()[-1].strip())
    sass = subprocess.run([BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    print(sum(ops.values()), "instructions:", ops.most_common(20))
    mem = collections.Counter(re.findall(r"\b((?:STS|LDS|LDSM|LDG|STG|HGMMA|QGMMA|HMMA)(?:\.[A-Z0-9x]+)*)", sass))
    print("memory / MMA:", mem.most_common(12))


if __name__ == "__main__":
    main()
