"""Typed configuration: Hydra's DictConfig is converted once, at the entry point, into these
dataclasses. Validation lives in ``__post_init__`` and names the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, Skip
from pipeline.settings import build_settings as _build
from pipeline.settings import one_of as _one_of
from pipeline.settings import positive_int as _positive_int
from pipeline.settings import require as _require

PROJECT_ROOT = Path(__file__).resolve().parent.parent
__all__ = ["ConfigError", "Skip", "Config", "PROJECT_ROOT"]   # the exceptions live in pipeline.errors


@dataclass
class ModelConfig:
    source: str
    name: str = ""
    revision: str | None = None
    trust_remote_code: bool = False
    # A tokenizer without a chat template fails unless the user accepts a plain "User:/Assistant:" format.
    allow_plain_template: bool = False
    # dtype the dequantized GGUF or hub checkpoint is saved in; the HF runtime picks its compute dtype itself.
    save_dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(isinstance(self.source, str) and self.source.strip() != "", "model.source", self.source,
                 "a local HF folder, a .gguf file, a hub id, or 'pypi:PACKAGE/FILE.gguf'")
        _one_of("model.save_dtype", self.save_dtype, ("float32", "bfloat16", "float16"))
        if not self.name:
            self.name = default_model_name(self.source)
        _require(all(c.isalnum() or c in "-_." for c in self.name), "model.name", self.name,
                 "letters, digits, '-', '_' or '.' (it names folders)")


def default_model_name(source: str) -> str:
    base = source.split(":", 1)[-1].rstrip("/")
    base = base.split("/")[-1]
    for suffix in (".gguf", ".GGUF"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    cleaned = "".join(c if (c.isalnum() or c in "-_.") else "-" for c in base).strip("-.")
    return cleaned.lower() or "model"


@dataclass
class VariantConfig:
    name: str
    quantizer: str = "none"
    runtime: str = "hf"
    description: str = ""
    # quantizer-specific settings (e.g. {"type": "Q4_K_M"} for gguf), passed to the quantizer class as-is.
    quantize: dict = field(default_factory=dict)
    # runtime-specific settings (e.g. {"flash_attn": true}).
    runtime_options: dict = field(default_factory=dict)
    # The weight variant whose artifact this one loads (set when a KV-cache setting is applied: NAME+kv_...).
    base: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.name) and all(c.isalnum() or c in "-_.+" for c in self.name), "variant.name", self.name,
                 "letters, digits, '-', '_', '.', '+'")
        from pipeline.quantizers import QUANTIZERS, quantizer_class
        from pipeline.runtimes import RUNTIMES, runtime_class

        _one_of("variant.quantizer", self.quantizer, tuple(sorted(QUANTIZERS)))
        _one_of("variant.runtime", self.runtime, tuple(sorted(RUNTIMES)))
        if not self.base:
            self.base = self.name.split("+", 1)[0]
        # Each backend validates its own options now, before any stage runs (a misspelt key fails here).
        quantizer_class(self.quantizer).parse_options(self.quantize, f"variant {self.name}: quantize")
        runtime_class(self.runtime).parse_options(self.runtime_options, f"variant {self.name}: runtime_options")


@dataclass
class KVCacheConfig:
    """KV-cache precision: a runtime setting layered on a weight variant (conf/kv_cache/)."""

    name: str = "fp16"
    bits: int | None = None          # None: the runtime's full-precision cache
    residual_length: int = 16        # hf: newest tokens kept in full precision
    score_chunk: int = 16            # hf: reply tokens per teacher-forced chunk through the cache

    def __post_init__(self) -> None:
        _require(self.bits in (None, 8, 4), "kv_cache.bits", self.bits, "null (full precision), 8 or 4")
        _positive_int("kv_cache.residual_length", self.residual_length)
        _positive_int("kv_cache.score_chunk", self.score_chunk)

    @property
    def quantized(self) -> bool:
        return self.bits is not None


def apply_kv_cache(variant: VariantConfig, kv: KVCacheConfig) -> VariantConfig:
    """The variant with the KV-cache setting folded into its runtime options and its name (BASE+kv_TYPE); the
    runtime translates the setting into its own options."""
    from pipeline.runtimes import runtime_class

    rt = runtime_class(variant.runtime)
    if not kv.quantized:
        if "+kv_" in variant.name and not rt.kv_cache_applied(variant.runtime_options):
            raise ConfigError(f"variant {variant.name!r} is a KV-cache variant but kv_cache={kv.name} is full "
                              f"precision: drop the kv_cache override, or use variant={variant.base}")
        return variant
    try:
        opts, suffix = rt.apply_kv_cache(dict(variant.runtime_options), kv)
    except Skip as exc:
        raise ConfigError(f"kv_cache={kv.name} cannot apply to variant {variant.name!r}: {exc}") from None
    return dataclasses.replace(variant, name=f"{variant.base}+{suffix}", runtime_options=opts,
                               description=f"{variant.description.rstrip('.')}, KV cache {suffix[3:]}")


@dataclass
class SuiteConfig:
    name: str
    path: str = ""
    # A suite generated per model tokenizer instead of read from `path`, e.g. the long-context recall documents:
    # {kind: recall, lengths: [1024, 2048, 4096], depths: [0.1, ...], seed: 0, answer_tokens: 32}
    generate: dict | None = None

    GENERATORS = ("recall",)

    def __post_init__(self) -> None:
        if self.generate:
            _one_of(f"suites.{self.name}.generate.kind", self.generate.get("kind"), self.GENERATORS)
            for d in self.generate.get("depths", []):
                _require(isinstance(d, (int, float)) and 0 < d < 1, f"suites.{self.name}.generate.depths", d,
                         "fractions strictly between 0 and 1")
            for n in self.generate.get("lengths", []):
                _positive_int(f"suites.{self.name}.generate.lengths", n)
        else:
            _require(bool(self.path), f"suites.{self.name}.path", self.path, "a path to a JSONL file")


@dataclass
class CapacityConfig:
    """How many concurrent sequences fit a memory budget (report's capacity plan)."""

    memory_budget_gb: list = field(default_factory=lambda: [16, 24, 48, 80])
    context_tokens: int = 4096
    headroom: float = 0.2
    # The published full size to plan for (a 135M demo answering a 7B question); its geometry below.
    params_b: float | None = None
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.memory_budget_gb, (int, float)):
            self.memory_budget_gb = [self.memory_budget_gb]
        for b in self.memory_budget_gb:
            _require(isinstance(b, (int, float)) and b > 0, "capacity.memory_budget_gb", b, "positive numbers (GB)")
        _positive_int("capacity.context_tokens", self.context_tokens)
        _require(isinstance(self.headroom, (int, float)) and 0 <= self.headroom < 1, "capacity.headroom",
                 self.headroom, "a fraction in [0, 1)")
        _require(self.params_b is None or (isinstance(self.params_b, (int, float)) and self.params_b > 0),
                 "capacity.params_b", self.params_b, "null or a positive number of billions of parameters")
        for key in ("layers", "kv_heads", "head_dim"):
            _positive_int(f"capacity.{key}", getattr(self, key))


@dataclass
class SpeedConfig:
    prompt_tokens: int = 256
    decode_tokens: int = 64
    repeats: int = 1             # timed generations per trial (the trial's figure is their median)
    warmup: int = 1
    # Other processes' share of CPU time above which a speed figure is flagged noisy and re-measured once.
    max_cpu_noise: float = 0.15
    # Rounds of interleaved trials (every variant once per round in its own probe process, the order rotated
    # each round). A paired sign-flip test needs 6 rounds to reach p < 0.05 at all.
    trials: int = 6
    # The A/A noise floor: the control variant (auto: the first evaluated variant of the run) measured a second
    # time each round under another label; the two must come out tied.
    aa: bool = True
    control: str = "auto"

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "decode_tokens", "repeats", "trials"):
            _positive_int(f"profile.speed.{key}", getattr(self, key))


@dataclass
class ProfileConfig:
    name: str = "quick"
    # First N conversations of each suite (None: all).
    max_conversations: int | None = None
    # Upper bound on every turn's max_new_tokens (None: the prompt file's own budgets).
    max_new_tokens_cap: int | None = None
    # Per-suite overrides of the two keys above, e.g. {long_output: {max_new_tokens_cap: 256}}.
    per_suite: dict = field(default_factory=dict)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    # The deployment path: a second free-running pass of the runtimes with a tokenizer of their own (llama.cpp),
    # fed rendered chat text instead of the HF ids, as a server is. diverging: the suites with a text that the GGUF
    # tokenizer splits differently from the HF tokenizer; auto: those and the multi-turn suites (a server
    # re-tokenizes the model's own earlier replies; a single-turn suite without divergence feeds both paths the
    # same ids, so it would measure nothing); always: every suite; never: off.
    deployment_path: str = "auto"
    # Conversations generated at once (their own slots in one llama_batch per step) on a runtime that batches
    # sequences (llama.cpp); 1: one at a time. The reference and every variant use the same setting.
    batch: int = 1

    DEPLOYMENT_PATHS = ("diverging", "auto", "always", "never")

    def __post_init__(self) -> None:
        _one_of("profile.deployment_path", self.deployment_path, self.DEPLOYMENT_PATHS)
        _positive_int("profile.max_conversations", self.max_conversations, allow_none=True)
        _positive_int("profile.batch", self.batch)
        _positive_int("profile.max_new_tokens_cap", self.max_new_tokens_cap, allow_none=True)
        for suite, over in (self.per_suite or {}).items():
            for key, value in (over or {}).items():
                _require(key in ("max_conversations", "max_new_tokens_cap"), f"profile.per_suite.{suite}.{key}",
                         value, "max_conversations or max_new_tokens_cap")
                _positive_int(f"profile.per_suite.{suite}.{key}", value, allow_none=True)
        if isinstance(self.speed, dict):
            self.speed = _build(SpeedConfig, self.speed, "profile.speed")

    def limits(self, suite: str) -> tuple[int | None, int | None]:
        over = (self.per_suite or {}).get(suite) or {}
        return (over.get("max_conversations", self.max_conversations),
                over.get("max_new_tokens_cap", self.max_new_tokens_cap))


@dataclass
class RuntimeConfig:
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    threads: int = 0              # 0: all cores
    n_batch: int = 512            # llama.cpp batch for prefill and scoring
    n_gpu_layers: int = -1        # llama.cpp layers offloaded when device is cuda
    flash_attn: bool = True       # llama.cpp: flash attention for every variant (a quantized V cache requires it)
    # llama.cpp, several sequences decoded together (profile.batch > 1): one KV stream per sequence (false, the
    # default), or one KV buffer shared by all (llama-server's layout when its slot count is left to it); see
    # conf/config.yaml for what each costs
    kv_unified: bool = False
    # Free-running replies: greedy, with this repetition penalty on the last repeat_last_n tokens (1.0: none); the
    # same arithmetic on every runtime (runtimes.base.TokenChoice). Teacher-forced scoring never sees it.
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    repeat_scope: str = "reply"   # reply: the reply's own tokens only; context: the prompt's too (llama.cpp's window)

    def __post_init__(self) -> None:
        _require(isinstance(self.repeat_penalty, (int, float)) and not isinstance(self.repeat_penalty, bool)
                 and 1.0 <= self.repeat_penalty <= 2.0, "runtime.repeat_penalty", self.repeat_penalty,
                 "a number from 1.0 (no penalty) to 2.0")
        self.repeat_penalty = float(self.repeat_penalty)
        _require(isinstance(self.repeat_last_n, int) and not isinstance(self.repeat_last_n, bool)
                 and 0 <= self.repeat_last_n <= 4096, "runtime.repeat_last_n", self.repeat_last_n,
                 "an integer from 0 to 4096 (0: no penalty)")
        _require(self.repeat_scope in ("reply", "context"), "runtime.repeat_scope", self.repeat_scope,
                 "reply or context")
        ok = self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        _require(ok, "runtime.device", self.device, "auto, cpu, cuda or cuda:N")
        _require(isinstance(self.threads, int) and self.threads >= 0, "runtime.threads", self.threads,
                 "0 (all cores) or a positive integer")
        _positive_int("runtime.n_batch", self.n_batch)

    @property
    def n_threads(self) -> int:
        return self.threads or (os.cpu_count() or 1)


@dataclass
class ReferenceConfig:
    # auto: the F16 GGUF (variant gguf_f16) produces the transcripts when the parity check holds, else the original.
    runtime: str = "auto"
    top_k: int = 1024
    # Where the top-K leaves more than this probability outside, the original's whole distribution is kept and the
    # KLD there is exact (None or 1 keeps only the top-K + one tail bucket).
    exact_tail_mass: float | None = 0.01
    # Parity gates: F16 GGUF vs original on the same ids.
    parity_max_kld: float = 1e-3
    parity_tokens: int = 512

    def __post_init__(self) -> None:
        _one_of("reference.runtime", self.runtime, ("auto", "original", "gguf_f16"))
        _positive_int("reference.top_k", self.top_k)
        if self.exact_tail_mass is not None and not 0.0 <= self.exact_tail_mass <= 1.0:
            raise ConfigError(f"reference.exact_tail_mass must be a probability in [0, 1] or null, got "
                              f"{self.exact_tail_mass!r}")


@dataclass
class DecisionConfig:
    name: str = "default"
    objective: str = "decode_speed"   # decode_speed | memory | size | throughput_at_slo (needs `quantdrift load`)
    max_kld_mean: float | None = None
    max_kld_p99: float | None = None
    max_flip_rate: float | None = None
    min_pass_rate_ratio: float | None = None   # variant pass rate / original pass rate
    min_decode_tokens_per_s: float | None = None
    max_peak_rss_mb: float | None = None
    max_artifact_bytes: int | None = None
    # Objective values within this fraction of the best are a tie (speed figures move by several % between runs);
    # a tie goes to the variant with the lower mean KLD.
    tie_tolerance: float = 0.05
    # point: judge constraints on point estimates; upper: on the 95 % interval where the figure has one (a limit
    # inside the interval leaves the variant "undecided": shown, never recommended).
    confidence: str = "upper"
    # Significance level of the paired tests the decision uses (speed ties over interleaved trials).
    alpha: float = 0.05
    # A variant whose checks fall below the original's in the conversation-level sign-flip test with p under this
    # fails (null: off).
    max_pass_drop_p: float | None = 0.05
    # A reply is flagged degenerate when either limit is crossed; flagged replies are counted per variant.
    degeneration: dict = field(default_factory=lambda: {"max_repeated_4gram_rate": 0.35, "max_loop_tokens": 32})

    def __post_init__(self) -> None:
        _one_of("decision.objective", self.objective, ("decode_speed", "memory", "size", "throughput_at_slo"))
        _one_of("decision.confidence", self.confidence, ("point", "upper"))
        for key in ("alpha", "max_pass_drop_p"):
            x = getattr(self, key)
            _require((x is None and key != "alpha") or (isinstance(x, (int, float)) and 0 < x < 1),
                     f"decision.{key}", x, "a probability in (0, 1)" + (" or null" if key != "alpha" else ""))
        _require(isinstance(self.tie_tolerance, (int, float)) and 0 <= self.tie_tolerance < 1,
                 "decision.tie_tolerance", self.tie_tolerance, "a fraction in [0, 1)")
        for k in self.degeneration or {}:
            _one_of(f"decision.degeneration.{k}", k, ("max_repeated_4gram_rate", "max_loop_tokens"))


@dataclass
class RegressConfig:
    name: str = "default"
    baseline: str = ""
    compare_all: bool = False
    junit: str = ""
    tolerances: dict = field(default_factory=dict)
    per_variant: dict = field(default_factory=dict)
    promote: str = ""            # `quantdrift baseline promote RUN`: the run to make the new baseline

    KEYS = ("rel", "abs", "ratio", "interval", "better")

    def __post_init__(self) -> None:
        from pipeline.catalogue import METRICS

        judged = {m.name: m for m in METRICS if m.better}
        for where, tol in [("tolerances", self.tolerances)] + [(f"per_variant.{v}", t)
                                                              for v, t in (self.per_variant or {}).items()]:
            for metric, spec in (tol or {}).items():
                _one_of(f"regress.{where} metric", metric, tuple(judged))
                for k, val in (spec or {}).items():
                    _one_of(f"regress.{where}.{metric}", k, self.KEYS)
                    if k == "better":   # optional: the catalogue declares the direction; a contradiction is an error
                        _one_of(f"regress.{where}.{metric}.better", val, (judged[metric].better,))
                    elif k != "interval":
                        _require(isinstance(val, (int, float)) and val >= 0, f"regress.{where}.{metric}.{k}", val,
                                 "a non-negative number")


@dataclass
class PathsConfig:
    artifacts: str = "artifacts"
    results: str = "results"
    cache: str = ".cache"

    def __post_init__(self) -> None:
        for key in ("artifacts", "results", "cache"):
            setattr(self, key, str(Path(getattr(self, key)).expanduser().resolve()))


@dataclass
class RunSection:
    name: str = ""                         # results/<model>/<run>; defaults to the profile name
    suites: list[str] = field(default_factory=lambda: ["long_output", "multi_turn"])
    variants: list[str] = field(default_factory=list)   # which variants the report aggregates


@dataclass
class CorpusConfig:
    file: str = ""
    ctx: int = 512
    json: bool = False
    max_chunks: int | None = None
    # the distribution KLD is measured from: original (the checkpoint on transformers) or f16 (the F16 GGUF on
    # llama.cpp, as llama-perplexity's --kl-divergence-base)
    baseline: str = "original"

    def __post_init__(self) -> None:
        _one_of("corpus.baseline", self.baseline, ("original", "f16"))


@dataclass
class BenchConfig:
    """`make bench`'s batched-decoding comparison: the pipeline's batched llama.cpp path against llama.cpp's own
    llama-batched-bench on the same GGUF file, threads, prompt and reply lengths and numbers of sequences."""

    batched_variant: str = "gguf_q8_0"   # a llama.cpp variant; "" skips the comparison
    sequences: list = field(default_factory=lambda: [1, 4, 8, 16])
    prompt_tokens: int = 128
    gen_tokens: int = 128
    rounds: int = 3                      # interleaved rounds of the per-variant comparisons (single stream, served)
    batched_rounds: int = 15             # interleaved rounds of the batched-decoding comparison (see conf/config.yaml)
    min_ratio: float = 0.9               # target: our speed-up / llama-batched-bench's speed-up
    llama_tools: str = ""                # folder with llama.cpp's tools; "" asks `make print-llama-tools`
    served: bool = True                  # the GGUF variants served (load settings) beside llama-batched-bench

    def __post_init__(self) -> None:
        _require(isinstance(self.sequences, list) and self.sequences
                 and all(isinstance(n, int) and n >= 1 for n in self.sequences),
                 "bench.sequences", self.sequences, "a non-empty list of positive integers")
        for key in ("prompt_tokens", "gen_tokens", "rounds", "batched_rounds"):
            _positive_int(f"bench.{key}", getattr(self, key))
        _require(isinstance(self.min_ratio, (int, float)) and 0 < self.min_ratio <= 1, "bench.min_ratio",
                 self.min_ratio, "a number in (0, 1]")
        _require(isinstance(self.served, bool), "bench.served", self.served, "true or false")


@dataclass
class CalibrationSweepConfig:
    """`quantdrift calibration` (`make calibration`): each variant quantized again at each calibration sample
    count and scored teacher-forced on the run's reference (pipeline.calibration_sweep)."""

    variants: list = field(default_factory=lambda: ["gptq_w4", "awq_w4_llmc"])
    samples: list = field(default_factory=lambda: [32, 128, 512])

    def __post_init__(self) -> None:
        _require(isinstance(self.variants, list) and all(isinstance(v, str) and v for v in self.variants),
                 "calibration_sweep.variants", self.variants, "a list of GPTQ/AWQ variant names")
        _require(isinstance(self.samples, list) and self.samples
                 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.samples),
                 "calibration_sweep.samples", self.samples, "a non-empty list of positive integers")


@dataclass
class WorkloadConfig:
    """What the served model must do (conf/workload/NAME.yaml): the context depth and reply length of a request and
    the latency targets a concurrency level must meet (null: no target). The load sweep's throughput_at_slo and the
    recommendation are made for this workload."""

    name: str = "chat"
    description: str = ""
    context_tokens: int = 2048
    output_tokens: int = 128
    max_ttft_p99_s: float | None = 1.0
    max_itl_p99_s: float | None = 0.1
    max_e2e_p99_s: float | None = None

    def __post_init__(self) -> None:
        _positive_int("workload.context_tokens", self.context_tokens)
        _positive_int("workload.output_tokens", self.output_tokens)
        for key in ("max_ttft_p99_s", "max_itl_p99_s", "max_e2e_p99_s"):
            x = getattr(self, key)
            _require(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0),
                     f"workload.{key}", x, "null or a positive number of seconds")


@dataclass
class LoadConfig:
    """The load sweep (conf/load/NAME.yaml; pipeline.load): concurrency levels x context depths, each variant served
    by its engine, interleaved rounds."""

    name: str = "short"
    concurrency: list = field(default_factory=lambda: [1, 2, 4])
    depths: list = field(default_factory=lambda: [512])
    include_workload_depth: bool = False   # also measure at workload.context_tokens (the targets' own depth)
    output_tokens: int | None = None       # tokens per request; null: workload.output_tokens
    repeats: int = 3                       # interleaved rounds (a fresh server per variant and round)
    requests_per_stream: int = 2           # a level ends after concurrency x this many requests ...
    min_requests: int = 4                  # ... and at least this many
    max_seconds_per_level: float = 120.0   # ... or after this long (a level that completes nothing reports so)
    knee_gain: float = 0.10                # the knee: the level after which doubling adds less than this
    stop_past_knee: bool = True            # a round stops climbing after two doublings that each added < knee_gain
    ctx_margin: int = 64                   # KV cells per slot beyond depth + output (chat template, rounding)
    memory_budget_gb: float | None = None  # null: the device's memory on CUDA, else the host's
    runtimes: list = field(default_factory=lambda: ["llamacpp", "hf"])   # variant runtimes the sweep serves
    generator_processes: int | None = 1    # guidellm worker processes per level; null: guidellm's one per stream

    def __post_init__(self) -> None:
        from pipeline.engines import ENGINES

        _positive_int("load.generator_processes", self.generator_processes, allow_none=True)

        _require(isinstance(self.runtimes, list) and self.runtimes and all(r in ENGINES for r in self.runtimes),
                 "load.runtimes", self.runtimes,
                 f"a non-empty list of runtimes with a serving engine ({sorted(ENGINES)})")
        for key in ("concurrency", "depths"):
            x = getattr(self, key)
            _require(isinstance(x, list) and x and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                       for n in x), f"load.{key}", x,
                     "a non-empty list of positive integers")
        _require(self.output_tokens is None or (isinstance(self.output_tokens, int) and self.output_tokens >= 1),
                 "load.output_tokens", self.output_tokens, "null or a positive integer")
        for key in ("repeats", "requests_per_stream", "min_requests", "ctx_margin"):
            _positive_int(f"load.{key}", getattr(self, key))
        _require(isinstance(self.knee_gain, (int, float)) and 0 < self.knee_gain < 1, "load.knee_gain",
                 self.knee_gain, "a fraction in (0, 1)")
        _require(isinstance(self.max_seconds_per_level, (int, float)) and self.max_seconds_per_level > 0,
                 "load.max_seconds_per_level", self.max_seconds_per_level, "a positive number of seconds")
        _require(self.memory_budget_gb is None or (isinstance(self.memory_budget_gb, (int, float))
                                                   and self.memory_budget_gb > 0),
                 "load.memory_budget_gb", self.memory_budget_gb, "null or a positive number of GB")


@dataclass
class Config:
    command: str
    model: ModelConfig
    variant: VariantConfig
    profile: ProfileConfig
    runtime: RuntimeConfig
    reference: ReferenceConfig
    decision: DecisionConfig
    paths: PathsConfig
    run: RunSection
    suites: dict[str, SuiteConfig]
    corpus: CorpusConfig
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    regress: RegressConfig = field(default_factory=RegressConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    calibration_sweep: CalibrationSweepConfig = field(default_factory=CalibrationSweepConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    force: bool = False
    seed: int = 0

    COMMANDS = ("evaluate", "report", "regress", "baseline", "corpus", "bench", "prepare", "calibration", "load")

    def __post_init__(self) -> None:
        _one_of("command", self.command, self.COMMANDS)
        if not self.run.name:
            self.run.name = self.profile.name
        self.variant = apply_kv_cache(self.variant, self.kv_cache)
        for s in self.run.suites:
            if s not in self.suites:
                raise ConfigError(f"run.suites contains {s!r}, which is not a known suite: expected one of "
                                  + ", ".join(sorted(self.suites)) + " (or add suites.NAME.path=FILE)")

    @property
    def model_dir(self) -> Path:
        return Path(self.paths.artifacts) / self.model.name

    @property
    def results_dir(self) -> Path:
        return Path(self.paths.results) / self.model.name / self.run.name

    def selected_suites(self) -> list[SuiteConfig]:
        return [self.suites[s] for s in self.run.suites]


def from_dict(raw: dict) -> Config:
    """Build the typed config from a plain (resolved) dict, as produced by OmegaConf.to_container."""
    raw = dict(raw)
    raw.pop("hydra", None)
    suites = {name: _build(SuiteConfig, {"name": name, **(body or {})}, f"suites.{name}")
              for name, body in (raw.pop("suites", None) or {}).items()}
    sections = {
        "model": ModelConfig, "variant": VariantConfig, "profile": ProfileConfig, "runtime": RuntimeConfig,
        "reference": ReferenceConfig, "decision": DecisionConfig, "paths": PathsConfig, "run": RunSection,
        "corpus": CorpusConfig, "kv_cache": KVCacheConfig, "capacity": CapacityConfig, "regress": RegressConfig,
        "bench": BenchConfig, "calibration_sweep": CalibrationSweepConfig, "load": LoadConfig,
        "workload": WorkloadConfig,
    }
    built = {key: _build(cls, raw.pop(key, None), key) for key, cls in sections.items()}
    command = raw.pop("command", "evaluate")
    force = bool(raw.pop("force", False))
    seed = int(raw.pop("seed", 0))
    if raw:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(raw))}")
    return Config(command=command, suites=suites, force=force, seed=seed, **built)


def from_omegaconf(cfg) -> Config:
    from omegaconf import OmegaConf

    return from_dict(OmegaConf.to_container(cfg, resolve=True))


def known_variants() -> list[str]:
    return sorted(p.stem for p in (PROJECT_ROOT / "conf" / "variant").glob("*.yaml"))


def load_variant(name: str, kv_cache: str | None = None) -> VariantConfig:
    """conf/variant/NAME.yaml (composed by Hydra, so a KV variant's defaults apply) as a typed VariantConfig with
    its KV-cache setting folded in; an unknown name lists the known ones."""
    if name not in known_variants():
        base, _, suffix = name.partition("+")
        if suffix and base in known_variants():   # BASE+kv_q8_0 / BASE+kv_int8 composed from the command line
            for option in ("int8", "int4"):
                variant = load_variant(base, kv_cache=option)
                if variant.name == name:
                    return variant
        raise ConfigError(f"unknown variant {name!r}: expected one of {', '.join(known_variants())}")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_resolvers()
    overrides = [f"variant={name}"] + ([f"kv_cache={kv_cache}"] if kv_cache else [])
    if GlobalHydra.instance().is_initialized():   # inside a Hydra job (the same conf/ tree is loaded)
        from hydra.types import RunMode

        raw = GlobalHydra.instance().hydra.compose_config("config", overrides, run_mode=RunMode.RUN)  # type: ignore[union-attr]
    else:
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            raw = compose("config", overrides=overrides)
    variant = _build(VariantConfig, OmegaConf.to_container(raw.variant, resolve=True), f"variant {name}")
    return apply_kv_cache(variant, _build(KVCacheConfig, OmegaConf.to_container(raw.kv_cache, resolve=True),
                                          "kv_cache"))


def variant_of(cfg: Config, name: str) -> VariantConfig:
    """Variant ``name`` of a run: the config's own variant when it is that one, else conf/variant/NAME.yaml."""
    return cfg.variant if name == cfg.variant.name else load_variant(name)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("qd.root"):
        OmegaConf.register_new_resolver("qd.root", lambda: str(PROJECT_ROOT))
