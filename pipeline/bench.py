"""`make bench`: per variant, decode and prefill tokens/s measured through the pipeline's probe, teacher-forced
scoring tokens/s, and the wall time of every stage that built the comparison. Numbers are for the notes and
for trends on one machine; no test asserts absolute timings.
"""

from __future__ import annotations

import logging
import time

from pipeline.config import Config, VariantConfig
from pipeline.store import load_manifest, write_json

log = logging.getLogger(__name__)


def _variant_config(cfg: Config, name: str) -> VariantConfig:
    if name == cfg.variant.name:
        return cfg.variant
    from pipeline.config import load_variant

    return load_variant(name)


def _stage_walls(cfg: Config, name: str) -> dict:
    md = cfg.model_dir
    dirs = {
        "prepare": md / "original",
        "convert_f16": md / "gguf-f16",
        "quantize": md / "variants" / name.split("+", 1)[0],
        "parity": md / "parity",
        "evaluate": md / "runs" / cfg.run.name / name,
    }
    for suite in cfg.run.suites:
        dirs[f"reference_{suite}"] = md / "reference" / cfg.run.name / suite
    out = {}
    for stage, d in dirs.items():
        m = load_manifest(d)
        out[stage] = m.get("wall_s") if m else None
    return out


def run_bench(cfg: Config) -> int:
    import dataclasses

    from pipeline.conversation import ChatRenderer
    from pipeline.prepare import prepare
    from pipeline.probe import probe_speed
    from pipeline.quantizers import build_artifact
    from pipeline.reference import n_ctx_for, reply_positions
    from pipeline.runtimes import load_runtime
    from pipeline.run import evaluate_job, load_suites, probe_prompt, setup_reference

    names = cfg.run.variants or [cfg.variant.name]
    original = prepare(cfg.model, cfg.model_dir)
    renderer = ChatRenderer(original.checkpoint, cfg.model.trust_remote_code, cfg.model.allow_plain_template)
    suites = load_suites(cfg, original, renderer)
    refs, producer, _ = setup_reference(cfg, original, renderer, suites)
    longest = max((tr for r in refs.values() for tr in r.transcripts), key=lambda tr: len(tr["ids"]))
    positions = reply_positions(longest)[0].tolist()
    prompt = probe_prompt(renderer, suites, cfg.profile.speed.prompt_tokens)
    rows = {}
    for name in names:
        variant = _variant_config(cfg, name)
        vcfg = dataclasses.replace(cfg, variant=variant, command="evaluate")
        t0 = time.perf_counter()
        result = evaluate_job(vcfg)   # cached when `make compare` already ran
        if result["status"] != "ok":
            rows[name] = {"status": result["status"], "reason": result.get("reason")}
            continue
        artifact = build_artifact(variant, original, vcfg)
        speed = probe_speed(vcfg, variant, artifact, prompt)
        rt = load_runtime(variant, artifact.path, vcfg,
                          n_ctx=n_ctx_for(len(longest["ids"]) + 8, original.facts.get("context_length")))
        rt.score(longest["ids"], positions[:1], [[0]])   # warm-up
        t = time.perf_counter()
        rt.score(longest["ids"], positions, [[0]] * len(positions))
        score_s = time.perf_counter() - t
        rt.close()
        rows[name] = {
            "status": "ok",
            "decode_tokens_per_s": speed["decode_tokens_per_s"],
            "prefill_tokens_per_s": speed["prefill_tokens_per_s"],
            "ttft_s": speed["ttft_s"],
            "cpu_noise": speed["cpu_noise"],
            "scoring_tokens_per_s": len(longest["ids"]) / score_s,
            "scored_sequence_tokens": len(longest["ids"]),
            "stage_wall_s": _stage_walls(vcfg, name),
            "bench_wall_s": time.perf_counter() - t0,
        }
    out = {"model": cfg.model.name, "run": cfg.run.name, "threads": cfg.runtime.n_threads, "variants": rows}
    if cfg.bench.batched_variant:
        out["batched"] = _batched(cfg, original, renderer, suites)
    write_json(cfg.results_dir / "bench.json", out)
    print(format_bench(out))
    return 0


def _batched(cfg: Config, original, renderer, suites: dict) -> dict:
    """The batched path against llama-batched-bench (pipeline.batched_bench); skipped, with the reason, where the
    variant is not a llama.cpp one or the tool is not built."""
    import dataclasses

    from pipeline.batched_bench import bench_prompts, compare_batched
    from pipeline.errors import ConfigError, Skip
    from pipeline.quantizers import build_artifact
    from pipeline.runtimes import runtime_class
    from pipeline.runtimes.llamacpp import gguf_file

    name = cfg.bench.batched_variant
    try:
        variant = _variant_config(cfg, name)
        if not runtime_class(variant.runtime).batched:
            raise ConfigError(f"bench.batched_variant={name!r} runs on {variant.runtime!r}, which does not batch "
                              "sequences: the comparison with llama-batched-bench needs a llama.cpp variant")
        artifact = build_artifact(variant, original, dataclasses.replace(cfg, variant=variant))
        prompts = bench_prompts(renderer, suites, max(cfg.bench.sequences), cfg.bench.prompt_tokens)
        return {"status": "ok", **compare_batched(cfg, variant, gguf_file(artifact.path), prompts)}
    except (ConfigError, Skip) as exc:
        log.warning("batched comparison skipped: %s", exc)
        return {"status": "skipped", "variant": name, "reason": str(exc)}


def format_bench(out: dict) -> str:
    head = (f"{'variant':<22}{'decode tok/s':>13}{'prefill tok/s':>14}{'score tok/s':>12}{'noise':>7}  "
            "stage wall s (prepare/convert/quantize/parity/reference/evaluate)")
    lines = [f"quantdrift bench: {out['model']} ({out['run']}), {out['threads']} threads", head]
    for name, r in out["variants"].items():
        if r["status"] != "ok":
            lines.append(f"{name:<22}{r['status']}: {r.get('reason')}")
            continue
        w = r["stage_wall_s"]
        ref = sum(v for k, v in w.items() if k.startswith("reference_") and v)
        fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        stages = "/".join(fmt(x) for x in (w["prepare"], w["convert_f16"], w["quantize"], w["parity"], ref, w["evaluate"]))
        noise = "-" if r["cpu_noise"] is None else f"{r['cpu_noise']:.0%}"
        lines.append(f"{name:<22}{r['decode_tokens_per_s']:>13.1f}{r['prefill_tokens_per_s']:>14.0f}"
                     f"{r['scoring_tokens_per_s']:>12.0f}{noise:>7}  {stages}")
    batched = out.get("batched")
    if batched:
        from pipeline.batched_bench import format_batched

        lines.append("")
        lines.append(format_batched(batched) if batched["status"] == "ok"
                     else f"batched decoding ({batched['variant']}): skipped: {batched['reason']}")
    return "\n".join(lines)
