"""What the AMD compilers made of each scoring kernel instance, and a roofline estimate, without
an AMD GPU.

    python benchmarks/amd_report.py                    # compile this tree's score.hip, report
    python benchmarks/amd_report.py --summary          # per (format, T): the estimate only
    python benchmarks/amd_report.py --source ../other/cpindex/kernels/score.hip   # another tree
    KERNEL_ASM_DIR=/tmp/asm bash .ci/compile-kernels   # or: the gates' kept assembly
    python benchmarks/amd_report.py /tmp/asm

Without a folder, the report compiles ``--source`` (default: this tree's ``score.hip``) through
``.ci/compile-kernels`` (all its gates; the sm_90 ones are skipped without nvcc) and reads the
kept assembly. The ``calls`` column counts calls the compiler left (``s_swappc_b64``): a call
costs registers, spills and a stack, so a kernel with calls reports more than it needs.

Per scoring-kernel instance (every template instance of a kernel whose name matches
``--kernel``, read from the symbols with ``llvm-cxxfilt``/``c++filt`` and named by
``score.hip``'s own template parameters), from the AMDHSA metadata: VGPRs (``.vgpr_count``,
the total a lane holds: architected VGPRs and AGPRs together), AGPRs, SGPRs, spills, scratch
(``.private_segment_fixed_size``) and LDS (``.group_segment_fixed_size``); waves per SIMD; and
the page loop's instruction counts.

Waves per SIMD. On gfx90a, gfx942 and gfx950 a SIMD has one 512-entry VGPR file per lane that
holds a wave's architected VGPRs and AGPRs together (the AGPRs start at ``.amdhsa_accum_offset``),
allocated in granules of 8, at most 8 waves: waves = min(8, 512 // roundup(vgpr_count, 8)). This
is LLVM's rule (``AMDGPU::IsaInfo::getNumWavesPerEUWithNumVGPRs``, AMDGPUUsage "gfx90a"), and
the compiler writes the same arguments into the assembly (``; Occupancy: occupancy(8, 8, 512,
...)`` from clang 22); where it writes a number (clang 19) the report checks against it. LDS
also limits it: 64 KiB a CU on gfx942, 160 KiB on gfx950 (CDNA3/CDNA4 whitepapers), shared by
the work-groups on the CU, each spreading its waves over the 4 SIMDs.

The page loop: among the function's loops (a branch back to an earlier label), the smallest
that holds at least half as many matrix instructions (``v_mfma``/``v_smfmac``; without any,
FMA-class VALU: what the portable path multiplies with) as the loop holding the most: the loops
around the page loop hold its math too, plus other paths'. Its key loads (global/buffer/flat
loads, their bytes from the opcode's width, times 64 lanes, an address read twice counted once)
say how many iterations one page takes: a page's bytes / the loop's bytes per iteration. Counts
per page are the loop's counts times that.

The roofline, per (format, T) with H = 4 heads, for the whole-page instance the launcher takes
(split-page instances serve small calls, where a page's latency matters, not its bytes):
- HBM: a page's bytes (bf16 32 KiB, fp8 16 KiB, nvfp4 9 KiB) at the GPU's bandwidth shared by
  its CUs: MI355X 8 TB/s over 256 CUs at 2.4 GHz, MI300X 5.3 TB/s over 304 CUs at 2.1 GHz
  (AMD's specifications; the clocks are the peak engine clocks behind the published peak rates).
- compute: a page is scored by one wave on one SIMD, 4 SIMDs a CU, assuming enough waves to
  overlap memory (the estimate's main assumption). MFMA time: count x cycles per instruction
  (tests/data/mfma_layouts.json, from AMD's matrix instruction calculator). VALU time: a SIMD is
  16 lanes wide, so a wave64 VALU instruction issues over 4 cycles (the published fp32 vector
  peaks: 256 CUs x 4 SIMDs x 16 lanes x 2 (packed) x 2 flops x 2.4 GHz = 157 TFLOPS); the
  transcendental ones take 16. MFMA and VALU of different waves overlap, so compute = the larger.
  A request with more query vectors (T x H) than one pass holds scores the page again per pass
  (the later passes find it in L2): compute x passes, HBM once.
Goal: compute at most half the HBM time at T = 1, 4 and 8.

These are estimates from the assembly, not measurements: no AMD GPU has run this code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "cpindex" / "kernels"
LAYOUTS = ROOT / "tests" / "data" / "mfma_layouts.json"
FORMATS = {0: "bf16", 1: "fp8", 2: "nvfp4", 3: "nvfp4-narrow"}  # launch.h: CacheFormat
PAGE_BYTES = {"bf16": 32768, "fp8": 16384, "nvfp4": 9216, "nvfp4-narrow": 9216}
HEADS = 4
WAVE = 64


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str
    hbm_bytes_s: float
    cus: int
    clock_hz: float
    lds_bytes: int  # a CU's LDS

    @property
    def hbm_bytes_per_cu_cycle(self) -> float:
        return self.hbm_bytes_s / self.cus / self.clock_hz


# Public figures: MI355X 8 TB/s HBM3E, 8 XCDs x 32 CUs, 2.4 GHz peak engine clock (AMD's
# MI350 series announcement and Hot Chips 2025 talk; ISSCC 2026: 8,192 fp8 flops a clock a CU);
# MI300X 5.3 TB/s HBM3, 304 CUs, 2.1 GHz peak engine clock (AMD's MI300X data sheet; 163.4
# TFLOPS packed fp32 = 304 x 256 flops a clock x 2.1 GHz). LDS: 64 KiB a CU on CDNA3, 160 KiB
# on CDNA4 (AMD's CDNA3 and CDNA4 white papers).
GPUS = (
    Gpu("MI355X", "gfx950", 8.0e12, 256, 2.4e9, 160 * 1024),
    Gpu("MI300X", "gfx942", 5.3e12, 304, 2.1e9, 64 * 1024),
)
VGPR_FILE, VGPR_GRANULE, MAX_WAVES, SIMDS = 512, 8, 8, 4
VALU_CYCLES, TRANS_CYCLES = 4, 16
TRANS = re.compile(r"v_(exp|log|rcp|rsq|sqrt|sin|cos)_")
FMA = re.compile(r"v_(pk_)?fmac?_|v_dot\d|v_mad_f32|v_pk_mul_f32|v_mul_f32")
MATRIX = re.compile(r"v_(mfma|smfmac)_")
LOAD_BYTES = {"ubyte": 1, "sbyte": 1, "byte": 1, "ushort": 2, "sshort": 2, "short": 2,
              "dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16, "b32": 4, "b64": 8,
              "b96": 12, "b128": 16}  # fmt: skip
SALU_SKIP = (
    "s_waitcnt",
    "s_nop",
    "s_branch",
    "s_cbranch",
    "s_barrier",
    "s_endpgm",
    "s_setprio",
    "s_sleep",
    "s_sendmsg",
    "s_swappc",
    "s_setpc",
    "s_getpc",
    "s_trap",
    "s_icache",
    "s_dcache",
    "s_load",
    "s_buffer_load",
    "s_store",
    "s_memtime",
    "s_memrealtime",
)


def classify(op: str) -> str:
    """The issue class of one opcode: mfma, valu, vmem, scratch, lds, smem, salu or other."""
    if MATRIX.match(op):
        return "mfma"
    if op.startswith("v_"):
        return "valu"
    if op.startswith("scratch_"):
        return "scratch"
    if op.startswith(("global_", "buffer_", "flat_")):
        return "vmem"
    if op.startswith("ds_"):
        return "lds"
    if op.startswith(("s_load", "s_buffer_load", "s_store", "s_dcache", "s_memtime")):
        return "smem"
    if op.startswith("s_") and not op.startswith(SALU_SKIP):
        return "salu"
    return "other"


def load_bytes(op: str) -> int:
    """Bytes a global/buffer key load brings per lane (0 for anything else)."""
    if not re.match(r"(global|buffer|flat)_load_", op):
        return 0
    width = op.split("_load_", 1)[1].removeprefix("lds_").split("_")[0]
    return LOAD_BYTES.get(width, 0)


def _regs(tok: str) -> tuple[str, int, int] | None:
    """``v[36:37]`` -> ("v", 36, 37), ``s4`` -> ("s", 4, 4); None for anything else."""
    m = re.fullmatch(r"([vsa])(?:\[(\d+):(\d+)\]|(\d+))", tok)
    if not m:
        return None
    lo = int(m[2] or m[4])
    return m[1], lo, int(m[3] or lo)


def _dst(line: str) -> str:
    """The register an instruction writes (its first operand), '' for stores and the like."""
    parts = line.split(None, 1)
    if len(parts) < 2 or re.match(r"(global|buffer|flat|scratch)_store|ds_write|s_waitcnt", line):
        return ""
    return parts[1].split(",")[0].strip()


def _overlaps(a: tuple[str, int, int] | None, b: tuple[str, int, int] | None) -> bool:
    return bool(a and b and a[0] == b[0] and a[1] <= b[2] and b[1] <= a[2])


@dataclass
class Loop:
    ops: list[str]
    lines: list[str] = field(default_factory=list)  # the instructions with their operands

    def count(self, cls: str) -> int:
        return sum(classify(op) == cls for op in self.ops)

    @property
    def key_bytes(self) -> int:
        """Bytes the loop's global/buffer loads bring a wave. A load of an address an earlier
        load in the loop already read (same address registers and offset, not written in
        between) adds nothing: clang 19 makes such narrower twins of gfx942 key loads."""
        total = 0
        seen: dict[tuple[str, ...], tuple[int, int]] = {}  # address -> (index, bytes)
        for i, op in enumerate(self.ops):
            n = load_bytes(op)
            if not n:
                continue
            line = self.lines[i] if i < len(self.lines) else op
            args = line.split(None, 1)[-1].replace(",", " ").split()[1:]  # not the dst
            addr = tuple(a for a in args if a not in ("sc0", "sc1", "nt", "glc", "slc"))
            prev = seen.get(addr)
            regs = [_regs(a) for a in addr if _regs(a)]
            if prev and not any(
                _overlaps(_regs(_dst(x)), r) for x in self.lines[prev[0] + 1 : i] for r in regs
            ):
                total += max(0, n - prev[1])
                seen[addr] = (i, max(n, prev[1]))
                continue
            total += n
            seen[addr] = (i, n)
        return WAVE * total

    def valu_cycles(self) -> int:
        return sum(
            TRANS_CYCLES if TRANS.match(op) else VALU_CYCLES
            for op in self.ops
            if classify(op) == "valu"
        )

    def mfma_cycles(self, cycles: dict[str, int]) -> int:
        return sum(cycles.get(op.removesuffix("_e64"), 0) for op in self.ops if MATRIX.match(op))

    def unknown_mfma(self, cycles: dict[str, int]) -> set[str]:
        return {op for op in self.ops if MATRIX.match(op) and op.removesuffix("_e64") not in cycles}


@dataclass
class Kernel:
    """One compiled instance of a scoring kernel on one target."""

    arch: str
    symbol: str
    name: str  # the kernel template's name
    params: dict[str, str]  # template parameter -> value
    meta: dict = field(default_factory=dict)
    occupancy_note: str = ""  # the compiler's own occupancy line, when it is a number
    calls: int = 0  # s_swappc_b64: calls the compiler could not inline
    loop: Loop | None = None

    @property
    def fmt(self) -> str:
        return FORMATS.get(int(self.params.get("F", -1)), "?")

    @property
    def vgprs(self) -> int:
        return int(self.meta.get(".vgpr_count", 0))

    @property
    def waves_vgpr(self) -> int:
        alloc = max(VGPR_GRANULE, math.ceil(self.vgprs / VGPR_GRANULE) * VGPR_GRANULE)
        return min(MAX_WAVES, VGPR_FILE // alloc)

    def waves(self, gpu: Gpu) -> int:
        lds = int(self.meta.get(".group_segment_fixed_size", 0))
        wg_waves = max(1, int(self.meta.get(".max_flat_workgroup_size", WAVE)) // WAVE)
        if lds == 0:
            return self.waves_vgpr
        per_simd = (gpu.lds_bytes // lds) * wg_waves // SIMDS
        return max(0, min(self.waves_vgpr, per_simd))

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


# ---- parsing ------------------------------------------------------------------------------------
def demangle(symbols: list[str]) -> dict[str, str]:
    tool = next(
        (t for t in ("llvm-cxxfilt-19", "llvm-cxxfilt", "c++filt") if shutil.which(t)), None
    )
    if tool is None:
        sys.exit("needs llvm-cxxfilt or c++filt to read the instances' template arguments")
    out = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True)
    return dict(zip(symbols, out.stdout.splitlines(), strict=True))


def template_params(source: Path | None, kernel: re.Pattern) -> dict[str, list[str]]:
    """Template parameter names of each matching ``__global__`` kernel template in the source."""
    if source is None or not source.is_file():
        return {}
    text = source.read_text()
    found: dict[str, list[str]] = {}
    pat = r"template\s*<([^>]*)>\s*__global__[^(]*?\b(\w+)\s*\("
    for m in re.finditer(pat, text):
        if kernel.search(m[2]):
            found[m[2]] = [p.split()[-1].split("=")[0] for p in m[1].split(",")]
    return found


def parse_template_args(demangled: str) -> tuple[str, list[str]] | None:
    """``ns::score_kernel<0, 1, false, 4>(args)`` -> ("score_kernel", ["0", "1", "false", "4"])."""
    m = re.search(r"(\w+)<([^<>]*)>\(", demangled)
    if not m:
        return None
    return m[1], [a.strip() for a in m[2].split(",")]


def functions(text: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each function's body (its lines from its label to its ``.Lfunc_end``) and the compiler's
    occupancy for it (the ``; Occupancy: N`` of its kernel info after the end, when a number)."""
    out: dict[str, list[str]] = {}
    occupancy: dict[str, str] = {}
    current: list[str] | None = None
    name = ""
    for line in text.splitlines():
        m = re.match(r"^([\w.$]+):", line)
        if m and not m[1].startswith("."):
            name = m[1]
            current = out.setdefault(name, [])
            continue
        if current is not None and re.match(r"^\.Lfunc_end\d+:", line):
            current = None
        elif current is not None:
            current.append(line)
        elif name and (occ := re.match(r"; Occupancy: (\d+)\s*$", line)):
            occupancy.setdefault(name, occ[1])
    return out, occupancy


def metadata(text: str) -> dict[str, dict]:
    m = re.search(r"\.amdgpu_metadata\n(.*?)\n\s*\.end_amdgpu_metadata", text, re.S)
    if not m:
        return {}
    doc = yaml.safe_load(m[1])
    return {k[".name"]: k for k in doc.get("amdhsa.kernels", [])}


def page_loop(body: list[str]) -> Loop | None:
    """The loop with the most matrix (else FMA-class) instructions; the smallest such."""
    labels: dict[str, int] = {}
    ops: list[str] = []
    texts: list[str] = []
    branches: list[tuple[int, str]] = []
    for line in body:
        s = line.split(";", 1)[0].strip()
        if not s:
            continue
        m = re.match(r"^([\w.$]+):", s)
        if m:
            labels[m[1]] = len(ops)
            continue
        if s.startswith("."):
            continue
        op = s.split()[0]
        b = re.match(r"s_(?:branch|cbranch_\w+)\s+([\w.$]+)", s)
        if b:
            branches.append((len(ops), b[1]))
        ops.append(op)
        texts.append(s)
    spans = [(labels[t], i) for i, t in branches if t in labels and labels[t] <= i]
    if not spans:
        return None
    math_pat = MATRIX if any(MATRIX.match(op) for op in ops) else FMA
    n_math = {s: sum(bool(math_pat.match(op)) for op in ops[s[0] : s[1] + 1]) for s in spans}
    most = max(n_math.values())
    if most == 0:
        return None
    # the loops around the page loop hold its math too, and a little more (other paths)
    best = min((s for s in spans if 2 * n_math[s] >= most), key=lambda s: s[1] - s[0])
    return Loop(ops[best[0] : best[1] + 1], texts[best[0] : best[1] + 1])


def read_asm(path: Path, arch: str, kernel: re.Pattern, source: Path | None) -> list[Kernel]:
    text = path.read_text()
    meta = metadata(text)
    bodies, occupancy = functions(text)
    names = template_params(source, kernel)
    symbols = [s for s in meta if s in bodies]
    kernels: list[Kernel] = []
    for sym, dem in demangle(symbols).items():
        parsed = parse_template_args(dem)
        if parsed is None or not kernel.search(parsed[0]):
            continue
        name, args = parsed
        keys = names.get(name) or [f"p{i}" for i in range(len(args))]
        if len(keys) != len(args):
            keys = [f"p{i}" for i in range(len(args))]
        if keys and keys[0].startswith("p"):
            keys[0] = "F"  # the format is the first parameter of every instance so far
        params = dict(
            zip(
                keys,
                (str(int(a == "true")) if a in ("true", "false") else a for a in args),
                strict=True,
            )
        )
        k = Kernel(arch, sym, name, params, meta[sym])
        body = bodies[sym]
        k.calls = sum("s_swappc_b64" in line for line in body)
        k.occupancy_note = occupancy.get(sym, "")
        k.loop = page_loop(body)
        kernels.append(k)
    order = list(FORMATS.values())
    kernels.sort(
        key=lambda k: (
            order.index(k.fmt) if k.fmt in order else len(order),
            [int(v) for v in k.params.values() if v.lstrip("-").isdigit()],
        )
    )
    return kernels


# ---- the roofline -------------------------------------------------------------------------------
def mfma_cycles(arch: str) -> dict[str, int]:
    data = json.loads(LAYOUTS.read_text())
    return {inst: e["cycles"] for inst, e in data.get(arch, {}).items()}


def pick_instance(kernels: list[Kernel], fmt: str, vectors: int, per_tile: int):
    """The whole-page instance the launcher takes for ``vectors`` query vectors, and its passes:
    the fewest query tiles NT that hold them, else the most (several passes)."""
    whole = [
        k
        for k in kernels
        if k.fmt == fmt and k.params.get("S", "0") == "0" and k.params.get("W", "0") == "0"
    ]
    if not whole:
        return None, 0
    nts = sorted({int(k.params.get("NT", "1")) for k in whole})
    nt = next((n for n in nts if n * per_tile >= vectors), nts[-1])
    k = next(k for k in whole if int(k.params.get("NT", "1")) == nt)
    return k, math.ceil(vectors / (nt * per_tile))


@dataclass
class Row:
    gpu: Gpu
    fmt: str
    t: int
    kernel: Kernel
    passes: int
    iters: float  # page-loop iterations per page and pass
    hbm: float  # CU cycles a page's bytes take
    mfma: float  # CU cycles of a page's MFMA issue
    valu: float  # CU cycles of a page's VALU issue
    note: str = ""

    @property
    def compute(self) -> float:
        return max(self.mfma, self.valu)

    @property
    def ratio(self) -> float:
        return self.compute / self.hbm


def roofline(kernels: list[Kernel], gpu: Gpu, per_tile: int, ts=(1, 4, 8)) -> list[Row]:
    cycles = mfma_cycles(gpu.arch)
    rows = []
    for fmt, page in PAGE_BYTES.items():
        for t in ts:
            k, passes = pick_instance(kernels, fmt, t * HEADS, per_tile)
            if k is None or k.loop is None:
                continue
            note = ""
            if k.loop.key_bytes:
                iters = page / k.loop.key_bytes
            else:
                iters, note = 1.0, "no key loads in the loop: one iteration a page assumed"
            unknown = k.loop.unknown_mfma(cycles)
            if unknown:
                note = f"no cycle count for {', '.join(sorted(unknown))}"
            per_wave = iters * passes
            rows.append(
                Row(
                    gpu,
                    fmt,
                    t,
                    k,
                    passes,
                    iters,
                    hbm=page / gpu.hbm_bytes_per_cu_cycle,
                    mfma=per_wave * k.loop.mfma_cycles(cycles) / SIMDS,
                    valu=per_wave * k.loop.valu_cycles() / SIMDS,
                    note=note,
                )
            )
    return rows


# ---- output -------------------------------------------------------------------------------------
def resources_table(kernels: list[Kernel], gpu: Gpu) -> str:
    head = (
        "| instance | VGPRs (AGPRs) | SGPRs | waves/SIMD | LDS B | scratch B | spills V/S "
        "| calls | loop: MFMA | VALU | VMEM (key B) | LDS | SALU | scratch |"
    )
    lines = [head, "|" + " --- |" * 14]
    for k in kernels:
        m = k.meta
        waves = str(k.waves(gpu))
        if k.occupancy_note and k.occupancy_note != str(k.waves_vgpr):
            waves += f" (compiler: {k.occupancy_note})"
        lp = k.loop
        loop = (
            f"{lp.count('mfma')} | {lp.count('valu')} | {lp.count('vmem')} ({lp.key_bytes}) | "
            f"{lp.count('lds')} | {lp.count('salu')} | {lp.count('scratch')}"
            if lp
            else "- | - | - | - | - | -"
        )
        lines.append(
            f"| {k.fmt} {k.label()} | {k.vgprs} ({m.get('.agpr_count', 0)}) | "
            f"{m.get('.sgpr_count', 0)} | {waves} | {m.get('.group_segment_fixed_size', 0)} | "
            f"{m.get('.private_segment_fixed_size', 0)} | {m.get('.vgpr_spill_count', 0)}/"
            f"{m.get('.sgpr_spill_count', 0)} | {k.calls} | {loop} |"
        )
    return "\n".join(lines)


def roofline_table(rows: list[Row]) -> str:
    lines = [
        "| format | T | instance | passes | loop iters/page | HBM cycles | MFMA cycles "
        "| VALU cycles | compute / HBM | goal (<= 0.5) |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        ok = "yes" if r.ratio <= 0.5 else "no"
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.fmt} | {r.t} | {r.kernel.label()} | {r.passes} | {r.iters:g} | {r.hbm:.0f} | "
            f"{r.mfma:.0f} | {r.valu:.0f} | {r.ratio:.2f} | {ok}{note} |"
        )
    return "\n".join(lines)


def vectors_per_tile(source: Path | None) -> int:
    """Query vectors per query tile (config.h ``kVecsPerTile``; 8 when not found)."""
    config = source.parent / "config.h" if source else None
    if config and config.is_file():
        m = re.search(r"constexpr int kVecsPerTile\s*=\s*(\d+)", config.read_text())
        if m:
            return int(m[1])
    return 8


def compile_tree(source: Path, out: Path) -> None:
    """``source`` through this tree's ``.ci/compile-kernels``, its assembly kept in ``out``."""
    env = dict(os.environ, KERNEL_ASM_DIR=str(out))
    gate = [str(ROOT / ".ci" / "compile-kernels"), str(source)]
    proc = subprocess.run(["bash", *gate], env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f".ci/compile-kernels failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if source.stem != "score":
        for arch in ("gfx950", "gfx942"):
            kept = out / f"{source.stem}.{arch}.s"
            if kept.is_file():
                kept.rename(out / f"score.{arch}.s")


def summary_table(found: list[tuple[Gpu, list[Kernel], list[Row]]]) -> str:
    """One row per (format, T): per GPU the instance's registers, waves and compute / HBM."""
    head = "| format | T |" + "".join(
        f" {g.arch} VGPRs, waves | {g.arch} scratch B | {g.name} compute / HBM |"
        for g, _, _ in found
    )
    lines = [head, "|" + " --- |" * (2 + 3 * len(found))]
    keys = [(r.fmt, r.t) for r in found[0][2]] if found else []
    for fmt, t in keys:
        cells = []
        for _, _, rows in found:
            r = next((r for r in rows if (r.fmt, r.t) == (fmt, t)), None)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            scratch = r.kernel.meta.get(".private_segment_fixed_size", 0)
            cells += [f"{r.kernel.vgprs}, {r.kernel.waves(r.gpu)}", str(scratch), f"{r.ratio:.2f}"]
        lines.append(f"| {fmt} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(
    asm_dir: Path, source: Path | None, kernel: re.Pattern, per_tile: int | None, summary=False
) -> str:
    per_tile = per_tile or vectors_per_tile(source)
    parts = []
    found = []
    for gpu in GPUS:
        path = asm_dir / f"score.{gpu.arch}.s"
        if not path.is_file():
            continue
        kernels = read_asm(path, gpu.arch, kernel, source)
        rows = roofline(kernels, gpu, per_tile)
        found.append((gpu, kernels, rows))
        parts.append(f"### {gpu.arch} ({gpu.name}): {len(kernels)} scoring kernel instances\n")
        parts.append(resources_table(kernels, gpu) + "\n")
        parts.append(
            f"Roofline per page and CU, {gpu.name}: {gpu.hbm_bytes_per_cu_cycle:.1f} HBM bytes "
            f"a CU cycle; H = {HEADS}, {per_tile} query vectors a tile; estimates, not "
            "measurements.\n"
        )
        parts.append(roofline_table(rows) + "\n")
    if not found:
        sys.exit(f"no score.gfx950.s or score.gfx942.s in {asm_dir}")
    if summary:
        return summary_table(found)
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("asm_dir", nargs="?", help="folder of score.gfx9*.s (default: compile)")
    ap.add_argument(
        "--source",
        default=str(KERNELS / "score.hip"),
        help="the score.hip whose template parameters name the instances",
    )
    ap.add_argument(
        "--kernel", default=r"^score\w*kernel", help="regex of the scoring kernels' template names"
    )
    ap.add_argument(
        "--vectors-per-tile",
        type=int,
        default=None,
        help="query vectors per query tile (default: config.h kVecsPerTile)",
    )
    ap.add_argument(
        "--summary", action="store_true", help="one table: per (format, T) each target's estimate"
    )
    args = ap.parse_args()
    source = Path(args.source) if args.source else None
    pattern = re.compile(args.kernel)
    if args.asm_dir:
        print(report(Path(args.asm_dir), source, pattern, args.vectors_per_tile, args.summary))
        return
    with tempfile.TemporaryDirectory() as tmp:
        compile_tree(source, Path(tmp))
        print(report(Path(tmp), source, pattern, args.vectors_per_tile, args.summary))


if __name__ == "__main__":
    main()
