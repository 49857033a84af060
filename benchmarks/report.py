"""JSON lines of a benchmark run -> a markdown table and a PNG plot of the ratios.

    python -m benchmarks.report benchmarks/results/h200.json      # writes h200.md, h200.png
    python -m benchmarks.report h200.json --merge shard0.json shard1.json   # shards first

``ratio`` is the faster FLA route's time over torch_dplr's (above 1: torch_dplr is faster);
``ratio_wind`` is wind_rwkv's ``chunked_cuda`` time over torch_dplr's.
When the run has ``stage`` records (:mod:`benchmarks.stages`), a "Where the time goes" table per
cell gives each stage op's time, bytes and achieved bandwidth, and the stages' sum against the
end-to-end time.  When a cell was measured more than once (``--resume``, reruns), its last
record counts.
A hand-written analysis of a run (why a target is missed, what was tried) lives beside it as
``<stem>-notes.md`` and is appended to the markdown, so regenerating the table keeps it.
matplotlib is optional: without it the plot is skipped with a message.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SECTIONS = (  # (title, mode, policy or None for the shipped recompute policy)
    ("Forward (no grad)", "fwd", "none"),
    ("Forward+backward, no checkpointing vs FLA `disable_recompute=True`", "fwd_bwd", "none"),
    ("Forward+backward, torch_dplr policy `{policy}` vs FLA's default recompute", "fwd_bwd", None),
)
TARGETS = {"fwd": 0.7, "fwd_bwd": 3.0}  # ms at the design shape, chunk 64
HBM_GB_S = 4300.0  # what an H200 sustains (benchmarks.stages.HBM_GB_S)
DESIGN = dict(B=8, T=4096, H=32, D=64, N=None)
COLD_S, WARM_S = 30.0, 2.0


def load(path) -> list[dict]:
    """Records in file order, one per cell (the last one written wins)."""
    latest = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            latest[record.get("cell") or json.dumps(record, sort_keys=True)] = record
    return list(latest.values())


_MODE_ORDER = ("fwd", "fwd_bwd", "stage", "stage_sum", "first_call")


def _envelope_position(record: dict) -> tuple:
    """Where a record's cell sits in the envelope's order (shape, gates, chunk size, state,
    mode, policy), first_call records last; records of unknown shapes, gate styles or modes
    go after the known ones, in their order."""
    from . import cells

    shapes = [(s.B, s.T, s.H, s.D, s.N) for s in cells.SHAPES]
    gates = list(cells.GATE_CHUNKS)
    shape = tuple(record.get(k) for k in ("B", "T", "H", "D", "N"))
    mode = record.get("mode")
    return (mode == "first_call",
            shapes.index(shape) if shape in shapes else len(shapes),
            gates.index(record["gates"]) if record.get("gates") in gates else len(gates),
            record.get("chunk_size") or 0, bool(record.get("state")),
            _MODE_ORDER.index(mode) if mode in _MODE_ORDER else len(_MODE_ORDER),
            record.get("policy") not in (None, "none"))


def merge(parts, out) -> int:
    """The JSON lines of ``parts`` (e.g. the shards of ``bench --shard``) in one file ``out``,
    in the envelope's order; returns the number of records.  A cell in several parts keeps
    every record; :func:`load` then takes the one of the last part named."""
    records = [json.loads(line) for part in parts
               for line in Path(part).read_text().splitlines() if line.strip()]
    records.sort(key=_envelope_position)  # stable: a cell's stage records keep their order
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in records))
    return len(records)


def _num(x, fmt="{:.3f}"):
    return "–" if x is None else fmt.format(x)


def _shape(r) -> str:
    seqs = f" N{r['N']}" if r.get("N") is not None else ""
    return f"B{r['B']} T{r['T']}{seqs} H{r['H']} D{r['D']}"


def shipped_policy(records) -> str | None:
    return next((r["policy"] for r in records if r.get("mode") == "fwd_bwd"
                 and r.get("policy") not in (None, "none")), None)


def section_rows(records, mode, policy) -> list[dict]:
    return [r for r in records if r.get("mode") == mode and r.get("policy") == policy]


def _tilelang_cell(r) -> str:
    if r.get("fla_tilelang_fallback"):
        return "→Triton"
    return _num(r.get("fla_tilelang_ms"))


def _errors(r) -> str:
    return "; ".join(f"{k[:-6]}: {v}" for k, v in r.items() if k.endswith("_error") and v)


def _wind_cell(r) -> str:
    return "refused" if r.get("wind_refusal") else _num(r.get("wind_ms"))


def table(rows) -> list[str]:
    lines = ["| shape | chunk | gates | state | torch_dplr ms | FLA Triton ms | FLA TileLang ms "
             "| wind_rwkv ms | ratio | ratio wind | peak MB torch_dplr / FLA / wind |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "–" if r.get("ratio") is None else f"**{r['ratio']:.2f}x**"
        ratio_wind = "–" if r.get("ratio_wind") is None else f"{r['ratio_wind']:.2f}x"
        peaks = " / ".join(_num(r.get(k), "{:.0f}") for k in ("torch_dplr_peak_mb", "fla_peak_mb",
                                                              "wind_peak_mb"))
        lines.append(f"| {_shape(r)} | {r['chunk_size']} | {r['gates']} | {'yes' if r['state'] else 'no'} "
                     f"| {_num(r.get('torch_dplr_ms'))} | {_num(r.get('fla_triton_ms'))} "
                     f"| {_tilelang_cell(r)} | {_wind_cell(r)} | {ratio} | {ratio_wind} | {peaks} |")
    return lines


def wind_refusals(records) -> list[str]:
    """Why wind_rwkv did not run cells: each reason once, with its cell count (empty: none)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.get("wind_refusal"):
            counts[r["wind_refusal"]] = counts.get(r["wind_refusal"], 0) + 1
    if not counts:
        return []
    return ["", "## wind_rwkv: cells it does not run", "", "| cells | reason |", "|---|---|"] + [
        f"| {n} | {reason} |" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def _is_design(r) -> bool:
    return all(r.get(k) == v for k, v in DESIGN.items()) and r.get("chunk_size") == 64 \
        and r.get("gates") == "rwkv7"


def _verdict(ok) -> str:
    return "–" if ok is None else ("yes" if ok else "**no**")


def target_rows(records) -> list[tuple[str, str, bool | None]]:
    """(target, measured, holds) for each target of issue 4 that the records cover."""
    cells = [r for r in records if r.get("mode") in TARGETS]
    out = []
    for mode, bound in TARGETS.items():
        design = [r["torch_dplr_ms"] for r in cells if r["mode"] == mode and _is_design(r)
                  and r.get("policy") == "none" and r.get("torch_dplr_ms") is not None]
        if design:
            out.append((f"design shape, chunk 64, {mode} <= {bound} ms (worst of with/without state)",
                        f"{max(design):.3f} ms", max(design) <= bound))
    ratios = [(r["ratio"], r["cell"]) for r in cells if r.get("ratio") is not None]
    if ratios:
        worst = min(ratios)
        below = sum(x < 1.5 for x, _ in ratios)
        out.append(("every cell >= 1.5x the faster FLA route",
                    f"{below} of {len(ratios)} cells below; worst {worst[0]:.2f}x ({worst[1]})",
                    below == 0))
        out.append(("no cell below 1.0x", f"{sum(x < 1.0 for x, _ in ratios)} cells below",
                    worst[0] >= 1.0))
    for policy, fla_setting in (("none", "FLA disable_recompute=True"), (None, "FLA default")):
        pol = policy or shipped_policy(records)
        pairs = [(r["torch_dplr_peak_mb"], r["fla_peak_mb"]) for r in cells
                 if r["mode"] == "fwd_bwd" and r.get("policy") == pol
                 and r.get("torch_dplr_peak_mb") is not None and r.get("fla_peak_mb") is not None]
        if pairs:
            over = sum(ours > theirs for ours, theirs in pairs)
            out.append((f"fwd_bwd peak memory, policy {pol} <= {fla_setting}",
                        f"{over} of {len(pairs)} cells above", over == 0))
    for r in records:
        if r.get("mode") == "first_call":
            for key, bound in (("cold_s", COLD_S), ("warm_s", WARM_S)):
                value = r.get(key)
                out.append((f"first call, {key[:-2]} cache <= {bound:g} s",
                            _num(value, "{:.2f} s"), None if value is None else value <= bound))
    return out


def _preamble(records) -> list[str]:
    meta = next((r for r in records if r.get("device")), {})
    cuda = meta.get("device", "cpu") != "cpu"
    fla = f"flash-linear-attention {meta['fla']}" if meta.get("fla") else "flash-linear-attention (not run)"
    wind = f"wind_rwkv {meta['wind_rwkv']}" if meta.get("wind_rwkv") else "wind_rwkv (not run)"
    clock = ("CUDA events, L2 flushed between reps" if cuda
             else "host clock (CPU smoke test: the times mean nothing)")
    return [f"# torch_dplr vs {fla} and {wind} on {meta.get('device', '?')}", "",
            f"torch {meta.get('torch', '?')}, torch_dplr {meta.get('torch_dplr', '?')} "
            f"(git {meta.get('git') or '?'}), torch_dplr TileLang kernels: "
            f"{'yes' if meta.get('torch_dplr_tilelang') else 'no'}. bf16 inputs, fp32 gates. "
            f"Times: median over reps, {clock}. "
            "ratio = faster FLA route / torch_dplr (above 1: torch_dplr is faster). Peak: CUDA "
            "memory one call allocates above what was allocated before it, MB; FLA's is its faster "
            "route's. '→Triton': FLA's TileLang backend refused the config (it runs Triton). "
            "wind_rwkv: its `chunked_cuda` kernel (bf16 state, chunk 16, one save/recompute trade "
            "whatever the policy); ratio wind = wind_rwkv / torch_dplr; 'refused': it cannot run "
            "the cell (see below)."]


def _stage_cell_title(r) -> str:
    return (f"{_shape(r)}, chunk {r['chunk_size']}, {r['gates']} gates, "
            f"{'with' if r['state'] else 'without'} state")


def _floor_ms(nbytes) -> float | None:
    """The time ``nbytes`` take at HBM_GB_S."""
    return None if nbytes is None else nbytes / (HBM_GB_S * 1e6)


def _percent(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def stage_table(ops) -> list[str]:
    lines = ["| op | ms | MB moved | GB/s | of 4300 GB/s | HBM floor ms |", "|---|---|---|---|---|---|"]
    for r in ops:
        mb = None if r.get("bytes") is None else r["bytes"] / 1e6
        op = r.get('op') or '–'
        if r.get("fused_kernel") is False:  # chunk_fwd_fused composing the staged kernels
            op += " (staged kernels)"
        lines.append(f"| {op} | {_num(r.get('ms'))} | {_num(mb, '{:.1f}')} "
                     f"| {_num(r.get('gb_s'), '{:.0f}')} | {_percent(r.get('bw_fraction'))} "
                     f"| {_num(_floor_ms(r.get('bytes')))} |")
    return lines


def stage_sum_table(sums) -> list[str]:
    lines = ["| path | sum of its stages ms | end to end ms | host + glue ms | stages at GB/s "
             "| stages' HBM floor ms | fused floor ms (call's own I/O) |",
             "|---|---|---|---|---|---|---|"]
    for r in sums:
        ops = " + ".join(op.replace("chunk_", "") for op in r.get("ops", []))
        lines.append(f"| {r['path']} ({ops}) | {_num(r.get('stages_ms'))} | {_num(r.get('end_to_end_ms'))} "
                     f"| {_num(r.get('glue_ms'))} | {_num(r.get('gb_s'), '{:.0f}')} "
                     f"| {_num(_floor_ms(r.get('bytes')))} | {_num(_floor_ms(r.get('io_bytes')))} |")
    return lines


def stage_sections(records) -> list[str]:
    """"Where the time goes": per stage cell, its ops and the paths' sums (empty without them)."""
    cells = {}
    for r in records:
        if r.get("mode") in ("stage", "stage_sum") and r.get("stage_cell"):
            cells.setdefault(r["stage_cell"], []).append(r)
    if not cells:
        return []
    lines = ["", "## Where the time goes", "",
             "Each torch_dplr stage op timed alone through `torch.ops.dplr` (same timer) on the "
             "inputs the ops before it produced. MB moved: the op's compulsory traffic, every "
             "tensor input read once and every output written once (a kernel that re-reads or "
             "spills moves more); HBM floor = that traffic at 4300 GB/s, what the H200 sustains. "
             "`chunk_state_fwd:keep` also writes `h` and `v_new` for the backward (training); "
             "`:nokeep` is the no-grad call's. End to end: the public function timed the same "
             "way, no-grad (fwd) or forward+backward without checkpointing (fwd_bwd); host + "
             "glue = end to end − the sum of its stages (dispatch, autograd, allocation, "
             "gradient sums). Fused floor: the call's own inputs and outputs moved once."]
    for rs in cells.values():
        ops = [r for r in rs if r["mode"] == "stage"]
        sums = [r for r in rs if r["mode"] == "stage_sum"]
        lines += ["", f"### {_stage_cell_title(rs[0])}", ""] + stage_table(ops)
        if sums:
            lines += [""] + stage_sum_table(sums)
    return lines


def coverage(records) -> list[str]:
    """How many of the envelope's timed cells the run holds, and which (shape, chunk size)
    groups it lacks."""
    from . import cells

    have = {r.get("cell") for r in records}
    envelope = [c for c in cells.envelope() if c.mode in cells.MODES]
    missing: dict[str, int] = {}
    for c in envelope:
        if c.id not in have:
            group = f"{c.shape.label} chunk {c.chunk_size}"
            missing[group] = missing.get(group, 0) + 1
    line = f"Cells measured: {len(envelope) - sum(missing.values())} of the envelope's {len(envelope)}."
    if missing:
        line += " Not measured: " + "; ".join(f"{g} ({n})" for g, n in missing.items()) + "."
    return ["", line]


def markdown(records) -> str:
    policy = shipped_policy(records)
    lines = _preamble(records) + coverage(records)
    lines += ["", "## Targets", "", "| target | measured | holds |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {_verdict(ok)} |" for t, m, ok in target_rows(records)]
    for title, mode, pol in SECTIONS:
        rows = section_rows(records, mode, pol or policy)
        if rows:
            lines += ["", f"## {title.format(policy=pol or policy)}", ""] + table(rows)
    first = [r for r in records if r.get("mode") == "first_call"]
    if first:
        lines += ["", "## First call (fresh process; forward+backward, all kernels included)", "",
                  "| shape | cold cache s | warm cache s | of which kernels, cold / warm s "
                  "| no-grad forward after it, cold / warm s "
                  "| new B, T and varlen layout, cold / warm s |", "|---|---|---|---|---|---|"]
        for r in first:
            lines.append(f"| {_shape(r)} chunk {r['chunk_size']} | {_num(r.get('cold_s'), '{:.2f}')} "
                         f"| {_num(r.get('warm_s'), '{:.2f}')} "
                         f"| {_num(r.get('cold_kernels_s'), '{:.2f}')} / {_num(r.get('warm_kernels_s'), '{:.2f}')} "
                         f"| {_num(r.get('cold_fwd_s'), '{:.2f}')} / {_num(r.get('warm_fwd_s'), '{:.2f}')} "
                         f"| {_num(r.get('cold_new_layout_s'), '{:.2f}')} / "
                         f"{_num(r.get('warm_new_layout_s'), '{:.2f}')} |")
        dynamo = [r.get("warm_dynamo_import_s") for r in first if r.get("warm_dynamo_import_s") is not None]
        if dynamo:
            lines += ["", f"The first call is timed with `torch._dynamo` imported (as in any process "
                      f"that uses `torch.compile`). An eager process imports it inside the first call "
                      f"of any `torch.library.custom_op`, PyTorch's cost: {max(dynamo):.2f} s more here "
                      f"(warm run)."]
        lines += first_call_profile(first)
    lines += wind_refusals(records)
    lines += stage_sections(records)
    failed = [r for r in records if _errors(r)]
    if failed:
        lines += ["", "## Errors", ""] + [f"- `{r.get('cell')}`: {_errors(r)}" for r in failed]
    return "\n".join(lines) + "\n"


PROFILE_ROWS = 10


def _code_cell(entry) -> str:
    return f"`{entry[0]}`" if entry else ""


def first_call_profile(first) -> list[str]:
    """Where a warm first call's time goes: the profiled third run of each first_call record."""
    lines = []
    for r in first:
        prof = r.get("warm_profile") or {}
        if "by_self" not in prof:
            continue
        lines += ["", f"Where a warm first call's time goes ({_shape(r)}; a third process, warm, under "
                  f"cProfile: {_num(prof.get('fwd_bwd_s'), '{:.2f}')} s, the profiler's overhead "
                  f"included):", "", "| most time of its own | s | most time under it | s |",
                  "|---|---|---|---|"]
        own, under = prof["by_self"][:PROFILE_ROWS], prof["by_cumulative"][:PROFILE_ROWS]
        for i in range(max(len(own), len(under))):
            a = own[i] if i < len(own) else None
            b = under[i] if i < len(under) else None
            lines.append(f"| {_code_cell(a)} | {_num(a and a[1])} | {_code_cell(b)} | {_num(b and b[1])} |")
    return lines


def _bar_label(r) -> str:
    gates = " unb" if r["gates"] == "unbounded" else ""
    return f"{_shape(r)} c{r['chunk_size']}{gates}{' +s' if r['state'] else ''}"


def plot(records, png_path) -> bool:
    """Bars of the ratio per cell, one panel per section; False (with a message) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, then "
              "python -m benchmarks.report FILE)", file=sys.stderr)
        return False
    policy = shipped_policy(records)
    panels = [(t.format(policy=pol or policy), section_rows(records, m, pol or policy))
              for t, m, pol in SECTIONS]
    panels = [(t, rows) for t, rows in panels if rows]
    if not panels:
        print("no timed cells: no plot", file=sys.stderr)
        return False
    widest = max(len(rows) for _, rows in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.28 * widest + 2), 4.2 * len(panels)),
                             squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels):
        ratios = [r.get("ratio") or 0.0 for r in rows]
        colors = ["tab:green" if x >= 1.5 else "tab:orange" if x >= 1.0 else "tab:red" for x in ratios]
        bars = ax.bar(range(len(rows)), ratios, color=colors)
        ax.bar_label(bars, labels=[f"{x:.2f}" if x else "n/a" for x in ratios], fontsize=6, rotation=90,
                     padding=2)
        ax.set_ylim(0, max([1.7] + ratios) * 1.15)
        for level, style in ((1.0, "-"), (1.5, "--")):
            ax.axhline(level, color="black", linestyle=style, linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([_bar_label(r) for r in rows], rotation=90, fontsize=7)
        ax.set_ylabel("faster FLA / torch_dplr")
        ax.set_title(title.replace("`", ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


def write_report(jsonl_path, md_path=None, png_path=None) -> dict:
    """Writes the markdown table and the plot next to the JSON lines; returns the paths written."""
    jsonl_path = Path(jsonl_path)
    md_path = Path(md_path) if md_path else jsonl_path.with_suffix(".md")
    png_path = Path(png_path) if png_path else jsonl_path.with_suffix(".png")
    records = load(jsonl_path)
    notes = jsonl_path.with_name(f"{jsonl_path.stem}-notes.md")
    md_path.write_text(markdown(records) + ("\n" + notes.read_text() if notes.is_file() else ""))
    written = {"md": str(md_path)}
    if plot(records, png_path):
        written["png"] = str(png_path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", help="JSON lines written by the harness (e.g. benchmarks/results/h200.json)")
    parser.add_argument("--md", help="markdown output (default: beside the input, .md)")
    parser.add_argument("--png", help="plot output (default: beside the input, .png)")
    parser.add_argument("--merge", nargs="+", metavar="PART",
                        help="first write JSONL as these files' records in the envelope's order "
                             "(the shards of bench --shard)")
    args = parser.parse_args(argv)
    if args.merge:
        print(f"merged {merge(args.merge, args.jsonl)} records into {args.jsonl}")
    for kind, path in write_report(args.jsonl, args.md, args.png).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
