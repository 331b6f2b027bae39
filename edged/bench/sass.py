"""`edged bench sass`: the decode GEMV's inner loop as the GPU would run it, counted without a GPU.

Triton compiles the M = 1 launch that `linear` would make for each decode shape (its launch rule, for an
H200's 132 SMs) to SASS for sm_90 on this machine (Triton's own ptxas and nvdisasm), and this prints the
instructions of the kernel's longest loop per weight it streams, and how many of them move data through
shared memory or between threads (a layout conversion the loop should not have). A GEMV of this kind is
bound by that issue rate once it is below HBM speed, so the count shows the effect of a kernel change
before any device time is spent (docs/BENCHMARKS.md, issue 16). It also prints the registers a thread
holds (ptxas' count, read by cuobjdump), how many programs an SM keeps at once by them, and how many waves
the launch makes of those: the loads a GEMV has in flight, and the part-empty last wave.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from edged.kernels import triton_linear as tlin

H200_SMS = 132
SHARED_OR_SHUFFLE = ("BAR", "SHFL", "LDS", "STS", "STSM", "LDSM")
# an sm_90 SM's limits on resident programs (CUDA occupancy rules): registers, warps, blocks, shared memory
SM_REGISTERS, SM_WARPS, SM_BLOCKS, SM_SHARED, BLOCK_SHARED_RESERVED = 65536, 64, 32, 233472, 1024


@dataclass
class LoopStats:
    """The longest loop of a compiled kernel: its instructions, by opcode, and the weights an iteration of
    one thread streams."""

    instructions: int
    opcodes: collections.Counter
    weights_per_iteration: float

    @property
    def per_weight(self) -> float:
        return self.instructions / self.weights_per_iteration

    @property
    def shared_or_shuffle(self) -> int:
        return sum(self.opcodes[op] for op in SHARED_OR_SHUFFLE)


@dataclass
class Residency:
    """What one program of a compiled kernel holds (ptxas' count), and how many of them an sm_90 SM keeps
    at once: a GEMV streams only as many bytes as its resident programs have loads in flight."""

    registers: int  # per thread
    shared: int  # bytes per program
    num_warps: int
    stack: int = 0  # bytes a thread spills to local memory (under a register cap)

    @property
    def programs_per_sm(self) -> int:
        per_warp = -(-self.registers * 32 // 256) * 256  # registers are given to a warp 256 at a time
        by_shared = SM_SHARED // (self.shared + BLOCK_SHARED_RESERVED)
        return min(SM_REGISTERS // (per_warp * self.num_warps), SM_WARPS // self.num_warps, SM_BLOCKS, by_shared)

    def waves(self, programs: int, sms: int = H200_SMS) -> float:
        """The launch's programs over what all SMs keep at once: a fraction above a whole number is a last
        wave that leaves SMs part idle."""
        return programs / (sms * self.programs_per_sm)


def _read_cubin(compiled, tool: str, *flags: str) -> str:
    """What one of Triton's own CUDA tools (nvdisasm, cuobjdump) prints of a compiled kernel's cubin."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(path), *flags, cubin.name], capture_output=True, text=True, check=True).stdout


def _compile(fn, sig: dict, consts: dict, attrs: dict, arch: int, cfg: tlin.LinearConfig):
    """triton.compile of one launch for a GPU that need not be here, with cfg's warps, stages and register cap."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cap = {"maxnreg": cfg.max_registers} if cfg.max_registers else {}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                   "enable_fp_fusion": True, **cap})  # as the kernels launch (a * b + c -> FMA)


def residency(compiled, num_warps: int) -> Residency:
    """Registers and shared memory of a compiled kernel, as cuobjdump (shipped with Triton) reads its cubin."""
    usage = _read_cubin(compiled, "cuobjdump", "--dump-resource-usage")
    found = {key: re.search(rf"{key}:(\d+)", usage) for key in ("REG", "SHARED", "STACK")}
    if not all(found.values()):
        raise RuntimeError(f"cuobjdump gave no resource usage: {usage!r}")
    return Residency(int(found["REG"].group(1)), int(found["SHARED"].group(1)), num_warps, int(found["STACK"].group(1)))


def longest_loop(sass: str) -> list[str]:
    """The instructions from a backward branch's target to the branch, for the longest such loop."""
    labels: dict[str, int] = {}
    instrs: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            addr = int(ins.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            instrs.append((addr, ins.group(2).strip()))
    best: list[str] = []
    for addr, text in instrs:
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), addr + 1) <= addr:
            body = [t for a, t in instrs if labels[branch.group(1)] <= a <= addr]
            best = max(best, body, key=len)
    return best


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def _signature(fn, pointers: dict[str, str], ints: dict[str, int], constexprs: dict[str, object]):
    """Triton's signature, constexprs and argument attributes for a launch: pointers 16-byte aligned, and
    what its JIT would note of each integer (divisible by 16), as for a real launch of these values."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ints:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, {k: v for k, v in constexprs.items() if k in fn.arg_names}, attrs


def _step(fmt: str, cfg: tlin.LinearConfig) -> int:
    """Columns of x a K step covers in the w8 GEMV, bytes of a row in the w4 one (two weights a byte)."""
    return max(16, cfg.block_k // 2) if fmt == "w4" else cfg.block_k


def compile_gemv(fmt: str, n: int, k: int, arch: int = 90, max_registers: int | None = None, mma_order: bool = True,
                 **forms: bool):
    """Triton's compiled decode GEMV of an [n, k] w8 or w4 weight and bf16 x, as `linear` launches it on
    an H200, with the fused forms given (NORM, SILU, RESIDUAL, HAS_BIAS, GATED: off unless named), and
    the launch rule's config (its registers capped at max_registers where given, as
    LinearConfig.max_registers caps them); w8 in the MMA order, as a model's weights are on a GPU, unless
    mma_order is False. Compiles for the GPU without one (Triton's own ptxas)."""
    cfg = tlin.choose_config(1, n, k, fmt, torch.device("cuda"), sm_count=H200_SMS)
    cfg = replace(cfg, max_registers=max_registers or cfg.max_registers)
    common = dict(HAS_BIAS=False, SPLIT=cfg.split > 1, GROUP_SIZE=32, ROWS=cfg.block_n, NORM=False, SILU=False,
                  RESIDUAL=False, PDL=arch >= 90, ASM=True, GATED=False, EXACT=False, SYM=fmt == "w8")
    common.update(forms)
    step = _step(fmt, cfg)
    if fmt == "w4":
        fn, row = tlin._gemv_w4_kernel, k // 2
        constexprs = dict(common, X_KIND=0, EVEN_K=row % step == 0, BLOCK_KB=step)
        pointers = {"xw_ptr": "*i32", "w_ptr": "*u8", "nw_ptr": "*i32"}
    elif fmt == "w8":
        fn, row = tlin._gemv_kernel, k
        constexprs = dict(common, FORMAT=1, EVEN_K=k % step == 0, BLOCK_K=step, VEC=16,
                          QUARTER_XSUM=tlin.quarter_xsum(k), MMA=mma_order)
        pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "nw_ptr": "*bf16"}
    else:
        raise ValueError(f"edged bench sass counts the w8 and w4 GEMVs, not {fmt!r}")
    per, _ = tlin._k_split(row, step, cfg.split)  # as linear() splits the row
    ints = {"N": n, "K": k, "KB": row, "k_per_split": per, "kb_per_split": per, "num_splits": cfg.split,
            "stride_wn": row, "stride_sn": k // 32}
    pointers.update({"scale_ptr": "*fp16", "min_ptr": "*fp16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                     "part_ptr": "*fp32", "counters_ptr": "*i32", "res_ptr": "*bf16"})
    return _compile(fn, *_signature(fn, pointers, ints, constexprs), arch, cfg), cfg


def compile_gemv_x_rows(n: int, k: int, xrows: int, arch: int = 90, sym: bool = True, fmt: str = "w8",
                        mma_order: bool = True):
    """Triton's compiled GEMV of several x rows (bf16) against an [n, k] w8 or w4 weight, as `linear`
    launches it on an H200 (its launch rule for 2 sequences: the kernel takes 1-8 rows of x a launch, 1-4
    for w4, with that config); w8 in the MMA order unless mma_order is False."""
    cfg = tlin.choose_config(2, n, k, fmt, torch.device("cuda"), sm_count=H200_SMS)
    step = _step(fmt, cfg)
    row = k // 2 if fmt == "w4" else k
    per, _ = tlin._k_split(row, step, cfg.split)
    constexprs = dict(HAS_BIAS=False, SPLIT=cfg.split > 1, EVEN_K=row % step == 0, GROUP_SIZE=32, ROWS=cfg.block_n,
                      XROWS=xrows, RESIDUAL=True, PDL=arch >= 90, ASM=True, EXACT=False)
    pointers = {"w_ptr": "*u8", "scale_ptr": "*fp16", "min_ptr": "*fp16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                "part_ptr": "*fp32", "res_ptr": "*bf16"}
    ints = {"M": xrows, "N": n, "stride_wn": row, "stride_sn": k // 32, "stride_om": n, "stride_rm": n}
    if fmt == "w4":
        fn = tlin._gemv_w4_x_rows_kernel
        constexprs.update(X_KIND=0, BLOCK_KB=step)
        pointers["xw_ptr"] = "*i32"
        ints.update(KB=row, kb_per_split=per, stride_xw=row)
    else:
        fn = tlin._gemv_x_rows_kernel
        constexprs.update(FORMAT=1, BLOCK_K=step, VEC=16, SYM=sym, QUARTER_XSUM=tlin.quarter_xsum(k), MMA=mma_order)
        pointers["x_ptr"] = "*bf16"
        ints.update(K=k, k_per_split=per, stride_xm=k)
    return _compile(fn, *_signature(fn, pointers, ints, constexprs), arch, cfg), cfg


def compile_matmul(fmt: str, m: int, n: int, k: int, arch: int = 90, mma_order: bool = True):
    """Triton's compiled batched decode matmul of m rows of x (bf16) against an [n, k] weight (symmetric w8, or
    w4), as `linear` launches it on an H200 (its launch rule's tile, form and K split); w8 in the MMA order
    unless mma_order is False."""
    cfg = tlin.choose_config(m, n, k, fmt, torch.device("cuda"), sm_count=H200_SMS, mma_order=fmt == "w8" and mma_order)
    if cfg.kind != "matmul":
        raise ValueError(f"{m} rows of x against [{n}, {k}] {fmt} launch a {cfg.kind}, not the matmul")
    block_k = max(cfg.block_k, 32)
    per, split = tlin._k_split(k, block_k, max(1, cfg.split))  # as linear() splits the row
    w8 = fmt == "w8"
    constexprs = dict(FORMAT=1 if w8 else 2, HAS_BIAS=False, SPLIT=split > 1, EVEN_K=k % block_k == 0,
                      GROUP_SIZE=32, ROW_GROUP=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                      GROUP_M=8, RESIDUAL=False, SWAP=cfg.swap, PREFETCH=cfg.prefetch and w8, SYM=w8,
                      PDL=arch >= 90, ASM=w8 and (cfg.asm_dequant or (mma_order and cfg.swap)),
                      PART_EVICT="evict_last" if m <= cfg.block_m else "", MMA=w8 and mma_order)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "scale_ptr": "*fp16", "min_ptr": "*fp16", "bias_ptr": "*bf16",
                "out_ptr": "*bf16", "part_ptr": "*fp32", "res_ptr": "*bf16"}
    ints = {"M": m, "N": n, "K": k, "k_per_split": per, "stride_xm": k, "stride_wn": k if w8 else k // 2,
            "stride_sn": k // 32, "stride_om": n, "stride_rm": n}
    fn = tlin._matmul_kernel
    return _compile(fn, *_signature(fn, pointers, ints, constexprs), arch, cfg), cfg


def ptxas_info(compiled, arch: int = 90) -> str:
    """What Triton's own ptxas says of a compiled kernel's PTX with -v: its resources, and its performance
    notes (C7515: the wgmma instructions serialized, each waited for before the next issues)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path  # the one Triton compiles with (3.9 takes its newer ptxas for sm_90)
    suffix = "a" if arch >= 90 else ""  # wgmma is in sm_90a only
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    return run.stdout + run.stderr


def gemv_loop(fmt: str, n: int, k: int, arch: int = 90) -> tuple[LoopStats, tlin.LinearConfig]:
    """Compile the bf16 decode GEMV of an [n, k] w8 or w4 weight as `linear` launches it on an H200 and
    count its K loop."""
    stats, _, cfg = gemv_loop_and_residency(fmt, n, k, arch)
    return stats, cfg


def gemv_loop_and_residency(fmt: str, n: int, k: int, arch: int = 90, max_registers: int | None = None
                            ) -> tuple[LoopStats, Residency, tlin.LinearConfig]:
    """gemv_loop, with what a program of that GEMV holds and how many an SM keeps."""
    compiled, cfg = compile_gemv(fmt, n, k, arch, max_registers)
    step_weights = _step(fmt, cfg) * (2 if fmt == "w4" else 1)
    stats = _loop_stats(compiled, cfg.block_n * step_weights / (32 * cfg.num_warps))
    return stats, residency(compiled, cfg.num_warps), cfg


def gemv_x_rows_loop(n: int, k: int, xrows: int, arch: int = 90,
                     fmt: str = "w8") -> tuple[LoopStats, tlin.LinearConfig]:
    """compile_gemv_x_rows' K loop counted; weights_per_iteration counts each weight once, however many
    rows of x it meets."""
    compiled, cfg = compile_gemv_x_rows(n, k, xrows, arch, fmt=fmt)
    step_weights = _step(fmt, cfg) * (2 if fmt == "w4" else 1)
    return _loop_stats(compiled, cfg.block_n * step_weights / (32 * cfg.num_warps)), cfg


def _loop_stats(compiled, weights_per_iteration: float) -> LoopStats:
    """The longest loop of a compiled kernel's SASS (nvdisasm, shipped with Triton), counted."""
    body = longest_loop(_read_cubin(compiled, "nvdisasm", "-c"))
    return LoopStats(len(body), collections.Counter(opcode(t) for t in body), weights_per_iteration)


def run_sass_bench(args: argparse.Namespace) -> int:
    from .kernels import decode_shapes

    shapes = decode_shapes()
    wanted = [s.strip() for s in args.shapes.split(",")] if args.shapes else list(shapes)
    unknown = [s for s in wanted if s not in shapes]
    if unknown:
        print(f"edged bench sass: unknown shapes {unknown}; known: {', '.join(shapes)}", file=sys.stderr)
        return 2
    import triton

    # the loop is this Triton's: the GPU machine's may differ (3.6 regroups SmolLM2's x sums where 3.9 does not)
    print(f"decode GEMV (M = 1, bf16 x) compiled by Triton {triton.__version__} for sm_{args.arch}, as launched on an "
          "H200; its K loop per thread and step; registers a thread and bytes it spills, programs an SM keeps "
          f"(occupancy), the launch's programs and its waves over {H200_SMS} SMs")
    print(f"{'shape':26} {'N x K':>14} {'fmt':4} {'rows':>4} {'cols':>5} {'instr':>6} {'/weight':>8} "
          f"{'shared/shfl':>11} {'regs':>4} {'stack':>5} {'prog/SM':>7} {'programs':>8} {'waves':>6}  top opcodes")
    for name in wanted:
        n, k = shapes[name]
        for fmt in args.quant.split(","):
            stats, held, cfg = gemv_loop_and_residency(fmt, n, k, args.arch, args.max_registers)
            programs = -(-n // cfg.block_n) * cfg.split
            top = " ".join(f"{op} {c}" for op, c in stats.opcodes.most_common(5))
            print(f"{name:26} {f'{n}x{k}':>14} {fmt:4} {cfg.block_n:>4} {cfg.block_k:>5} {stats.instructions:>6} "
                  f"{stats.per_weight:>8.2f} {stats.shared_or_shuffle:>11} {held.registers:>4} {held.stack:>5} "
                  f"{held.programs_per_sm:>7} {programs:>8} {held.waves(programs):>6.2f}  {top}", flush=True)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", help="decode shapes by name, comma-separated, e.g. 'llama-3-8b gate_up' "
                                         "(default: every linear of SmolLM2, Llama-3.2-1B and Llama-3-8B)")
    parser.add_argument("--quant", default="w8,w4", help="weight formats: w8, w4 or both (default: w8,w4)")
    parser.add_argument("--max-registers", type=int, default=None, metavar="N",
                        help="cap each GEMV's registers a thread at N (ptxas' maxnreg, as LinearConfig.max_registers "
                             "does; default: the launch rule's, no cap)")
    parser.add_argument("--arch", type=int, default=90, help="the CUDA compute capability to compile for, "
                                                             "as major * 10 + minor (default: 90, Hopper)")
