"""napkin's model against published attention measurements (H100, head dim 128).

    python benchmarks/model_vs_published.py [--csv benchmarks/data/published_attention_h100_d128.csv] [--json]

Each row of the CSV is one implementation at one shape, measured by its authors (the
``source`` column says where: FlashAttention-3's Fig. 5 for FA2 and FA3 on H100 SXM5, FP16).
The script writes that implementation as a napkin kernel with the row's tiles (a group of
``q_tile`` queries per thread block, keys and values streamed in chunks of ``kv_tile``), and
the register level the implementation uses:

* FA2 (``mma.sync``): four warps of 32 query rows each (``registers: group q 32``), priced for
  sm_90: FA2's code. napkin builds these 32-row warps on mma.sync itself (its rolled loop,
  isel.ROLLED_FRAGMENT_BUDGET; a causal row's masked chunks test the mask once, in place), and
  the row prices that build; a row napkin would not build on mma.sync is priced as a what-if
  there (``cost_of(arch="sm_90", path="mma.sync")``, the note says so);
* FA3 (``wgmma``): the code napkin builds for sm_90a (``cost_of(arch="sm_90a")``), with no
  register clause: wgmma's warpgroups of 64 rows take the register level (four warps share each
  read of K and V). A row whose launch does not select wgmma is left out, with isel's reason.
  Its warpgroups are priced under FA3's schedule (``overlap="pingpong+pipelined"``, a what-if:
  napkin's warpgroups are serial, hardware.OVERLAPS), whose FMA-pipe work runs under the
  products.

The FA3 pipelining ablation (``--ablation``, benchmarks/data/fa3_ablation_h100.csv, FA3's
Table 2) checks the schedules' overlap rules at one shape: each configuration priced under
its own schedule, at FA3's tile (a schedule napkin declines there is a what-if), then on
napkin's own builds at the tile its tuner picks for the shape.

It prices the kernel on the bundled H100 profile, converts the predicted time to TFLOP/s in the
papers' convention (4 b h s^2 d FLOPs forward, half of it when causal), and prints
``pred/meas - 1`` per row, then the median of its absolute value and the Spearman rank
correlation. Nothing here is fitted to the CSV: every rate and fixed cost comes from the profile,
whose comments give their sources.

Causal rows mask the scores with an index predicate, ``where(q >= x, S, -inf)``: the Program
never visits the key chunks above the diagonal and tests the predicate only on the chunks that
cross it. A row napkin cannot price is left out with the reason.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # napkin is the working tree: run without installing

CSV = ROOT / "benchmarks" / "data" / "published_attention_h100_d128.csv"
ABLATION = ROOT / "benchmarks" / "data" / "fa3_ablation_h100.csv"
DTYPES = {"fp16": "f16", "bf16": "bf16"}
# Per instruction path: the register clause, the architecture priced, and the what-if path (None:
# what napkin builds for that architecture).
REGISTERS = {"mma.sync": "    registers: group q 32\n", "wgmma": ""}
ARCH = {"mma.sync": "sm_90", "wgmma": "sm_90a"}
WHAT_IF = {"mma.sync": "mma.sync", "wgmma": None}
# Per instruction path, the warpgroup schedule the implementation runs (hardware.OVERLAPS; None:
# no warpgroups, mma.sync's warps).
OVERLAP = {"mma.sync": None, "wgmma": "pingpong+pipelined"}

SOURCE = """\
kernel attention(Q: {t}[b h q d], K: {t}[b h x d], V: {t}[b h x d]) -> O: {t}[b h q d]:
    S[b h q x] = Q[b h q d] * K[b h x d] * d^-0.5
    P[b h q x] = softmax[x]({scores})
    O[b h q d] = P[b h q x] * V[b h x d]

relabel attention on {gpu}:
    smem: group b 1, h 1, q {q_tile}; stream x {kv_tile}
{registers}"""


def published_flops(row: dict) -> float:
    b, h, s, d = (int(row[k]) for k in ("batch", "heads", "seqlen", "headdim"))
    flops = 4.0 * b * h * s * s * d
    return flops / 2 if row["causal"] == "true" else flops


def price(row: dict, overlap: str | None = None) -> dict:
    """napkin's prediction for one published row, or the reason it cannot price it. ``overlap``:
    the warpgroup schedule to price (default: the row's path's, :data:`OVERLAP`)."""
    import napkin_dsl as napkin
    from napkin_dsl.cost import cost_of
    from napkin_dsl.isel import select_program

    causal = row["causal"] == "true"
    text = SOURCE.format(t=DTYPES[row["dtype"]], gpu=row["gpu"], q_tile=row["q_tile"], kv_tile=row["kv_tile"],
                         registers=REGISTERS[row["instruction_path"]],
                         scores="where(q >= x, S, -inf)" if causal else "S")
    sizes = {"b": int(row["batch"]), "h": int(row["heads"]), "q": int(row["seqlen"]), "x": int(row["seqlen"]),
             "d": int(row["headdim"])}
    try:
        kernel = napkin.load(text)["attention"]
        program = kernel.program(row["gpu"], **sizes)
        arch, what_if = ARCH[row["instruction_path"]], WHAT_IF[row["instruction_path"]]
        schedule = overlap or OVERLAP[row["instruction_path"]]
        # the schedule built where napkin builds it at the row's tiles; where it declines a part
        # (the report's notes say why), the row's schedule priced as a what-if on the serial build
        built = select_program(program, arch, schedule=schedule) if schedule else select_program(program, arch)
        if any(getattr(chosen.plan, "order_declined", "") for chosen in built.launches.values()):
            built = select_program(program, arch)
        if all(chosen.path == row["instruction_path"] for chosen in built.launches.values()):
            what_if = None  # napkin builds this row's path itself: price its own code
        selected = built if what_if is None else select_program(program, arch, what_if)
        report = cost_of(program, arch=arch, path=what_if, selected=selected, overlap=schedule)
    except napkin.NapkinError as error:
        return {"skipped": str(error).splitlines()[0]}
    for chosen in selected.launches.values():  # priced on another path, it would not be this row's code
        if chosen.path != row["instruction_path"]:
            return {"skipped": f"{arch} selects {chosen.path}, not {row['instruction_path']}: "
                               f"{chosen.declined or chosen.reason}"}
    seconds = report.time["overlapped_s"]
    predicted = published_flops(row) / seconds / 1e12
    measured = float(row["measured_tflops"])
    return {"predicted_tflops": predicted, "measured_tflops": measured, "error": predicted / measured - 1,
            "bound": report.time["bound"], "blocks_per_sm": report.time.get("blocks_per_sm"),
            "fixed_us": sum(report.time["fixed_s"].values()) * 1e6, "notes": report.notes}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=False))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def _summary(priced: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in priced]
    return {"priced": len(priced), "median_abs_error": statistics.median(errors) if errors else None,
            "spearman": spearman([r["predicted_tflops"] for r in priced], [r["measured_tflops"] for r in priced])
            if len(priced) > 2 else None}


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CSV)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--ablation", action="store_true",
                        help="price FA3's pipelining ablation (benchmarks/data/fa3_ablation_h100.csv) instead")
    args = parser.parse_args(argv)
    if args.ablation:
        return ablation_main(args.json)
    with args.csv.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    results = [dict(row, **price(row)) for row in rows]
    summary = {"rows": len(results), "skipped": sorted({r["skipped"] for r in results if "skipped" in r})}
    for label, keep in (("non-causal", "false"), ("causal", "true"), ("all", None)):
        summary[label] = _summary([r for r in results if "skipped" not in r and keep in (None, r["causal"])])
    for impl in sorted({r["implementation"] for r in results}):
        summary[impl] = _summary([r for r in results if "skipped" not in r and r["implementation"] == impl])
    if args.json:
        print(json.dumps({"summary": summary, "rows": results}, indent=2))
        return 0
    header = f"{'impl':5} {'path':9} {'causal':6} {'b':>3} {'s':>6} {'tiles':>8} {'meas':>6} {'pred':>6} {'pred/meas-1':>11}  bound"
    print(header)
    print("-" * len(header))
    for r in results:
        tiles = f"{r['q_tile']}x{r['kv_tile']}"
        if "skipped" in r:
            print(f"{r['implementation']:5} {r['instruction_path']:9} {r['causal']:6} {r['batch']:>3} {r['seqlen']:>6} {tiles:>8} "
                  f"{float(r['measured_tflops']):6.0f}      -            -  skipped")
            continue
        print(f"{r['implementation']:5} {r['instruction_path']:9} {r['causal']:6} {r['batch']:>3} {r['seqlen']:>6} {tiles:>8} "
              f"{r['measured_tflops']:6.0f} {r['predicted_tflops']:6.0f} {r['error']:+11.3f}  {r['bound']}")
    print()
    for label in ("non-causal", "causal", "all", *sorted({r["implementation"] for r in results})):
        s = summary[label]
        print(f"{label:10} {s['priced']:2} rows priced: median |pred/meas - 1| = {_number(s['median_abs_error'])}, "
              f"Spearman = {_number(s['spearman'])}")
    for reason in summary["skipped"]:
        print(f"skipped: {reason}")
    return 0


def ablation() -> list[dict]:
    """FA3's pipelining ablation, each configuration priced under its own warpgroup schedule."""
    with ABLATION.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return [dict(row, **price(dict(row, implementation="FA3", instruction_path="wgmma"), row["overlap"])) for row in rows]


def tuned_tiles(row: dict) -> tuple[int, int]:
    """The (q, x) tiles napkin's tuner picks for attention at ``row``'s shape (no relabel block)."""
    import napkin_dsl as napkin

    text = SOURCE.split("relabel")[0].format(t=DTYPES[row["dtype"]], scores="S")
    kernel = napkin.load(text)["attention"]
    sizes = {"b": int(row["batch"]), "h": int(row["heads"]), "q": int(row["seqlen"]), "x": int(row["seqlen"]),
             "d": int(row["headdim"])}
    block = kernel.tune(row["gpu"], **sizes).relabel_block()  # "smem: group b 1, h 1, q 128; stream x 128"
    q_tile, kv_tile = re.search(r"group [^;\n]*\bq (\d+)", block), re.search(r"stream x (\d+)", block)
    if q_tile is None or kv_tile is None:
        raise AssertionError(f"the tuner's block groups no q or streams no x:\n{block}")
    return int(q_tile.group(1)), int(kv_tile.group(1))


def own_builds() -> list[dict]:
    """FA3's ablation priced on napkin's own builds: each configuration's schedule built (no
    what-if) at the tiles napkin's tuner picks for the ablation's shape."""
    with ABLATION.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    q_tile, kv_tile = tuned_tiles(rows[0])
    return [dict(row, q_tile=str(q_tile), kv_tile=str(kv_tile),
                 **price(dict(row, q_tile=str(q_tile), kv_tile=str(kv_tile), implementation="napkin", instruction_path="wgmma"),
                         row["overlap"]))
            for row in rows]


def ablation_main(as_json: bool) -> int:
    results, own = ablation(), own_builds()
    if as_json:
        print(json.dumps({"rows": results, "own_builds": own}, indent=2))
        return 0
    header = f"{'configuration':48} {'schedule':19} {'meas':>6} {'pred':>6} {'pred/meas-1':>11}"
    for title, table in ((f"at FA3's tiles ({results[0]['q_tile']} x {results[0]['kv_tile']}; a schedule napkin "
                          "declines there is priced as a what-if, and its notes say so)", results),
                         (f"napkin's own builds, at the tiles its tuner picks for this shape ({own[0]['q_tile']} x "
                          f"{own[0]['kv_tile']})", own)):
        print(title)
        print(header)
        print("-" * len(header))
        for r in table:
            pred, error = ("-", "skipped") if "skipped" in r else (f"{r['predicted_tflops']:.0f}", f"{r['error']:+.3f}")
            print(f"{r['configuration']:48} {r['overlap']:19} {float(r['measured_tflops']):6.0f} {pred:>6} {error:>11}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
