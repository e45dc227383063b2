"""The summary contract, declared once: every metric of a variant's summary entry with its section, which
direction is better, its interval, whether it is hardware-independent, its label and its format.

The summary entries (``pipeline.decide.variant_summary``), the nightly gate's metrics and tolerance validation
(``pipeline.decide.nightly_gate``), the history line, the report's tables, the JSON Schema (``summary_schema`` ->
``schema/summary.schema.json``) and the contract test are all derived from ``METRICS``. Adding a metric is one
entry here plus its computation (a key of the same name in the figures its ``source`` names). A leaf module.
"""

from __future__ import annotations

from dataclasses import dataclass

# 2: the metric catalogue (tail mass of the reference's top-K, the deployment path, tokenizer divergence).
# 3: speed and peak RSS from interleaved trials with intervals (and the A/A noise floor), p99.9 KLD and Δp,
#    the pass-rate ratio interval, the conversation-level test and minimum detectable effects.
# 4: peak RSS per trial with the load's peak and the resident size after it apart, family-wise adjusted p-values,
#    the runtime switch's flip floor and flips against the original on the same runtime, "no native kernel".
SCHEMA_VERSION = 4
# Summaries the gate still reads: a metric that one side lacks is reported as "not compared", never a regression.
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)
SECTIONS = ("drift", "speed", "memory")


@dataclass(frozen=True)
class Metric:
    name: str                       # key in the variant's section, the gate and the history line
    section: str                    # drift | speed | memory
    better: str | None              # lower | higher | None (a count or setting, never judged)
    label: str                      # what a reader sees
    fmt: str                        # format spec for tables
    source: str                     # which figures aggregate computes it in: drift | free | speed | memory
    unit: str = ""
    interval: str | None = None     # key in the variant's "intervals" (95 %: bootstrap over conversations for
                                    # drift, order statistics over interleaved trials for speed and peak RSS)
    hardware_independent: bool = False   # compared against a baseline from other hardware too
    integer: bool = False
    # How tables show it: value x display_scale in display_unit (fmt applies to the scaled value).
    display_scale: float = 1.0
    display_unit: str | None = None

    def __post_init__(self) -> None:
        assert self.section in SECTIONS, self
        assert self.better in ("lower", "higher", None), self

    def worse(self, new: float, base: float) -> float:
        """How much worse ``new`` is than ``base`` in this metric's direction (negative: better)."""
        return (new - base) if self.better == "lower" else (base - new)


METRICS: tuple[Metric, ...] = (
    Metric("kld_mean", "drift", "lower", "mean KLD", ".4f", "drift", "nats", "kld_mean", True),
    Metric("kld_median", "drift", "lower", "median KLD", ".4f", "drift", "nats", None, True),
    Metric("kld_p90", "drift", "lower", "p90 KLD", ".3f", "drift", "nats", None, True),
    Metric("kld_p99", "drift", "lower", "p99 KLD", ".3f", "drift", "nats", None, True),
    Metric("kld_p99_9", "drift", "lower", "p99.9 KLD", ".3f", "drift", "nats", None, True),
    Metric("kld_max", "drift", "lower", "max KLD", ".3f", "drift", "nats", None, True),
    Metric("top1_agreement", "drift", "higher", "top-1 agreement", ".1%", "drift", "", "top1_agreement", True),
    Metric("delta_nll", "drift", "lower", "ΔNLL", "+.3f", "drift", "nats", "delta_nll", True),
    # Δp: change in the probability of the reference's token, variant minus reference (llama.cpp's KLD tool)
    Metric("delta_p_mean", "drift", "higher", "mean Δp", "+.2%", "drift", "", None, True),
    Metric("delta_p_rms", "drift", "lower", "RMS Δp", ".2%", "drift", "", None, True),
    # the stored KLD over the exact full-vocabulary KLD on a sample of positions per suite (1: exact)
    Metric("kld_stored_exact_ratio", "drift", None, "stored / exact KLD (sample)", ".3f", "drift", "", None, True),
    Metric("tail_mass_mean", "drift", None, "reference tail mass outside top-K", ".2%", "drift", "", None, True),
    Metric("scored_tokens", "drift", None, "scored tokens", "d", "drift", "tokens", None, True, integer=True),
    Metric("pass_rate", "drift", "higher", "pass rate", ".0%", "free", "", "pass_rate", True),
    Metric("flip_rate", "drift", "lower", "flip rate", ".1%", "free", "", "flip_rate", True),
    Metric("ttft_s", "speed", "lower", "TTFT", ".3f", "speed", "s", "ttft_s"),
    Metric("prefill_tokens_per_s", "speed", "higher", "prefill tok/s", ".0f", "speed", "tokens/s",
           "prefill_tokens_per_s"),
    Metric("decode_tokens_per_s", "speed", "higher", "decode tok/s", ".1f", "speed", "tokens/s",
           "decode_tokens_per_s"),
    Metric("itl_p50_s", "speed", "lower", "ITL p50", ".1f", "speed", "s", "itl_p50_s", display_scale=1000,
           display_unit="ms"),
    Metric("itl_p99_s", "speed", "lower", "ITL p99", ".1f", "speed", "s", "itl_p99_s", display_scale=1000,
           display_unit="ms"),
    # file sizes move with the quantizer's version, so they are compared only in the same environment
    Metric("artifact_bytes", "memory", "lower", "artifact size", ".1f", "memory", "bytes", integer=True,
           display_scale=1 / 2**20, display_unit="MiB"),
    # each speed trial's own resident peak (the high-water mark reset at the trial's start), apart from the load's
    Metric("peak_rss_mb", "memory", "lower", "peak RSS", ".0f", "memory", "MB", "peak_rss_mb"),
    Metric("load_peak_rss_mb", "memory", "lower", "load peak RSS", ".0f", "memory", "MB", "load_peak_rss_mb"),
    Metric("steady_rss_mb", "memory", "lower", "RSS after load", ".0f", "memory", "MB", "steady_rss_mb"),
    Metric("kv_bytes_per_token", "memory", "lower", "KV bytes/token", ".0f", "memory", "bytes", None, True),
    Metric("kv_bytes_per_token_reported", "memory", None, "KV bytes/token (runtime)", ".0f", "memory", "bytes"),
)
BY_NAME = {m.name: m for m in METRICS}

# Descriptive fields of the sections (settings and provenance, not judged), with their JSON types.
SECTION_FIELDS = {
    "speed": {"prompt_tokens": ["integer", "null"], "decode_tokens": ["integer", "null"],
              "repeats": ["integer", "null"], "cpu_noise": ["number", "null"], "trials": ["integer", "null"],
              "noisy_trials": ["integer", "null"], "load_s": ["number", "null"]},
    "memory": {"kv_reported_source": ["string", "null"], "kv_cache": ["string", "null"],
               "kv_formula_gap": ["number", "null"], "kv_gap_flagged": "boolean",
               "kv_formula_at_report": ["number", "null"], "kv_report_context": ["integer", "null"]},
    "drift": {},
}


# A variant's row of one benchmark task (summary.variants.NAME.benchmarks.TASK, pipeline.decide.bench_summary):
# field -> JSON type. Accuracy and recovery are intervals (95 %, bootstrap over the task's samples, paired for
# recovery); recovery, the flips and the McNemar p-values are null for the original (the reference) and where the
# run has no original's answers. The task's own facts are in summary.benchmarks.TASK (BENCH_TASK_FIELDS).
BENCH_ROW_FIELDS = {
    "status": {"const": "ok"},
    "metric": "string",                      # the per-sample metric that counts a sample correct (e.g. acc_norm)
    "metrics": "object",                     # every metric of the task, lm-eval's aggregate
    "samples": "integer",
    "accuracy": ["object", "null"],
    "recovery": ["object", "null"],          # accuracy / the original's accuracy on the same samples
    "correct_to_wrong": ["integer", "null"],
    "wrong_to_correct": ["integer", "null"],
    "flip_rate": ["number", "null"],
    "mcnemar_p": ["number", "null"],         # exact McNemar test of the flips
    "mcnemar_p_adjusted": ["number", "null"],   # family-wise adjusted over the task's variants
    "no_signal_for_flips": ["boolean", "null"],
    "limit": ["integer", "null"],            # profile.bench_limit (null: every sample)
    "task_key": "object",                    # task, version, data_sha256, lm_eval
    "decoding": "object",
    "sandbox": ["object", "null"],           # how model-written code was confined (HumanEval), else null
    "wall_s": ["number", "null"],
}
# Fields a row may lack (a summary written before them, a task without them): field -> JSON schema.
BENCH_CATEGORY = {"type": "object", "required": ["samples", "correct", "accuracy", "correct_to_wrong",
                                                 "wrong_to_correct"],
                  "properties": {"samples": {"type": "integer"}, "correct": {"type": "integer"},
                                 "accuracy": {"type": ["number", "null"]},
                                 "correct_to_wrong": {"type": ["integer", "null"]},
                                 "wrong_to_correct": {"type": ["integer", "null"]}},
                  "additionalProperties": False}
BENCH_ROW_OPTIONAL_FIELDS = {
    # per category of a task whose samples carry one (business_mc), in the data file's order: samples, right
    # answers, accuracy, and the flips against the original (null for the original and without its answers)
    "by_category": {"type": "object", "additionalProperties": BENCH_CATEGORY},
}
BENCH_TASK_FIELDS = {
    "task": "object", "metric": "string", "limit": ["integer", "null"], "decoding": ["object", "null"],
    "reference": ["string", "null"], "reference_accuracy": ["object", "null"],
    "no_signal_for_flips": ["boolean", "null"], "multiple_comparisons": "string", "note": ["string", "null"],
    "variants": "array",
}


def _typed(fields: dict) -> dict:
    return {k: (t if isinstance(t, dict) else {"type": t}) for k, t in fields.items()}


def metric(name: str) -> Metric:
    if name not in BY_NAME:
        from pipeline.infra.errors import ConfigError

        raise ConfigError(f"unknown metric {name!r}: expected one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def section_values(section: str, sources: dict[str, dict]) -> dict:
    """One summary section from the computed figures: every catalogue metric of it, from its source."""
    return {m.name: sources[m.source].get(m.name) for m in METRICS if m.section == section}


# How a run decoded its free-running replies (summary.run.decoding: the runtime.repeat_* settings)
DECODING_KEYS = ("repeat_penalty", "repeat_last_n", "repeat_scope")


def decoding_of(summary: dict) -> dict:
    """A summary's decoding, normalised: plain greedy ({"repeat_penalty": 1.0}) for no penalty, an empty window or
    a summary from before the setting existed; else its runtime.repeat_* values. Two runs decoded alike give equal
    dicts (the nightly gate compares them; the report describes them)."""
    d = (summary.get("run") or {}).get("decoding") or {}
    if not d or d.get("repeat_penalty", 1.0) == 1.0 or d.get("repeat_last_n", 0) == 0:
        return {"repeat_penalty": 1.0}
    return {k: d.get(k) for k in DECODING_KEYS}


def hardware_independent() -> tuple[str, ...]:
    return tuple(m.name for m in METRICS if m.hardware_independent)


def value(variant: dict, name: str):
    m = BY_NAME[name]
    return (variant.get(m.section) or {}).get(m.name)


def summary_schema() -> dict:
    """JSON Schema (draft 2020-12) of summary.json, generated from the catalogue; published as
    schema/summary.schema.json and checked against every summary written and every baseline read."""
    def section(name: str) -> dict:
        props = {m.name: {"type": ["integer" if m.integer else "number", "null"],
                          "description": f"{m.label}" + (f" ({m.unit})" if m.unit else "")
                          + (f"; {m.better} is better" if m.better else "")}
                 for m in METRICS if m.section == name}
        required = sorted(props)
        # descriptive fields are typed but not required: a field added to the contract later must not make a
        # summary written before it (a committed nightly baseline) unreadable; the metrics are required
        props.update({k: {"type": t} for k, t in SECTION_FIELDS[name].items()})
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    interval = {"type": "object", "required": ["estimate", "low", "high"],
                "properties": {k: {"type": ["number", "null"]} for k in ("estimate", "low", "high", "level")}}
    p_value = {"type": ["number", "null"], "minimum": 0, "maximum": 1}
    # a "significantly worse" test: its raw p-value and the family-wise adjusted one (decision.multiple_comparisons)
    adjusted_test = {"type": "object", "required": ["p", "p_adjusted", "method"],
                     "properties": {"p": p_value, "p_adjusted": p_value,
                                    "method": {"enum": ["holm", "bonferroni", "none"]}}}
    bench_row = {"type": "object", "required": sorted(BENCH_ROW_FIELDS),
                 "properties": {**_typed(BENCH_ROW_FIELDS), **_typed(BENCH_ROW_OPTIONAL_FIELDS)},
                 "additionalProperties": False}
    other_row = {"type": "object", "required": ["status", "reason"],
                 "properties": {"status": {"const": "skipped"}, "reason": {"type": ["string", "null"]}},
                 "additionalProperties": False}
    ok_variant = {
        "type": "object",
        "required": ["status", "runtime", *SECTIONS, "intervals", "free_running", "artifact", "paths",
                     "no_native_kernel"],
        "properties": {"status": {"const": "ok"}, **{s: section(s) for s in SECTIONS},
                       "intervals": {"type": "object", "additionalProperties": interval},
                       "free_running": {"type": "object", "required": ["mcnemar_p", "mcnemar_p_adjusted"],
                                        "properties": {"mcnemar_p": p_value, "mcnemar_p_adjusted": p_value}},
                       # why the variant's speed and memory are not its format's (None: measured on its kernel)
                       "no_native_kernel": {"type": ["string", "null"]},
                       "deployment": {"type": ["object", "null"]}, "recall": {"type": ["object", "null"]},
                       "benchmarks": {"type": "object", "additionalProperties": {"oneOf": [bench_row, other_row]}}},
    }
    other_variant = {"type": "object", "required": ["status", "reason"],
                     "properties": {"status": {"enum": ["skipped", "failed"]}, "reason": {"type": ["string", "null"]}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "quantdrift/summary.schema.json",
        "title": "quantdrift summary.json",
        "description": "Generated from pipeline/config/summary_contract.py; do not edit by hand (tests check it matches).",
        "type": "object",
        "required": ["schema_version", "run", "model", "reference", "variants", "recommendation", "versions",
                     "hardware"],
        "properties": {
            "schema_version": {"const": SCHEMA_VERSION},
            "variants": {"type": "object", "additionalProperties": {"oneOf": [ok_variant, other_variant]}},
            "recommendation": {"type": "object", "required": ["variant", "summary", "reasons", "pass_drop",
                                                              "multiple_comparisons", "steps"],
                               "properties": {"variant": {"type": ["string", "null"]},
                                              "multiple_comparisons": {"enum": ["holm", "bonferroni", "none"]},
                                              "pass_drop": {"type": "object", "additionalProperties": adjusted_test},
                                              "steps": {"type": "array"}}},
            "runtime_floor": {"type": "object", "additionalProperties": {"type": "object"}},
            "benchmarks": {"type": "object", "additionalProperties": {
                "type": "object", "required": sorted(BENCH_TASK_FIELDS), "properties": _typed(BENCH_TASK_FIELDS),
                "additionalProperties": False}},
        },
    }


SCHEMA_FILE = "schema/summary.schema.json"


def validate_summary(summary: dict, what: str = "summary.json") -> None:
    """Raise ConfigError naming the first place where ``summary`` breaks the published schema."""
    import jsonschema

    from pipeline.infra.errors import ConfigError

    errors = sorted(jsonschema.Draft202012Validator(summary_schema()).iter_errors(summary), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.path) or "(top level)"
        raise ConfigError(f"{what} does not match {SCHEMA_FILE} (schema_version {SCHEMA_VERSION}) at {where}: "
                          f"{e.message}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


if __name__ == "__main__":   # python -m pipeline.config.summary_contract > schema/summary.schema.json
    import json

    print(json.dumps(summary_schema(), indent=2, ensure_ascii=False))
