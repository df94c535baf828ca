"""What the generated kernels' main loops execute: SASS instruction counts at realistic sizes.

    python benchmarks/bench_sass.py [--arch sm_90a --arch sm_90 --arch sm_80] [--kernel causal ...]
    python benchmarks/bench_sass.py --ablation     # attention under each warpgroup schedule, side by side

Compiles, with NVRTC and no GPU, examples/attention.napkin at b=4 h=32 q=x=8192 d=128 (its
relabel block: group q 128, stream x 64), gqa.napkin (b=4 kv=8 r=4) and causal_attention.napkin
at the same sizes, sliding_window.napkin, examples/matmul.napkin and examples/fp8_matmul.napkin at m=n=k=8192 (group m
128, n 128, stream k 32 and 64), examples/mlp.napkin at b=n=k=8192 and examples/swiglu.napkin at
t=512 m=1024 f=2816 e=1024 (its two launches), examples/fp8_attention.napkin and fp8_attention_vt.napkin (V stored [b h d x]) at b=4 h=32 qb=64
qi=128 x=8192, d=128 and d=64, for sm_90a, sm_90 and sm_80, disassembles each cubin with nvdisasm
(``napkin_dsl.backends.sass``) and prints one row per launch: the hot loop's instructions, its
tensor-core instructions and instructions per tensor instruction ('-' without any), the same for
the leanest loop with as many tensor instructions (a masked stream's full chunks), its FFMAs,
LDSMs and async copies (LDGSTS and UTMALDG), and, for the whole kernel, its UTMALDG (TMA) and
SYNCS (mbarrier) instructions, local-memory instructions and ptxas's spill bytes, a warp-specialized
launch's roles (``sass.roles_summary``: setmaxnreg, the consumers' wait depths, no copies or block
barriers in their loop);
then the static ceiling of each launch (``sass.launch_ceiling``: the hot loop priced at the
profile's per-SM rates, sm_80 on A100, sm_90 and sm_90a on H100): its binding resource, the TFLOP/s it
allows the launch, and the model's prediction for the same launch.

The hot loop is :func:`~napkin_dsl.backends.sass.hot_loop`: the innermost loop with the most
tensor, then FFMA, instructions. Counts are static (each instruction once, however often it
runs). Not a test: it prints and asserts nothing; needs nvdisasm (``pip install
'napkin-dsl[sass]'``), no GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # napkin is the working tree: run without installing

EXAMPLES = ROOT / "examples"
# FA3's fp8 tile, and the examples' scales made per-tensor (FA3's descales: one a tensor)
FA3_FP8_TILE = "smem: group b 1, h 1, qb 1; stream x 128"
PER_TENSOR = {"sQ: f32[b h qb]": "sQ: f32", "sK: f32[b h x]": "sK: f32", "sV: f32[b h]": "sV: f32"}
# (label, file, kernel, sizes[, schedule, relabel, edits]); the tiles are the files' relabel blocks
# unless a relabel is given, the text the file's with ``edits`` (old -> new) made.
CASES = [
    ("attention", "attention.napkin", "attention", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128}),
    ("gqa", "gqa.napkin", "gqa", {"b": 4, "kv": 8, "r": 4, "q": 8192, "x": 8192, "d": 128}),
    ("causal", "causal_attention.napkin", "causal_attention", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128}),
    # a mask bounded on both sides: its chunks before, in and after the 256-key window
    ("sliding window", "sliding_window.napkin", "sliding_window", {"b": 4, "h": 32, "q": 8192, "x": 8192, "d": 128}),
    ("matmul", "matmul.napkin", "matmul", {"m": 8192, "n": 8192, "k": 8192}),
    # a product and its epilogue (bias, GELU) in one launch; swiglu's dual GEMM (G and U share X's
    # tiles, then H = silu(G) * U) and its down projection, at the sizes its relabel was tuned for
    ("mlp", "mlp.napkin", "mlp", {"b": 8192, "k": 8192, "n": 8192}),
    ("swiglu", "swiglu.napkin", "swiglu", {"t": 512, "m": 1024, "f": 2816, "e": 1024}),
    # mma.sync m16n8k32 e4m3 on sm_90 (ptxas: F2FP.F16.E4M3 + two HMMA.16816 each), FMA on sm_80
    ("fp8 matmul", "fp8_matmul.napkin", "fp8_matmul", {"m": 8192, "n": 8192, "k": 8192}),
    # FA3's form (O = P * V * sV, sV per head): on sm_90a both products on wgmma's 8-bit shape,
    # V copied K-major each chunk; on sm_90 m16n8k32 with P packed to e4m3, which at d = 128 sm_90
    # declines (its f16 conversions would spill: paths.mma_sync.CONVERTED_FP8_REGISTERS): the row is the FMA
    # path's; d = 64 is the tensor-core build there
    ("fp8 attention", "fp8_attention.napkin", "fp8_attention", {"b": 4, "h": 32, "qb": 64, "qi": 128, "x": 8192, "d": 128}),
    ("fp8 attention d64", "fp8_attention.napkin", "fp8_attention", {"b": 4, "h": 32, "qb": 64, "qi": 128, "x": 8192, "d": 64}),
    # the same with V stored keys fastest ([b h d x]): on sm_90a both products on wgmma's 8-bit
    # shape (QGMMA .E4M3), P from registers exchanged within quads into the ISA's key order
    ("fp8 attention vt", "fp8_attention_vt.napkin", "fp8_attention_vt", {"b": 4, "h": 32, "qb": 64, "qi": 128, "x": 8192, "d": 128}),
    ("fp8 attention vt d64", "fp8_attention_vt.napkin", "fp8_attention_vt", {"b": 4, "h": 32, "qb": 64, "qi": 128, "x": 8192, "d": 64}),
    # FA3's fp8 tile (128 x 128 at d = 128) with its per-tensor scales, both V layouts: every
    # scale in one loop-invariant factor, one multiply a score (issue 44's target: at most 1,300
    # issue clocks against 1,024 tensor clocks)
    ("fp8 attention fa3", "fp8_attention.napkin", "fp8_attention", {"b": 4, "h": 32, "qb": 64, "qi": 128, "x": 8192, "d": 128},
     None, FA3_FP8_TILE, PER_TENSOR),
    ("fp8 attention vt fa3", "fp8_attention_vt.napkin", "fp8_attention_vt", {"b": 4, "h": 32, "qb": 64, "qi": 128, "x": 8192, "d": 128},
     None, FA3_FP8_TILE, PER_TENSOR),
]
# FlashAttention-3's ablation (its Table 2: b=4 s=8448 h=16 d=128) on napkin's builds, side by side
# (``--ablation``, sm_90a): each warpgroup schedule (label, file, kernel, sizes, schedule) at the
# example's 128 x 64 tile; the pipelined order declines FA3's 176 keys (the packed P over the
# register budget), which the row's "roles" cell and the report's notes say.
ABLATION_SIZES = {"b": 4, "h": 16, "q": 8448, "x": 8448, "d": 128}
ABLATION = [(f"attention {schedule}", "attention.napkin", "attention", ABLATION_SIZES, schedule)
            for schedule in ("serial", "pipelined", "pingpong", "pingpong+pipelined")]
# and FA3's d = 64 tile (192 x 128: three consumer warpgroups at setmaxnreg 160, pingpong's ring
# of barriers 2, 3 and 4) at the same sizes; its 192 x 192 is refused (the fragments over the
# consumers' share of the registers)
ABLATION.append(("attention d64 192x128 pingpong+pipelined", "attention.napkin", "attention", dict(ABLATION_SIZES, d=64),
                 "pingpong+pipelined", "smem: group b 1, h 1, q 192; stream x 128"))
ARCHES = ("sm_90a", "sm_90", "sm_80")  # sm_90a: wgmma (matmul by descriptor and TMA, attention with P from registers)
GPU = {"sm_80": "A100", "sm_90": "H100", "sm_90a": "H100"}  # the profile each arch is priced on


def lean(entry: dict, hot: dict) -> str:
    """Instructions per tensor instruction of the leanest loop with as many tensor instructions as
    the hot loop: a masked stream's loop over the chunks its mask holds in full (no selects),
    which runs for all but the diagonal's chunks; the hot loop's own figure elsewhere."""
    tensor = hot["classes"].get("tensor", 0)
    loops = [loop for loop in entry["loops"] if tensor and loop["classes"].get("tensor", 0) == tensor]
    return "-" if not loops else f"{min(loop['per_tensor'] for loop in loops):.2f}"


def roles_cell(entry: dict) -> str:
    """A warp-specialized launch's roles (``sass.roles_summary``): setmaxnreg's producer/consumer
    counts, the depths the consumers' waits leave in flight, and the UTMALDGs and block barriers
    in their loop ('-' for a launch without roles)."""
    roles = entry.get("roles")
    if roles is None:
        return "-"
    moves = roles["setmaxnreg"]
    consumer = roles.get("consumer_loop", {})
    depths = ",".join(str(d) for d in consumer.get("wait_depths", [])) or "?"
    return (f"{moves.get('DEALLOC', '?')}/{moves.get('TRY_ALLOC', '?')} regs, waits {depths}, "
            f"{consumer.get('utmaldg', '?')} TMA/{consumer.get('block_barriers', '?')} BAR/"
            f"{consumer.get('consumer_barriers', '?')} named in loop")


def issue_per_tensor(entry: dict) -> str:
    """The hot loop's issue clocks per 1,024 of its tensor clocks (a d = 128 attention's chunk of
    128 keys on one SM's tensor cores), from the static ceiling's clocks; '-' without tensor work."""
    clocks = (entry["ceiling"].get("loop") or {}).get("clocks") or {}
    if not clocks.get("tensor"):
        return "-"
    return f"{clocks['issue'] / clocks['tensor'] * 1024:.0f}"


def rows(arches, cases=CASES) -> list[list[str]]:
    import napkin_dsl as napkin
    from napkin_dsl.backends.sass import disassemble, hot_loop, sass_report

    out = []
    for label, file, name, sizes, *rest in cases:
        # an ablation row's schedule, its tile where not the file's, and edits of the file's text
        schedule, relabel, edits = (rest + [None, None, None])[:3]
        text = (EXAMPLES / file).read_text()
        for old, new in (edits or {}).items():
            assert old in text, f"{file} has no {old!r} to edit"
            text = text.replace(old, new)
        kernel = napkin.load(text)[name]
        kernel = kernel.relabelled(relabel) if relabel else kernel
        for arch in arches:
            compiled = kernel.compile(arch, GPU.get(arch), overlap=schedule, **sizes)
            report = sass_report(compiled)
            listing = disassemble(compiled.image)
            for entry in report["launches"]:
                # Hopper's copies and barriers in the whole kernel: TMA (UTMALDG) and mbarriers (SYNCS)
                bases = [i.base for i in listing.get(entry["entry"], [])]
                loop = hot_loop(entry) or {"instructions": 0, "classes": {}, "per_tensor": None}
                classes = loop["classes"]
                out.append([
                    label if len(report["launches"]) == 1 else f"{label} ({entry['entry']})",
                    arch,
                    str(loop["instructions"]),
                    str(classes.get("tensor", 0)),
                    "-" if loop["per_tensor"] is None else f"{loop['per_tensor']:.2f}",
                    lean(entry, loop),
                    str(classes.get("ffma", 0)),
                    str(classes.get("ldsm", 0)),
                    str(classes.get("ldgsts", 0)),
                    str(bases.count("UTMALDG")),
                    str(bases.count("SYNCS")),
                    str(entry["whole"].get("local", 0)),
                    "?" if entry["spill_bytes"] is None else str(entry["spill_bytes"]),
                    roles_cell(entry),
                    entry["ceiling"]["binding"] or "-",
                    "-" if entry["ceiling"]["tflops"] is None else f"{entry['ceiling']['tflops']:.1f}",
                    "-" if entry["ceiling"]["model_tflops"] is None else f"{entry['ceiling']['model_tflops']:.1f}",
                    issue_per_tensor(entry),
                ])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="sm_90a, sm_90, sm_80 (repeatable; default all three)")
    parser.add_argument("--kernel", action="append", help="a row label (repeatable; default every case)")
    parser.add_argument("--ablation", action="store_true",
                        help="FlashAttention-3's ablation on napkin's builds: attention under each warpgroup schedule (sm_90a)")
    args = parser.parse_args(argv)
    if args.ablation:
        args.arch = args.arch or ["sm_90a"]
    cases = [case for case in (ABLATION if args.ablation else CASES) if not args.kernel or case[0] in args.kernel]
    if not cases:
        parser.error(f"no case is labelled {args.kernel}; the labels: {', '.join(case[0] for case in CASES)}")

    header = ["kernel", "arch", "hot-loop instrs", "tensor", "instrs/tensor", "leanest", "FFMA", "LDSM", "LDGSTS",
              "UTMALDG (kernel)", "SYNCS (kernel)", "local ops (kernel)", "spill B", "roles", "binding", "ceiling TFLOP/s",
              "model TFLOP/s", "issue/1024 tensor clk"]
    table = [header, *rows(args.arch or ARCHES, cases)]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    for row in table:
        print("  ".join([row[0].ljust(widths[0]), row[1].ljust(widths[1])] + [cell.rjust(w) for cell, w in zip(row[2:], widths[2:], strict=False)]))
    print()
    print("hot-loop columns count the innermost loop with the most tensor, then FFMA, instructions; static counts")
    print("leanest: instructions per tensor instruction of the leanest loop with the hot loop's tensor count (a"
          " masked stream's loop over its full chunks)")
    print("roles: a warp-specialized launch's setmaxnreg (producer/consumers), the depths its consumers' wgmma waits"
          " leave in flight, and the UTMALDGs and block barriers in their loop (none: the producer issues the copies)")
    print("ceiling: the hot loop's binding resource and the launch's TFLOP/s at it (an upper bound); model: the"
          " cost model's prediction for the built kernel")
    print("issue/1024 tensor clk: the hot loop's issue clocks per 1,024 of its tensor clocks (static ceiling)")
    for label, _, _, sizes, *rest in cases:
        tile = f" ({rest[1]})" if len(rest) > 1 and rest[1] else ""
        edits = "; scales per tensor" if len(rest) > 2 and rest[2] else ""
        print(f"  {label}: " + " ".join(f"{axis}={size}" for axis, size in sizes.items()) + tile + edits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
