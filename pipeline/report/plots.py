"""The report's plots (PNG beside report.md, inlined into report.html): the Pareto view, KLD by output position,
multi-turn drift by turn, long-context recall by depth and the nightly trend.

Every plot of a report draws a variant in the same colour: one mapping from variant name to colour
(``variant_colors``), derived from the order of ``summary["variants"]``. matplotlib is imported inside
``make_plots`` only.
"""

from __future__ import annotations

import io
from pathlib import Path

from pipeline.report.tables import multi_turn_suites
from pipeline.infra.files import atomic_write_bytes

# matplotlib's "tab10" (its default colour cycle) and, for more than ten variants, "tab20".
_TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
_TAB20 = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
          "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
          "#17becf", "#9edae5")


def variant_colors(summary: dict, history: list[dict] | None = None) -> dict[str, str]:
    """Variant name -> colour, by position in ``summary["variants"]`` (skipped variants keep their slot, so a
    variant's colour does not depend on which others failed). Variants that appear only in this model's and run's
    history come after them, in name order, for the trend plot."""
    names = list(summary["variants"])
    seen = set(names)
    names += sorted({n for h in _history_rows(history or [], summary) for n in h["variants"] if n not in seen})
    palette = _TAB10 if len(names) <= len(_TAB10) else _TAB20
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def _history_rows(history: list[dict], summary: dict) -> list[dict]:
    return [h for h in history if h.get("model") == summary["model"]["name"] and h.get("run") == summary["run"]["name"]]


def _trend_plot(plt, history: list[dict], summary: dict, out_dir: Path, colors: dict[str, str]) -> str | None:
    """Key metrics of this model and run over the nightly history (results/history.jsonl)."""
    rows = _history_rows(history, summary)
    if len(rows) < 2:
        return None
    names = sorted({n for h in rows for n, v in h["variants"].items() if v.get("status") == "ok"})
    # the gate's own figure where the history has it: each variant's decode speed over its control on its runtime
    # in the same rounds (machine drift cancelled), drawn only where the control is the newest line's (a ratio to
    # the F16 file and one to the other variants are not one scale); older lines carry the absolute speed only
    relative = any(h.get("speed_relative") for h in rows)

    def rel(h: dict, n: str) -> dict:
        return ((h.get("speed_relative") or {}).get(n) or {}).get("decode_tokens_per_s") or {}

    against = {n: next((rel(h, n).get("against", "control") for h in reversed(rows) if rel(h, n)), None)
               for n in {n for h in rows for n in (h.get("speed_relative") or {})}}

    def speed(h: dict, n: str) -> float | None:
        if relative:
            r = rel(h, n)
            return r.get("ratio") if r and r.get("against", "control") == against.get(n) else None
        return h["variants"][n].get("decode_tokens_per_s")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in names:
        pts = [(i, h["variants"][n]) for i, h in enumerate(rows) if h["variants"].get(n, {}).get("status") == "ok"]
        if n != "original":
            ax1.plot([i for i, _ in pts], [max(v["kld_mean"] or 0, 1e-7) for _, v in pts], marker="o", label=n,
                     color=colors[n])
        sp = [(i, y) for i, h in enumerate(rows) if h["variants"].get(n, {}).get("status") == "ok"
              and (y := speed(h, n)) is not None]
        if sp:
            ax2.plot([i for i, _ in sp], [y for _, y in sp], marker="o", label=n, color=colors[n])
    labels = [h["time"][:10] + (f"\n{h['commit'][:7]}" if h.get("commit") else "") for h in rows]
    speed_title = ("decode speed ÷ its control on its runtime (same rounds)" if relative
                   else "decode tokens/s over runs")
    for ax, title in ((ax1, "mean KLD over runs (log)"), (ax2, speed_title)):
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax2.legend(fontsize=7)
    _save(fig, out_dir / "trend.png")
    return "trend.png"


def _kld_lines(plt, panels: list[tuple[str, dict[str, list[tuple[int, float]]]]], xlabel: str, ylabel: str,
               legend_size: int, path: Path, colors: dict[str, str], integer_x: bool = False) -> None:
    """One log-scale KLD line per variant (points (x, mean KLD); empty series are left out), one panel per
    (title, series), side by side (three to a row) on a shared y axis."""
    from matplotlib.ticker import MaxNLocator

    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7, 4.5) if len(panels) == 1 else (5.5 * cols, 4.2 * nrows),
                             squeeze=False, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax, (title, series) in zip(flat, panels):
        for n, pts in series.items():
            if pts:
                ax.plot([x for x, _ in pts], [max(y, 1e-7) for _, y in pts], marker="o", label=n, color=colors[n])
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_size)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    _save(fig, path)


KLD_FLOOR = 1e-7      # a log axis cannot show 0 (the original against itself)


def _kld_error_bar(ax, x: float, y: float, iv: dict | None, color: str, alpha: float) -> None:
    """The 95 % interval of a mean KLD drawn at (x, y) on a log axis."""
    if iv:
        ax.errorbar([x], [y], yerr=[[max(y - max(iv["low"], KLD_FLOOR), 0)], [max(iv["high"] - y, 0)]], fmt="none",
                    ecolor=color, alpha=alpha, elinewidth=1, capsize=2)


def _finish_kld_axes(ax, fig, xlabel: str, title: str, path: Path) -> None:
    """Mean KLD on a log y axis against ``xlabel``; saved to ``path``."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean KLD vs original, nats (log; lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    _save(fig, path)


def _pareto_plot(plt, summary: dict, ok: dict, out_dir: Path, colors: dict[str, str]) -> None:
    front = set(summary["recommendation"].get("pareto_front") or [])
    chosen = summary["recommendation"].get("variant")
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, v in ok.items():
        x, y = v["speed"]["decode_tokens_per_s"], v["drift"]["kld_mean"]
        if x is None or y is None:
            continue
        y = max(y, KLD_FLOOR)
        size = max(20.0, (v["memory"]["peak_rss_mb"] or 100) / 4)
        if n != "original":
            _kld_error_bar(ax, x, y, (v.get("intervals") or {}).get("kld_mean"), colors[n], 0.5)
        filled = n in front or n == chosen       # the variant's colour: filled on the front, hollow off it
        ax.scatter([x], [y], s=size, facecolors=colors[n] if filled else "none",
                   edgecolors="k" if n == chosen else colors[n], linewidths=2 if n == chosen else 1.5,
                   alpha=0.8 if filled else 0.6, label=n)
        ax.annotate(n + (" (ship)" if n == chosen else ""), (x, y), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    _finish_kld_axes(ax, fig, "decode tokens/s (higher is better)",
                     "Drift vs decode speed (filled: Pareto front; hollow: dominated; black edge: recommended;\n"
                     "marker size: peak RSS; bars: 95% CI)", out_dir / "pareto.png")


def _bits_plot(plt, summary: dict, ok: dict, out_dir: Path, colors: dict[str, str]) -> bool:
    """Mean KLD (95 % interval) against stored bits per weight, one point per weight format (KV-cache variants
    share their weights' bits and are left out); a type's plain and importance-matrix files joined by a line."""
    points = {n: (v["artifact"]["bits_per_weight"], v["drift"]["kld_mean"]) for n, v in ok.items()
              if n != "original" and "+" not in n and (v.get("artifact") or {}).get("bits_per_weight")
              and v["drift"]["kld_mean"] is not None}
    if len(points) < 2:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for e in summary.get("imatrix_effects") or []:
        if e["plain"] in points and e["imatrix"] in points:
            (x0, y0), (x1, y1) = points[e["plain"]], points[e["imatrix"]]
            ax.plot([x0, x1], [max(y0, KLD_FLOOR), max(y1, KLD_FLOOR)], color="grey", lw=1, ls="--", alpha=0.7)
    for n, (x, y) in points.items():
        y = max(y, KLD_FLOOR)
        _kld_error_bar(ax, x, y, (ok[n].get("intervals") or {}).get("kld_mean"), colors[n], 0.6)
        imat = bool((ok[n].get("artifact") or {}).get("imatrix"))
        ax.scatter([x], [y], s=40, marker="D" if imat else "o", color=colors[n], label=n)
        ax.annotate(n, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    _finish_kld_axes(ax, fig, "stored bits per weight (tensor bytes x 8 / weights)",
                     "Drift vs bits per weight (diamonds: importance matrix; dashed: the same type plain and\n"
                     "with an importance matrix; bars: 95% CI)", out_dir / "kld_vs_bits.png")
    return True


def _recall_plot(plt, recall: dict, out_dir: Path, colors: dict[str, str]) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n, r in recall.items():
        depths = sorted(r["by_depth"], key=float)
        xs = [100 * float(d) for d in depths]
        ax1.plot(xs, [100 * (r["by_depth"][d]["recall"] or 0) for d in depths], marker="o", label=n, color=colors[n])
        if n != "original":
            ax2.plot(xs, [max(r["by_depth"][d]["kld_mean"] or 0, 1e-7) for d in depths], marker="o", label=n,
                     color=colors[n])
    ax1.set_xlabel("depth of the planted fact in the document (%)")
    ax1.set_ylabel("recall (% of questions answered exactly)")
    ax1.set_ylim(-5, 105)
    ax1.set_title("Recall by depth")
    ax2.set_yscale("log")
    ax2.set_xlabel("depth of the planted fact in the document (%)")
    ax2.set_ylabel("mean KLD on answer tokens, nats")
    ax2.set_title("Answer-token KLD by depth")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    _save(fig, out_dir / "recall_by_depth.png")


def _load_plots(plt, sweep: dict, out_dir: Path, colors: dict[str, str]) -> dict[str, str]:
    """The load sweep: aggregate output tokens/s and ITL p99 against concurrency, one line per variant (its
    colour in every plot), one panel per context depth, with the rounds' range as error bars."""
    ok = {n: v for n, v in sweep["variants"].items() if v["status"] == "ok"}
    if not ok:
        return {}
    depths = [str(d) for d in sweep["depths"]]
    out = {}
    for key, figure, scale, ylabel, title in (
            ("load_throughput", "output_tokens_per_s", 1.0, "aggregate output tokens/s", "Throughput vs concurrency"),
            ("load_itl", "itl_p99_s", 1e3, "ITL p99, ms", "Inter-token latency p99 vs concurrency")):
        fig, axes = plt.subplots(1, len(depths), figsize=(5.2 * len(depths), 4.0), squeeze=False)
        for ax, depth in zip(axes[0], depths):
            for name, v in ok.items():
                levels = (v["depths"].get(depth) or {}).get("levels") or {}
                pts = sorted((int(c), f[figure], f.get(figure + "_interval")) for c, f in levels.items()
                             if f.get(figure) is not None)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ys = [p[1] * scale for p in pts]
                lo = [max(0.0, (p[1] - p[2]["low"]) * scale) if p[2] else 0.0 for p in pts]
                hi = [max(0.0, (p[2]["high"] - p[1]) * scale) if p[2] else 0.0 for p in pts]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name, color=colors.get(name))
                if figure == "output_tokens_per_s" and v["knee_reached"] and depth == str(v["slo_depth"]):
                    k = v["knee_concurrency"]
                    if str(k) in levels:
                        ax.plot([k], [levels[str(k)][figure]], marker="*", markersize=14, color=colors.get(name))
            if figure == "itl_p99_s" and sweep["workload"].get("max_itl_p99_s"):
                ax.axhline(sweep["workload"]["max_itl_p99_s"] * 1e3, color="#444", linestyle=":",
                           label="workload target")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}, context {depth}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        _save(fig, out_dir / f"{key}.png")
        out[key] = f"{key}.png"
    return out


def make_plots(summary: dict, out_dir: Path, history: list[dict] | None = None) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: v for n, v in summary["variants"].items() if v["status"] == "ok"}
    plots: dict[str, str] = {}
    colors = variant_colors(summary, history)
    if summary.get("load"):         # a load sweep has its plots also in a run that evaluated nothing (make load)
        plots.update(_load_plots(plt, summary["load"], out_dir, colors))
    if not ok:
        return plots
    _pareto_plot(plt, summary, ok, out_dir, colors)
    plots["pareto"] = "pareto.png"
    if _bits_plot(plt, summary, ok, out_dir, colors):
        plots["kld_vs_bits"] = "kld_vs_bits.png"
    drifting = {n: v["drift_detail"] for n, v in ok.items() if n != "original"}
    _kld_lines(plt, [("KLD by output position",
                      {n: [(int(k.split("-")[0]), b["mean"]) for k, b in d["kld_by_position"].items()]
                       for n, d in drifting.items()})],
               "output position (token index within the reply, bucket start)", "mean KLD, nats", 8,
               out_dir / "kld_by_position.png", colors)
    plots["kld_by_position"] = "kld_by_position.png"
    suites = multi_turn_suites(ok)       # the same multi-turn suites as the report's by-turn tables
    if suites:
        _kld_lines(plt, [(f"Multi-turn drift by turn: {suite}" if len(suites) > 1 else "Multi-turn drift by turn",
                          {n: [(int(t.rpartition(":")[2]), d["kld_by_turn"][t]["mean"]) for t in turns
                               if t in d["kld_by_turn"]] for n, d in drifting.items()})
                         for suite, turns in suites.items()],
                   "turn of the multi-turn conversation", "mean KLD of the reply, nats", 7,
                   out_dir / "kld_by_turn.png", colors, integer_x=True)
        plots["kld_by_turn"] = "kld_by_turn.png"
    trend = _trend_plot(plt, history or [], summary, out_dir, colors)
    if trend:
        plots["trend"] = trend
    recall = {n: v["recall"] for n, v in ok.items() if v.get("recall")}
    if recall:
        _recall_plot(plt, recall, out_dir, colors)
        plots["recall_by_depth"] = "recall_by_depth.png"
    return plots


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
