"""The report's plots on hand-built summaries: one colour per variant across every plot of a report (read back
from the figure objects, not from PNG bytes), and the drift-by-turn plot follows the multi-turn rule."""

import pytest

import pipeline.report.plots as plots_mod
from pipeline.report.plots import make_plots, variant_colors
from tests.test_report_sections import _turns, three_variants

pytest.importorskip("matplotlib")


@pytest.fixture
def figures(monkeypatch):
    """Every figure make_plots saves, by file name, kept open for inspection (closed afterwards)."""
    import matplotlib.pyplot as plt

    saved = {}
    monkeypatch.setattr(plots_mod, "_save", lambda fig, path: saved.__setitem__(path.name, fig))
    yield saved
    for fig in saved.values():
        plt.close(fig)


def _history(summary, extra=None):
    def line(day, tps):
        vs = {n: {"status": v["status"], "kld_mean": v["drift"]["kld_mean"] if v["status"] == "ok" else None,
                  "decode_tokens_per_s": tps if v["status"] == "ok" else None}
              for n, v in summary["variants"].items()}
        if extra:
            vs[extra] = {"status": "ok", "kld_mean": 0.5, "decode_tokens_per_s": tps}
        return {"model": summary["model"]["name"], "run": summary["run"]["name"], "time": f"2025-01-0{day}T00",
                "variants": vs}

    return [line(1, 40.0), line(2, 42.0)]


def _colours_by_label(fig) -> dict[str, set[str]]:
    """label -> colours of the labelled lines and markers of every axes of a figure (hollow markers: edge)."""
    from matplotlib.collections import PathCollection
    from matplotlib.colors import to_hex

    out: dict[str, set[str]] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                out.setdefault(line.get_label(), set()).add(to_hex(line.get_color()))
        for coll in ax.collections:
            if isinstance(coll, PathCollection) and not coll.get_label().startswith("_"):
                fc = coll.get_facecolor()
                rgba = fc[0] if len(fc) else coll.get_edgecolor()[0]
                out.setdefault(coll.get_label(), set()).add(to_hex(rgba, keep_alpha=False))
    return out


def test_each_variant_has_one_colour_across_every_plot(tmp_path, figures):
    """Old code: the recall report's KLD panel skipped `original` and shifted the colour cycle, and the Pareto plot
    coloured by front membership, so one variant had several colours in one report."""
    s = three_variants({n: _turns(k, multi_turn=3) for n, k in (("q8", 0.01), ("q4", 0.05))}, recall=True)
    history = _history(s, extra="retired")
    plots = make_plots(s, tmp_path, history)
    assert set(plots) == {"pareto", "kld_by_position", "kld_by_turn", "recall_by_depth", "trend"}
    assert set(figures) == {f"{p}.png" for p in plots}
    colours = variant_colors(s, history)
    seen: dict[str, set[str]] = {}
    for name, fig in figures.items():
        for label, cs in _colours_by_label(fig).items():
            assert cs == {colours[label]}, (name, label, cs, colours[label])
            seen.setdefault(label, set()).update(cs)
    assert set(seen) == {"original", "q8", "q4", "retired"}
    assert all(len(cs) == 1 for cs in seen.values()) and len(set.union(*seen.values())) == len(seen)
    # the recall figure's two panels in particular: q8 and q4 share their colour across both
    recall = figures["recall_by_depth.png"]
    for n in ("q8", "q4"):
        lines = [line for ax in recall.axes for line in ax.get_lines() if line.get_label() == n]
        assert len(lines) == 2 and {line.get_color() for line in lines} == {colours[n]}


def test_variant_colours_follow_the_summary_order():
    s = three_variants()
    c = variant_colors(s)
    assert list(c) == ["original", "q8", "awq", "q4"]           # skipped variants keep their slot
    assert c == variant_colors(three_variants())                 # deterministic
    assert len(set(c.values())) == 4
    many = {"variants": {f"v{i}": {} for i in range(15)}, "model": {"name": "m"}, "run": {"name": "r"}}
    assert len(set(variant_colors(many).values())) == 15         # past ten variants: twenty distinct colours
    assert list(variant_colors(s, _history(s, extra="aaa")))[-1] == "aaa"   # history-only variants come last


def test_the_turn_plot_shows_every_multi_turn_suite_and_only_those(tmp_path, figures):
    """Old code: no turn plot unless a suite was literally called multi_turn."""
    turns = {"q8": _turns(0.01, support_chat=3, long_output=1, multi_turn=1),
             "q4": _turns(0.05, support_chat=2, onboarding=2, long_output=1, multi_turn=1)}
    plots = make_plots(three_variants(turns), tmp_path)
    assert "kld_by_turn" in plots
    axes = [ax for ax in figures["kld_by_turn.png"].axes if ax.get_visible()]
    assert [ax.get_title().rsplit(": ", 1)[1] for ax in axes] == ["support_chat", "onboarding"]
    support = {line.get_label(): list(line.get_xdata()) for line in axes[0].get_lines()}
    assert support == {"q8": [1, 2, 3], "q4": [1, 2]}
    single = make_plots(three_variants({"q8": _turns(0.01, long_output=1, multi_turn=1)}), tmp_path)
    assert "kld_by_turn" not in single


def test_drift_against_bits_per_weight_joins_a_types_plain_and_importance_matrix_files(tmp_path, figures):
    s = three_variants()
    s["variants"]["q8"]["artifact"]["bits_per_weight"] = 8.5
    assert "kld_vs_bits" not in make_plots(s, tmp_path), "one format is no comparison"
    for n, bits in (("original", 32.0), ("q4", 4.9)):
        s["variants"][n]["artifact"]["bits_per_weight"] = bits
    s["variants"]["q4"]["artifact"]["imatrix"] = {"chunks": 24}
    figures.clear()
    assert "kld_vs_bits" in make_plots(s, tmp_path)
    fig = figures["kld_vs_bits.png"]
    points = {c.get_label() for ax in fig.axes for c in ax.collections if not c.get_label().startswith("_")}
    assert points == {"q8", "q4"}, "the original (0 KLD against itself) is left out"
    assert not [line for ax in fig.axes for line in ax.get_lines() if line.get_linestyle() == "--"]
    s["imatrix_effects"] = [{"type": "Q4_K_M", "plain": "q8", "imatrix": "q4"}]
    figures.clear()
    make_plots(s, tmp_path)
    dashed = [line for ax in figures["kld_vs_bits.png"].axes for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_xdata()) == [8.5, 4.9]


def test_the_trend_plot_draws_each_variants_speed_over_its_runtime_control_where_the_history_has_it(tmp_path,
                                                                                                     figures):
    """Nightly lines with the gate's control-relative speed: the speed panel draws those ratios per variant (the
    control itself has none and is left out); older lines without them: absolute tokens/s."""
    s = three_variants({n: _turns(k, multi_turn=3) for n, k in (("q8", 0.01), ("q4", 0.05))})
    history = _history(s)
    for h, q4 in zip(history, (1.50, 1.35)):
        h["speed_relative"] = {"q4": {"decode_tokens_per_s": {"ratio": q4, "change": 0.0, "detectable": 0.08,
                                                              "rounds": 40}}}
    make_plots(s, tmp_path, history)
    ax = figures["trend.png"].axes[1]
    assert "÷ its control on its runtime" in ax.get_title()
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert drawn == {"q4": [1.50, 1.35]}
    # the newest line judged q4 against the other variants of its runtime: a ratio to a named control is another
    # scale, so the older point is not drawn on it
    history[1]["speed_relative"]["q4"]["decode_tokens_per_s"]["against"] = "others"
    make_plots(s, tmp_path, history)
    line = next(x for x in figures["trend.png"].axes[1].get_lines() if x.get_label() == "q4")
    assert list(line.get_xdata()) == [1] and list(line.get_ydata()) == [1.35]
    make_plots(s, tmp_path, _history(s))
    ax = figures["trend.png"].axes[1]
    assert ax.get_title() == "decode tokens/s over runs" and "q8" in {line.get_label() for line in ax.get_lines()}
