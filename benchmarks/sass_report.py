"""What ptxas made of each kernel instance, without a GPU: registers, spills and the page loop.

    python benchmarks/sass_report.py                               # this tree's sm_90a build
    python benchmarks/sass_report.py new= old=../old/cpindex/kernels  # two source trees
    python benchmarks/sass_report.py --order --only nvfp4          # where the loads sit
    python benchmarks/sass_report.py --triton --only bf16          # beside the Triton scorer

Each ``name=DIR`` compiles ``DIR/score.hip`` (an empty DIR: this tree's ``cpindex/kernels``;
another checkout's, e.g. a ``git worktree`` of another commit, to compare a change) for sm_90a
with ``CP_WGMMA=1`` (what an H100/H200 builds), like ``.ci/compile-kernels``. Per instance
(format, query tiles ``NT``, warpgroup mma ``W``, split pages ``S``) it prints registers, spill
bytes and the page loop: the innermost loop around all of the instance's mma instructions, with
its instruction count, local-memory (spill) loads, generic loads and the most frequent opcodes.
``--order`` adds the loop's global loads (``L``) and mma instructions (``M``) in program order,
which shows how far ahead of its math ptxas issued a tile's loads. ``--triton`` adds the Triton
scorer (``cpindex/bench/triton_baseline.py``, needs ``triton``) compiled for sm_90 at T = 1, 4 and
8 with 4 heads, as a launch would specialize it: registers, shared memory and its opcodes (it has
no loop: one page per program). Between trees, ``same``
marks instances whose SASS is identical to the first tree's: the check that a change meant to
keep the machine code keeps it.

Needs ``nvcc`` and ``cuobjdump`` (on PATH, next to nvcc, or ``$CUOBJDUMP``; PyPI's
``nvidia-cuda-cuobjdump`` wheel carries it). Static counts, not timings: docs/BENCHMARKS.md
holds what was measured.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "cpindex" / "kernels"
FORMATS = {0: "bf16", 1: "fp8", 2: "nvfp4", 3: "nvfp4-narrow"}  # launch.h: CacheFormat
INSTANCE = re.compile(r"score_kernelILi(\d)ELi(\d)ELb([01])ELi(\d)E")
SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


@dataclass
class Instance:
    """One compiled ``score_kernel<F, NT, W, S>``."""

    fmt: str
    nt: int
    wgmma: bool
    split: int  # warps per page of a split-page instance (4 or 2), 0 for whole pages
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    sass_digest: str = ""
    loop: list[str] = field(default_factory=list)  # page-loop opcodes in program order

    @property
    def key(self) -> tuple[str, int, bool, int]:
        return self.fmt, self.nt, self.wgmma, self.split

    def label(self) -> str:
        kind = " wg" if self.wgmma else f" split{self.split}" if self.split else ""
        return f"{self.fmt} NT={self.nt}{kind}"


def _tool(name: str, nvcc: str) -> str:
    env = os.environ.get(name.upper())
    for cand in (env, shutil.which(name), str(Path(nvcc).resolve().parent / name)):
        if cand and Path(cand).is_file():
            return cand
    sys.exit(
        f"{name} not found: put it on PATH or set ${name.upper()} "
        f"(pip download --no-deps nvidia-cuda-{name} and unzip the wheel)"
    )


def _compile(source: Path, out: Path, nvcc: str) -> str:
    cmd = [nvcc, "-x", "cu", "-gencode", "arch=compute_90a,code=sm_90a", "-DCP_WGMMA=1", "-O3",
           "-std=c++17", "-c", "-o", str(out), str(source), "-Xptxas", "-v"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"nvcc failed for {source}:\n{proc.stderr[-3000:]}")
    return proc.stderr


def _resources(ptxas_log: str) -> dict[tuple[str, int, bool, int], tuple[int, int, int]]:
    """(registers, spill stores, spill loads) per instance, from ``-Xptxas -v``."""
    res: dict[tuple[str, int, bool, int], tuple[int, int, int]] = {}
    current = None
    stores = loads = 0
    for line in ptxas_log.splitlines():
        if "Function properties for" in line:
            m = INSTANCE.search(line)
            current = (FORMATS[int(m[1])], int(m[2]), m[3] == "1", int(m[4])) if m else None
        elif current and "spill stores" in line:
            stores, loads = (int(x) for x in re.findall(r"(\d+) bytes spill", line))
        elif current and "Used" in line and "registers" in line:
            res[current] = (int(re.search(r"Used (\d+) registers", line)[1]), stores, loads)
            current = None
    return res


def _page_loop(body: list[tuple[int, str, str]]) -> list[str]:
    """Opcodes of the innermost loop (a backward branch) that contains every mma instruction."""
    mma = [addr for addr, op, _ in body if "MMA" in op]
    if not mma:
        return []
    best = None
    for addr, op, args in body:
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target[1], 16) <= mma[0] and addr >= mma[-1]:
            span = (int(target[1], 16), addr)
            if best is None or span[1] - span[0] < best[1] - best[0]:
                best = span
    if best is None:
        return []
    return [op for addr, op, _ in body if best[0] <= addr <= best[1]]


def build(kernels: Path, nvcc: str, cuobjdump: str, tmp: Path) -> dict[tuple, Instance]:
    """Compile one source tree's kernel and describe its instances."""
    obj = tmp / f"v{hashlib.md5(str(kernels).encode()).hexdigest()[:8]}.o"
    res = _resources(_compile(kernels / "score.hip", obj, nvcc))
    sass = subprocess.run(
        [cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True
    )
    out: dict[tuple, Instance] = {}
    for chunk in re.split(r"\n\s*Function : ", sass.stdout)[1:]:
        m = INSTANCE.search(chunk.split("\n", 1)[0])
        if not m:
            continue
        inst = Instance(FORMATS[int(m[1])], int(m[2]), m[3] == "1", int(m[4]))
        body = [(int(x[1], 16), x[2], x[3]) for x in map(SASS_LINE.match, chunk.split("\n")) if x]
        text = "\n".join(f"{op}{args}" for _, op, args in body)
        inst.sass_digest = hashlib.md5(text.encode()).hexdigest()
        inst.registers, inst.spill_stores, inst.spill_loads = res.get(inst.key, (0, 0, 0))
        inst.loop = _page_loop(body)
        out[inst.key] = inst
    return out


def _mix(loop: list[str], top: int) -> str:
    counts = collections.Counter(op.split(".")[0] for op in loop)
    return ", ".join(f"{op} {n}" for op, n in counts.most_common(top))


def _order(loop: list[str]) -> str:
    return "".join("L" if op.startswith("LDG") else "M" if "MMA" in op else "" for op in loop)


def triton_report(cuobjdump: str, top: int) -> None:
    """The Triton scorer's machine code at T = 1, 4, 8 (H = 4), without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    from cpindex.bench import triton_baseline as tb

    names = list(tb._block_scores_kernel.arg_names)
    consts = dict(INIT_BLOCKS=0, LOCAL_BLOCKS=1, BLOCK_T=tb.BLOCK, D=tb.DIM, UPCAST=False)
    types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
             "out_ptr": "*fp32", "sm_scale": "fp32"}  # fmt: skip
    # 16-divisible at launch (pointers and row strides): what triton specializes the call on
    aligned = {"q_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "out_ptr", "stride_qr", "stride_qh",
               "stride_cp", "stride_btr", "stride_oh"}  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    with tempfile.TemporaryDirectory() as tmp:
        for t in (1, 4, 8):
            vp = max(16, triton.next_power_of_2(4 * t))
            const = dict(consts, T=t, VP=vp)
            sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
            src = triton.compiler.ASTSource(tb._block_scores_kernel, sig, const, attrs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            cubin = Path(tmp) / f"t{t}.cubin"
            cubin.write_bytes(k.asm["cubin"])
            run = [cuobjdump, "--dump-resource-usage", str(cubin)]
            usage = subprocess.run(run, capture_output=True, text=True, check=True).stdout
            regs = re.search(r"REG:(\d+)", usage)[1]
            sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout  # fmt: skip
            ops = [x[2] for x in map(SASS_LINE.match, sass.split("\n")) if x]
            print(f"== triton bf16 T={t} (VP={vp}, 4 warps)")
            print(f"  {regs} regs, {k.metadata.shared} B shared | {len(ops)} instrs")
            print(f"  {_mix(ops, top)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "trees", nargs="*", default=["this="], help="name=DIR of score.hip (default: this=)"
    )
    ap.add_argument("--only", default="", help="comma list of formats to show (default: all)")
    ap.add_argument(
        "--order", action="store_true", help="print each page loop's loads and mma in order"
    )
    ap.add_argument(
        "--top", type=int, default=10, help="opcodes listed per page loop (default: 10)"
    )
    ap.add_argument("--triton", action="store_true", help="add the Triton scorer's machine code")
    args = ap.parse_args()
    trees: dict[str, Path] = {}
    for v in args.trees:
        name, sep, path = v.partition("=")
        if not sep or not name.isidentifier():
            ap.error(f"{v!r}: expected NAME=DIR, e.g. 'old=../old/cpindex/kernels'")
        trees[name] = Path(path).resolve() if path else KERNELS
        if not (trees[name] / "score.hip").is_file():
            ap.error(f"{v!r}: no score.hip in {trees[name]}")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file():
        sys.exit("nvcc not found")
    cuobjdump = _tool("cuobjdump", nvcc)
    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor() as pool:  # nvcc in parallel
        jobs = {n: pool.submit(build, d, nvcc, cuobjdump, Path(tmp)) for n, d in trees.items()}
        built = {n: job.result() for n, job in jobs.items()}
    first = next(iter(built.values()))
    for key in sorted(first, key=lambda k: (list(FORMATS.values()).index(k[0]), *k[1:])):
        if only and key[0] not in only:
            continue
        print(f"== {first[key].label()}")
        for name, insts in built.items():
            inst = insts.get(key)
            if inst is None:
                print(f"  {name:>12}: not built")
                continue
            same = (
                " same"
                if name != next(iter(built)) and inst.sass_digest == first[key].sass_digest
                else ""
            )
            loop = inst.loop
            ldl = sum(op.startswith("LDL") for op in loop)
            generic = sum(bool(re.match(r"^LD(\.|$)", op)) for op in loop)
            spills = f"{inst.spill_stores}/{inst.spill_loads} B"
            print(
                f"  {name:>12}: {inst.registers} regs, spills {spills} | page loop {len(loop)}"
                f" instrs, LDL {ldl}, generic LD {generic}{same}"
            )
            print(f"  {'':>12}  {_mix(loop, args.top)}")
            if args.order:
                print(f"  {'':>12}  {_order(loop)}")
    if args.triton:
        triton_report(cuobjdump, args.top)


if __name__ == "__main__":
    main()
