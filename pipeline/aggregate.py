"""Turn per-variant raw results into the summary figures (the summary.json contract) and the decision."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline import metrics
from pipeline.config import DecisionConfig
from pipeline.store import read_json, read_jsonl

SCHEMA_VERSION = 1
CACHE_BYTES = {"f32": 4.0, "float32": 4.0, "f16": 2.0, "float16": 2.0, "bfloat16": 2.0, "q8_0": 34 / 32,
               "q4_0": 18 / 32, "int8": 1.0}


def kv_bytes_per_token_formula(facts: dict, element_bytes: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element (q8_0 counts its per-block scale)."""
    return 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * element_bytes


def cache_element_bytes(runtime_info: dict) -> float:
    if runtime_info.get("runtime") == "llamacpp":
        k = CACHE_BYTES[runtime_info.get("cache_type_k", "f16")]
        v = CACHE_BYTES[runtime_info.get("cache_type_v", "f16")]
        return (k + v) / 2
    return CACHE_BYTES.get(runtime_info.get("kv_cache_dtype") or runtime_info.get("dtype", "float32"), 4.0)


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


def free_running_figures(samples: list[dict]) -> dict:
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
    }


def variant_summary(result: dict) -> dict:
    """The summary.json entry for one variant, from its result file and evaluation directory."""
    if result["status"] != "ok":
        return {"status": result["status"], "reason": result.get("reason"), "runtime": result.get("runtime"),
                "description": result.get("description")}
    ev_dir = Path(result["evaluation"]["dir"])
    tf = read_json(ev_dir / "teacher_forced.json")
    samples = read_jsonl(ev_dir / "samples.jsonl")
    speed = read_json(ev_dir / "speed.json")
    drift = drift_figures(tf)
    free = free_running_figures(samples)
    facts = result["model"]["facts"]
    info = speed.get("runtime_info") or {}
    info_a = result["artifact"]["info"]
    formula = kv_bytes_per_token_formula(facts, cache_element_bytes(info))
    kv = speed.get("kv_reported")
    reported = (kv["bytes"] / kv["tokens"]) if kv and kv.get("tokens") else None
    gap = abs(reported - formula) / formula if reported else None
    return {
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
        "drift_detail": {k: drift[k] for k in ("kld_by_position", "kld_by_turn", "kld_by_suite")},
        "free_running": {**free, "source": result["evaluation"].get("free_running_source")},
        "speed": {k: speed.get(k) for k in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "itl_p50_s",
                                            "itl_p99_s", "prompt_tokens", "decode_tokens", "repeats", "cpu_noise",
                                            "noisy", "load_s")},
        "memory": {
            "artifact_bytes": result["artifact"]["bytes"],
            "peak_rss_mb": speed.get("peak_rss_mb"),
            "kv_bytes_per_token": formula,
            "kv_bytes_per_token_reported": reported,
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


# ------------------------------------------------------------------------------------------ decision

_OBJECTIVES = {
    "decode_speed": (lambda v: -(v["speed"]["decode_tokens_per_s"] or 0.0), "decode tokens/s"),
    "memory": (lambda v: v["memory"]["peak_rss_mb"] or float("inf"), "peak RSS"),
    "size": (lambda v: v["memory"]["artifact_bytes"], "artifact size"),
}


def first_failed_constraint(name: str, v: dict, original: dict | None, d: DecisionConfig) -> str | None:
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
    for limit, value, ok, msg in checks:
        if limit is None:
            continue
        if value is None:
            return msg.split(" {")[0] + " not measured"
        if not ok(limit, value):
            return msg.format(x=value, lim=limit)
    return None


def decide(variants: dict[str, dict], d: DecisionConfig) -> dict:
    """The recommended variant by the objective among those meeting every constraint, and why each other lost."""
    key, label = _OBJECTIVES[d.objective]
    ok = {n: v for n, v in variants.items() if v["status"] == "ok"}
    original = ok.get("original")
    reasons: dict[str, str] = {}
    passing = []
    for name, v in ok.items():
        failed = first_failed_constraint(name, v, original, d)
        if failed:
            reasons[name] = f"fails constraint: {failed}"
        else:
            passing.append(name)
    for name, v in variants.items():
        if v["status"] != "ok":
            reasons[name] = f"{v['status']}: {v.get('reason')}"
    if not passing:
        closest = min(ok, key=lambda n: ok[n]["drift"]["kld_mean"] or 0.0) if ok else None
        return {"variant": None, "objective": d.objective, "decision": d.name,
                "summary": f"no variant meets every constraint of decision '{d.name}'"
                           + (f"; closest by mean KLD: {closest}" if closest else ""),
                "closest": closest, "reasons": reasons}
    passing.sort(key=lambda n: (key(ok[n]), n))
    best = passing[0]
    for name in passing[1:]:
        reasons[name] = f"meets every constraint but has lower {label} than {best}"
    b = ok[best]
    reasons[best] = (f"best {label} ({_fmt_objective(d.objective, b)}) among variants meeting every constraint; "
                     f"mean KLD {b['drift']['kld_mean']:.4f}, flip rate {(b['drift']['flip_rate'] or 0):.1%}")
    return {"variant": best, "objective": d.objective, "decision": d.name, "summary": reasons[best],
            "reasons": reasons}


def _fmt_objective(objective: str, v: dict) -> str:
    if objective == "decode_speed":
        return f"{v['speed']['decode_tokens_per_s']:.1f} tok/s"
    if objective == "memory":
        return f"{v['memory']['peak_rss_mb']:.0f} MB"
    return f"{v['memory']['artifact_bytes'] / 2**20:.1f} MiB"
