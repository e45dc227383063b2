"""Turn per-variant raw results into the summary figures (the summary.json contract) and the decision."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline import metrics
from pipeline.config import DecisionConfig
from pipeline.store import read_json, read_jsonl

SCHEMA_VERSION = 1
# Bytes per cached element: llama.cpp block types count their per-block fp16 scale (q8_0: 32 int8 + 2 bytes).
CACHE_BYTES = {"f32": 4.0, "float32": 4.0, "f16": 2.0, "float16": 2.0, "bfloat16": 2.0, "q8_0": 34 / 32,
               "q4_0": 18 / 32}


def kv_bytes_per_token_formula(facts: dict, element_bytes: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * element_bytes


def cache_element_bytes(runtime_info: dict, head_dim: int) -> float:
    """Mean bytes per cached K/V element for a runtime's cache setting.

    hf integer cache (KIVI layout): K codes are bits/8 bytes per element with per-channel scales (a fixed cost
    per sequence, not per token); V codes are bits/8 plus an fp16 scale and zero point per token and head, i.e.
    4 / head_dim bytes per element. Averaged over K and V: bits/8 + 2/head_dim.
    """
    if runtime_info.get("runtime") == "llamacpp":
        k = CACHE_BYTES[runtime_info.get("cache_type_k", "f16")]
        v = CACHE_BYTES[runtime_info.get("cache_type_v", "f16")]
        return (k + v) / 2
    kv = runtime_info.get("kv_cache")
    if kv:
        return kv["bits"] / 8 + 2 / head_dim
    return CACHE_BYTES.get(runtime_info.get("dtype", "float32"), 4.0)


def kv_reported_per_token(kv: dict | None) -> float | None:
    """KV bytes per token as the runtime reports them: llama.cpp's own log of its KV buffer (bytes / cells),
    else the bytes the runtime holds for the live sequence divided by its tokens."""
    if not kv:
        return None
    if kv.get("allocated_bytes") and kv.get("allocated_cells"):
        return kv["allocated_bytes"] / kv["allocated_cells"]
    return kv["bytes"] / kv["tokens"] if kv.get("tokens") else None


def drift_figures(tf: dict) -> dict:
    """Token-level drift over every suite's reply tokens, plus position buckets, turns and suites."""
    kld, top1, dnll, pos, turn_keys = [], [], [], [], []
    per_suite = {}
    for suite, convs in tf.items():
        s_kld = []
        for cid, c in convs.items():
            kld += c["kld"]
            s_kld += c["kld"]
            top1 += c["top1"]
            dnll += list(np.asarray(c["nll_variant"]) - np.asarray(c["nll_reference"]))
            pos += c["out_pos"]
            turn_keys += [f"{suite}:{t + 1}" for t in c["turn"]]
        per_suite[suite] = metrics.distribution(s_kld)
    dist = metrics.distribution(kld)
    by_turn: dict[str, list[float]] = {}
    for key, v in zip(turn_keys, kld):
        by_turn.setdefault(key, []).append(v)
    return {
        "kld_mean": dist["mean"], "kld_median": dist["median"], "kld_p90": dist["p90"], "kld_p99": dist["p99"],
        "kld_max": dist["max"], "tokens": dist["n"],
        "top1_agreement": float(np.mean(top1)) if top1 else None,
        "delta_nll": float(np.mean(dnll)) if dnll else None,
        "kld_by_position": metrics.position_buckets(pos, kld, 128),
        "kld_by_turn": {k: {"mean": float(np.mean(v)), "n": len(v)} for k, v in by_turn.items()},
        "kld_by_suite": per_suite,
    }


def degenerate(sample: dict, limits: dict) -> bool:
    """A reply that loops: its repeated 4-gram rate or its longest periodic tail crosses the configured limit."""
    return (sample["repeated_4gram_rate"] > limits.get("max_repeated_4gram_rate", 1.0)
            or sample["longest_loop_tokens"] >= limits.get("max_loop_tokens", 10**9))


def flips_by_suite(samples: list[dict]) -> dict:
    out: dict = {}
    for s in samples:
        g = out.setdefault(s["suite"], ([], []))
        g[0].extend(s["checks_reference"])
        g[1].extend(s["checks_variant"])
    table = {}
    for suite, (ref, var) in out.items():
        f = metrics.flips(ref, var)
        table[suite] = {"checks": len(var), "pass_rate": sum(var) / len(var) if var else None,
                        "reference_pass_rate": sum(ref) / len(ref) if ref else None,
                        "pass_to_fail": f["pass_to_fail"], "fail_to_pass": f["fail_to_pass"],
                        "mcnemar_p": metrics.mcnemar_exact_p(f["pass_to_fail"], f["fail_to_pass"])}
    return table


def free_running_figures(samples: list[dict], degeneration: dict | None = None) -> dict:
    ref_checks, var_checks = [], []
    chrf, rep, ratio, diverge = [], [], [], []
    for s in samples:
        ref_checks += s["checks_reference"]
        var_checks += s["checks_variant"]
        chrf.append(s["chrf"])
        rep.append(s["repeated_4gram_rate"])
        if s["length_ratio"] is not None:
            ratio.append(s["length_ratio"])
        diverge.append(s["first_divergence"])
    f = metrics.flips(ref_checks, var_checks)
    n = len(var_checks)
    identical = sum(1 for d in diverge if d is None)
    return {
        "checks": n,
        "pass_rate": (sum(var_checks) / n) if n else None,
        "reference_pass_rate": (sum(ref_checks) / n) if n else None,
        "flips": f["pass_to_fail"] + f["fail_to_pass"],
        "pass_to_fail": f["pass_to_fail"],
        "fail_to_pass": f["fail_to_pass"],
        "flip_rate": ((f["pass_to_fail"] + f["fail_to_pass"]) / n) if n else None,
        "mcnemar_p": metrics.mcnemar_exact_p(f["pass_to_fail"], f["fail_to_pass"]),
        "chrf_mean": float(np.mean(chrf)) if chrf else None,
        "identical_replies": identical,
        "replies": len(diverge),
        "first_divergence_median": (float(np.median([d for d in diverge if d is not None]))
                                    if len(diverge) > identical else None),
        "repeated_4gram_rate_mean": float(np.mean(rep)) if rep else None,
        "length_ratio_mean": float(np.mean(ratio)) if ratio else None,
        "by_suite": flips_by_suite(samples),
        "degenerate_replies": sum(1 for s in samples if degenerate(s, degeneration or {})),
        "degeneration_limits": degeneration or {},
    }


def recall_figures(tf: dict, samples: list[dict]) -> dict | None:
    """Long-context recall by planted depth and by document length: check pass rate (recall), flips against the
    original, and mean teacher-forced KLD on the answer tokens. None when no sample carries a depth."""
    rows = [s for s in samples if (s.get("meta") or {}).get("depth") is not None]
    if not rows:
        return None
    kld_by_conv = {(suite, cid): c["kld"] for suite, convs in tf.items() for cid, c in convs.items()}

    def group(key: str) -> dict:
        out: dict = {}
        for r in rows:
            g = out.setdefault(str(r["meta"][key]), {"ref": [], "var": [], "kld": []})
            g["ref"] += r["checks_reference"]
            g["var"] += r["checks_variant"]
            g["kld"] += kld_by_conv.get((r["suite"], r["conversation"]), [])
        table = {}
        for k in sorted(out, key=float):
            g = out[k]
            f = metrics.flips(g["ref"], g["var"])
            n = len(g["var"])
            table[k] = {"recall": sum(g["var"]) / n if n else None,
                        "reference_recall": sum(g["ref"]) / n if n else None, "checks": n,
                        "flips": f["pass_to_fail"] + f["fail_to_pass"], "pass_to_fail": f["pass_to_fail"],
                        "kld_mean": float(np.mean(g["kld"])) if g["kld"] else None, "answer_tokens": len(g["kld"])}
        return table

    ref_all = [c for r in rows for c in r["checks_reference"]]
    var_all = [c for r in rows for c in r["checks_variant"]]
    return {"recall": sum(var_all) / len(var_all) if var_all else None,
            "reference_recall": sum(ref_all) / len(ref_all) if ref_all else None,
            "documents": len(rows), "by_depth": group("depth"), "by_length": group("length_tokens")}


def deployment_figures(deployment: dict | None, samples: list[dict]) -> dict | None:
    """The deployment path (the runtime tokenizing rendered chat text, as a server does) against the same variant's
    measurement path (HF ids): check pass rates of both, flips between them with an exact McNemar p-value, and
    chrF of the served reply to the HF-id reply, turn by turn."""
    if not deployment:
        return None
    by_turn = {(s["suite"], s["conversation"], s["turn"]): s for s in samples}
    ids_checks, served_checks, chrf, identical, replies = [], [], [], 0, 0
    for tr in read_jsonl(Path(deployment["dir"]) / "transcripts.jsonl"):
        for i, turn in enumerate(tr["turns"]):
            s = by_turn.get((tr["suite"], tr["id"], i))
            if s is None:
                continue
            replies += 1
            ids_checks += s["checks_variant"]
            served_checks += turn["checks"]
            identical += turn["text"] == s["variant_text"]
            chrf.append(metrics.chrf(turn["text"], s["variant_text"]) if turn["text"] or s["variant_text"] else 100.0)
    f = metrics.flips(ids_checks, served_checks)
    n = len(served_checks)
    return {"suites": deployment["suites"], "replies": replies, "identical_replies": identical, "checks": n,
            "pass_rate_ids": sum(ids_checks) / n if n else None, "pass_rate_served": sum(served_checks) / n if n else None,
            "pass_to_fail": f["pass_to_fail"], "fail_to_pass": f["fail_to_pass"],
            "flip_rate": (f["pass_to_fail"] + f["fail_to_pass"]) / n if n else None,
            "mcnemar_p": metrics.mcnemar_exact_p(f["pass_to_fail"], f["fail_to_pass"]),
            "chrf_mean": float(np.mean(chrf)) if chrf else None, "wall_s": deployment.get("wall_s")}


def capacity_plan(v: dict, facts: dict, cap) -> dict:
    """Concurrent sequences of cap.context_tokens that fit each budget, for this model and (with params_b) for
    a published model of that size: floor((budget x (1 - headroom) - weights - overhead) / (KV/token x context)).

    weights: the artifact's bytes; overhead: the probe's peak RSS minus weights and the KV it held (the runtime's
    own memory: libraries, buffers, activations), never below zero. KV per token: the formula with the variant's
    cache type. For params_b: weights scale by the artifact's bytes per parameter, KV by the given geometry."""
    mem = v["memory"]
    weights = float(mem["artifact_bytes"])
    kv_tok = mem["kv_bytes_per_token"]
    probe_kv = kv_tok * ((v["speed"].get("prompt_tokens") or 0) + (v["speed"].get("decode_tokens") or 0))
    overhead = max(0.0, (mem["peak_rss_mb"] or 0.0) * 2**20 - weights - probe_kv)
    element = kv_tok / (2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"])

    def fits(budget_gb: float, w: float, per_tok: float) -> int:
        free = budget_gb * 1e9 * (1 - cap.headroom) - w - overhead
        return max(0, int(free // (per_tok * cap.context_tokens)))

    plan = {"context_tokens": cap.context_tokens, "headroom": cap.headroom, "weights_bytes": weights,
            "overhead_bytes": overhead, "kv_bytes_per_token": kv_tok,
            "max_sequences": {str(b): fits(b, weights, kv_tok) for b in cap.memory_budget_gb}}
    if cap.params_b and facts.get("params"):
        w_big = weights / facts["params"] * cap.params_b * 1e9
        kv_big = 2 * cap.layers * cap.kv_heads * cap.head_dim * element
        plan["scaled"] = {"params_b": cap.params_b, "layers": cap.layers, "kv_heads": cap.kv_heads,
                          "head_dim": cap.head_dim, "weights_bytes": w_big, "kv_bytes_per_token": kv_big,
                          "max_sequences": {str(b): fits(b, w_big, kv_big) for b in cap.memory_budget_gb}}
    return plan


def roofline(v: dict, bandwidth: dict | None) -> dict | None:
    """Bytes read per decoded token (every weight once + the KV cache at the probe's mean context) and the share
    of the measured memory bandwidth that decode achieved: decode tok/s x bytes/token / bandwidth."""
    sp, mem = v["speed"], v["memory"]
    if not bandwidth or not sp.get("decode_tokens_per_s"):
        return None
    context = (sp.get("prompt_tokens") or 0) + (sp.get("decode_tokens") or 0) / 2
    per_token = mem["artifact_bytes"] + mem["kv_bytes_per_token"] * context
    achieved = sp["decode_tokens_per_s"] * per_token
    return {"bytes_per_token": per_token, "context_tokens": context, "achieved_bytes_per_s": achieved,
            "bandwidth_bytes_per_s": bandwidth["bytes_per_s"], "share": achieved / bandwidth["bytes_per_s"],
            "ceiling_tokens_per_s": bandwidth["bytes_per_s"] / per_token}


def variant_summary(result: dict, bandwidth: dict | None = None, degeneration: dict | None = None,
                    seed: int = 0) -> dict:
    """The summary.json entry for one variant, from its result file and evaluation directory."""
    if result["status"] != "ok":
        return {"status": result["status"], "reason": result.get("reason"), "runtime": result.get("runtime"),
                "description": result.get("description")}
    ev_dir = Path(result["evaluation"]["dir"])
    tf = read_json(ev_dir / "teacher_forced.json")
    samples = read_jsonl(ev_dir / "samples.jsonl")
    speed = read_json(ev_dir / "speed.json")
    drift = drift_figures(tf)
    free = free_running_figures(samples, degeneration)
    recall = recall_figures(tf, samples)
    from pipeline.stats import conversation_intervals

    intervals = conversation_intervals(tf, samples, seed)
    facts = result["model"]["facts"]
    info = speed.get("runtime_info") or {}
    info_a = result["artifact"]["info"]
    formula = kv_bytes_per_token_formula(facts, cache_element_bytes(info, facts["head_dim"]))
    kv = speed.get("kv_reported")
    reported = kv_reported_per_token(kv)
    gap = abs(reported - formula) / formula if reported else None
    out = {
        "status": "ok",
        "reason": None,
        "description": result.get("description"),
        "runtime": result["runtime"],
        "kernel": info.get("kernel"),
        "runtime_info": info,
        "drift": {
            "kld_mean": drift["kld_mean"], "kld_median": drift["kld_median"], "kld_p90": drift["kld_p90"],
            "kld_p99": drift["kld_p99"], "kld_max": drift["kld_max"], "top1_agreement": drift["top1_agreement"],
            "delta_nll": drift["delta_nll"], "scored_tokens": drift["tokens"],
            "pass_rate": free["pass_rate"], "flip_rate": free["flip_rate"],
        },
        "intervals": intervals,
        "drift_detail": {k: drift[k] for k in ("kld_by_position", "kld_by_turn", "kld_by_suite")},
        "free_running": {**free, "source": result["evaluation"].get("free_running_source")},
        "recall": recall,
        "deployment": deployment_figures(result.get("deployment"), samples),
        "speed": {k: speed.get(k) for k in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s",
                                            "itl_p99_s", "prompt_tokens", "decode_tokens", "repeats", "cpu_noise",
                                            "noisy", "load_s")},
        "memory": {
            "artifact_bytes": result["artifact"]["bytes"],
            "peak_rss_mb": speed.get("peak_rss_mb"),
            "kv_bytes_per_token": formula,
            "kv_bytes_per_token_reported": reported,
            "kv_reported_source": (kv or {}).get("source") if not (kv or {}).get("allocated_bytes")
            else "llama.cpp log: KV buffer size / cells",
            "kv_cache": info.get("cache_type_k") if info.get("runtime") == "llamacpp"
            else (f"int{info['kv_cache']['bits']}" if info.get("kv_cache") else info.get("dtype")),
            "kv_formula_gap": gap,
            "kv_gap_flagged": bool(gap is not None and gap > 0.10),
        },
        "artifact": {"path": result["artifact"]["path"], "format": info_a.get("format"),
                     "gguf_type": info_a.get("gguf_type"), "tensor_types": info_a.get("tensor_types"),
                     "group_size": info_a.get("group_size"), "quantize_settings": info_a.get("quantize_settings"),
                     "quantize_wall_s": info_a.get("quantize_wall_s", info_a.get("wall_s")),
                     "quantize_peak_rss_mb": info_a.get("quantize_peak_rss_mb")},
        "paths": {
            "teacher_forced": f"{result['runtime']} ({info.get('kernel')})",
            "speed_memory": f"{result['runtime']} ({info.get('kernel')}), fresh process",
            "free_running": result["evaluation"].get("free_running_source"),
            "dequantized_check": result["evaluation"].get("dequantized_check"),
        },
    }
    out["roofline"] = roofline(out, bandwidth)
    return out


# ------------------------------------------------------------------------------------------ decision

_OBJECTIVES = {
    "decode_speed": (lambda v: -(v["speed"]["decode_tokens_per_s"] or 0.0), "decode tokens/s"),
    "memory": (lambda v: v["memory"]["peak_rss_mb"] or float("inf"), "peak RSS"),
    "size": (lambda v: v["memory"]["artifact_bytes"], "artifact size"),
}


def first_failed_constraint(name: str, v: dict, original: dict | None, d: DecisionConfig) -> str | None:
    failed = failed_constraints(v, original, d)
    return failed[0][0] if failed else None


def failed_constraints(v: dict, original: dict | None, d: DecisionConfig) -> list[tuple[str, float]]:
    """Every constraint the variant fails: (message, relative violation), in the configured order."""
    dr, sp, mem = v["drift"], v["speed"], v["memory"]
    checks = [
        (d.max_kld_mean, dr["kld_mean"], lambda lim, x: x <= lim, "mean KLD {x:.4f} > {lim}"),
        (d.max_kld_p99, dr["kld_p99"], lambda lim, x: x <= lim, "p99 KLD {x:.4f} > {lim}"),
        (d.max_flip_rate, dr["flip_rate"], lambda lim, x: x <= lim, "flip rate {x:.1%} > {lim:.0%}"),
        (d.min_decode_tokens_per_s, sp["decode_tokens_per_s"], lambda lim, x: x >= lim, "decode {x:.1f} tok/s < {lim}"),
        (d.max_peak_rss_mb, mem["peak_rss_mb"], lambda lim, x: x <= lim, "peak RSS {x:.0f} MB > {lim}"),
        (d.max_artifact_bytes, mem["artifact_bytes"], lambda lim, x: x <= lim, "artifact {x} bytes > {lim}"),
    ]
    if d.min_pass_rate_ratio is not None and original and original["drift"]["pass_rate"]:
        ratio = (dr["pass_rate"] or 0.0) / original["drift"]["pass_rate"]
        checks.append((d.min_pass_rate_ratio, ratio, lambda lim, x: x >= lim, "pass rate {x:.0%} of the original's < {lim:.0%}"))
    out = []
    for limit, value, ok, msg in checks:
        if limit is None:
            continue
        if value is None:
            out.append((msg.split(" {")[0] + " not measured", float("inf")))
        elif not ok(limit, value):
            out.append((msg.format(x=value, lim=limit), abs(value - limit) / max(abs(limit), 1e-12)))
    return out


def _point(v: dict) -> tuple[float, float, float] | None:
    """(drift, -decode tokens/s, memory): all lower-is-better, for the Pareto front."""
    k, tps, mem = v["drift"]["kld_mean"], v["speed"]["decode_tokens_per_s"], v["memory"]["peak_rss_mb"]
    if k is None or tps is None or mem is None:
        return None
    return (k, -tps, mem)


def decide(variants: dict[str, dict], d: DecisionConfig) -> dict:
    """The recommended variant by the objective among those meeting every constraint, the Pareto front over
    (mean KLD, decode tokens/s, peak memory), and for every other variant why it lost: the first constraint it
    failed, else the variant that dominates it, else that it ranks lower on the objective."""
    from pipeline.stats import dominator, pareto_front

    key, label = _OBJECTIVES[d.objective]
    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    original = ok.get("original")
    points = {n: p for n, v in ok.items() if (p := _point(v)) is not None}
    front = pareto_front(points)
    reasons: dict[str, str] = {}
    failed_by: dict[str, str] = {}
    passing = []
    for name, v in ok.items():
        failed = first_failed_constraint(name, v, original, d)
        if failed:
            failed_by[name] = failed
            reasons[name] = f"fails constraint: {failed}"
        else:
            passing.append(name)
    for name, v in variants.items():
        if v["status"] != "ok":
            reasons[name] = f"{v['status']}: {v.get('reason')}"
    base = {"objective": d.objective, "decision": d.name, "pareto_front": front,
            "pareto_axes": ["mean KLD (lower)", "decode tokens/s (higher)", "peak RSS MB (lower)"]}
    if not passing:
        # closest: the fewest constraints failed, then the smallest relative violation of them
        def distance(n: str) -> tuple[int, float]:
            f = failed_constraints(ok[n], original, d)
            return len(f), sum(x for _, x in f)

        closest = min(ok, key=lambda n: (*distance(n), n)) if ok else None
        return {**base, "variant": None,
                "summary": f"no variant meets every constraint of decision '{d.name}'"
                           + (f"; closest: {closest} ({failed_by.get(closest, '')})" if closest else ""),
                "closest": closest, "reasons": reasons}
    passing.sort(key=lambda n: (key(ok[n]), n))
    lead = key(ok[passing[0]])
    tied = [n for n in passing if abs(key(ok[n]) - lead) <= d.tie_tolerance * abs(lead)]
    best = min(tied, key=lambda n: (ok[n]["drift"]["kld_mean"] if ok[n]["drift"]["kld_mean"] is not None
                                    else float("inf"), n))
    passing = [best] + [n for n in passing if n != best]
    for name in passing[1:]:
        dom = dominator(name, points) if name in points else None
        if name in tied:
            reasons[name] = (f"meets every constraint and its {label} is within {d.tie_tolerance:.0%} of the best "
                             f"(a tie), but {best} drifts less")
        elif dom:
            reasons[name] = (f"meets every constraint but is dominated by {dom} (at least as low drift, as fast "
                             "and as small, better on one)")
        else:
            reasons[name] = f"meets every constraint and is on the Pareto front, but has lower {label} than {best}"
    b = ok[best]
    tie_note = (f" (ties within {d.tie_tolerance:.0%}: {', '.join(n for n in tied if n != best)}; lowest drift wins)"
                if len(tied) > 1 else "")
    reasons[best] = (f"best {label} ({_fmt_objective(d.objective, b)}){tie_note} among variants meeting every "
                     f"constraint; mean KLD {b['drift']['kld_mean']:.4f}, flip rate {(b['drift']['flip_rate'] or 0):.1%}")
    return {**base, "variant": best, "summary": reasons[best], "reasons": reasons}


def _fmt_objective(objective: str, v: dict) -> str:
    if objective == "decode_speed":
        return f"{v['speed']['decode_tokens_per_s']:.1f} tok/s"
    if objective == "memory":
        return f"{v['memory']['peak_rss_mb']:.0f} MB"
    return f"{v['memory']['artifact_bytes'] / 2**20:.1f} MiB"
