"""The report's load section: `quantdrift load`'s sweep of the served variants (continuous batching), per variant
the level table at each context depth, the knee, the largest concurrency meeting the workload's targets and the
advice. Read from ``summary["load"]``."""

from __future__ import annotations

from pipeline.report.cells import _fmt


def load_section(summary: dict) -> tuple | None:
    """`quantdrift load`'s sweep: per variant the level table at each context depth, the knee, the largest
    concurrency meeting the workload's targets and throughput_at_slo; skipped variants with their reasons."""
    sweep = summary.get("load")
    if not sweep or not sweep.get("variants"):
        return None
    wl = sweep["workload"]
    targets = ", ".join(f"{k.removeprefix('max_').replace('_', ' ')} ≤ {v:g} s" for k, v in wl.items()
                        if k.startswith("max_") and v is not None) or "no latency targets (throughput only)"
    ok = {n: v for n, v in sweep["variants"].items() if v["status"] == "ok"}
    iv = lambda f, k, spec, scale=1.0: "–" if f.get(k) is None else (  # noqa: E731
        format(f[k] * scale, spec) + (f" [{format(f[k + '_interval']['low'] * scale, spec)}, "
                                      f"{format(f[k + '_interval']['high'] * scale, spec)}]"
                                      if f.get(k + "_interval") else ""))
    head = ["variant", "context", "concurrency", "output tok/s", "req/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
            "ITL p99 ms", "e2e p99 s", "peak MB", "targets"]
    rows = []
    from pipeline.figures.served_load import numeric_order

    for name, v in ok.items():
        for depth, block in numeric_order(v["depths"]):
            for c, f in numeric_order(block["levels"]):
                peak = f.get("device_peak_mb") if f.get("device_peak_mb") is not None else f.get("peak_rss_mb")
                rows.append([name, depth, c, iv(f, "output_tokens_per_s", ".1f"), iv(f, "requests_per_s", ".2f"),
                             iv(f, "ttft_p50_s", ".2f"), iv(f, "ttft_p99_s", ".2f"), iv(f, "itl_p50_s", ".0f", 1e3),
                             iv(f, "itl_p99_s", ".0f", 1e3), iv(f, "e2e_p99_s", ".2f"), _fmt(peak, ".0f"),
                             block["operating_point"]["verdicts"][c]["verdict"]])
    from pipeline.figures.served_load import advice

    lines = []
    for name, v in sorted(ok.items(), key=lambda kv: -(kv[1].get("throughput_at_slo") or -1)):
        noise = [x for x in v.get("cpu_noise_rounds") or [] if x is not None]
        noise_txt = (f"; other processes used up to {max(noise):.0%} of the CPU during its rounds"
                     + (" (noisy: read its figures with care)" if max(noise) > 0.1 else "")) if noise else ""
        lines.append(f"`{name}` on {v['engine']} ({v.get('engine_version') or 'version not reported'}): "
                     f"{advice(v, bold='**')}{noise_txt}.")
    blocks: list = [
        f"Workload **{wl['name']}** ({wl.get('description') or ''}): {targets}, at {wl['context_tokens']} tokens "
        f"of context. Sweep `{sweep['profile']}`: concurrency {sweep['concurrency']} (capped by the capacity plan), "
        f"context {sweep['depths']}, {sweep['output_tokens']} output tokens per request, {sweep['repeats']} "
        f"interleaved rounds (a fresh server per variant and round); load generator {sweep['generator']}.",
        lines, (head, rows),
        "Medians over rounds with the range of the rounds in brackets (order statistics; with 3 rounds the range "
        "covers the median with 75 % probability). Output tok/s: aggregate over all concurrent requests. A level "
        "\"meets\" the targets when every target's range lies under its limit, \"fails\" when a range lies wholly "
        "above it, and is \"undecided\" otherwise. Knee: the first concurrency after which doubling adds less than "
        f"{sweep['knee_gain']:.0%} aggregate throughput (median of the paired per-round gains). The advice is to "
        "operate at or left of the knee and within the targets. Peak MB: the server process's resident memory (its "
        "device memory from NVML on CUDA) sampled while the level ran."
        + (" A round stops climbing after two doublings that each added less than the knee gain, or after a level "
           "that completed no request: a higher level's figures come from the rounds that reached it."
           if sweep.get("stop_past_knee") else "")]
    if any(v["slo_depth"] != wl["context_tokens"] for v in ok.values()):
        blocks.append(f"This sweep did not measure the workload's own context ({wl['context_tokens']} tokens): the "
                      "targets were judged at the deepest context measured, which is optimistic (prefill and KV "
                      "reads grow with context). `make load` measures it.")
    other = {n: v for n, v in sweep["variants"].items() if v["status"] != "ok"}
    if other:
        blocks.append([f"`{n}`: {v['status']} — {v['reason']}" for n, v in other.items()])
    return ("load", "Served under load (continuous batching)", blocks)
