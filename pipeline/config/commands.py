"""The config sections of the decision and of the commands beside a comparison: decision, regress, capacity
plan, corpus, bench, calibration sweep, workload and load sweep. Validated in ``__post_init__`` like
``pipeline.config.schema``."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.settings import one_of as _one_of
from pipeline.config.settings import positive_int as _positive_int
from pipeline.config.settings import require as _require


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
class DecisionConfig:
    name: str = "default"
    # decode_speed | memory (as served at the workload) | capacity (sequences that fit the budget at the workload) |
    # size | throughput_at_slo (needs `quantdrift load`)
    objective: str = "decode_speed"
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
    # The family-wise correction of every "significantly worse" test across the variants of a run (the checks'
    # drop against the original, a slower or larger variant than the best): holm (step-down), bonferroni or none.
    multiple_comparisons: str = "holm"
    # Non-inferiority of the checks: a variant fails when the WHOLE 95 % interval of its pass-rate change against
    # the original (per conversation, on its own runtime where that exists) lies below -max_pass_drop, and is
    # undecided when the interval straddles it. Judged per variant: adding variants never relieves a loss (null: off).
    max_pass_drop: float | None = 0.05
    # Degeneration (replies that loop, flagged by ``degeneration``): a variant fails when its share of flagged
    # replies exceeds the original's by more than this, or when its replies' mean repeated-4-gram rate exceeds
    # degeneration.max_repeated_4gram_rate (null: off).
    max_degenerate_increase: float | None = 0.10
    # The memory a variant may use as served (weights + runtime + KV cache at workload.context_tokens x
    # workload.concurrency), before capacity.headroom is taken off. null: this machine's memory (the host's on a
    # CPU, the device's on a GPU). A variant that does not fit fails, naming the figure.
    memory_budget_gb: float | None = None
    # The workload's latency targets (workload.max_ttft_p99_s, max_itl_p99_s): enforce (a variant missing one fails)
    # or report (the recommendation states which variants meet them; none fails for it).
    latency_targets: str = "report"
    # A variant whose recovery on any benchmark task (its accuracy / the original's, run.suites entries bench:TASK)
    # has a 95 % interval whose LOWER bound is below this fails (null: off). Judged on the bound whatever
    # decision.confidence says: a benchmark's few hundred samples leave a wide interval.
    min_recovery: float | None = None
    # A reply is flagged degenerate when either limit is crossed; flagged replies are counted per variant.
    degeneration: dict = field(default_factory=lambda: {"max_repeated_4gram_rate": 0.35, "max_loop_tokens": 32})
    # Measure in the order the decision needs: each variant's teacher-forced drift first; one whose mean-KLD 95 %
    # interval lies wholly above max_kld_mean fails that limit whatever else is measured, so it skips free-running,
    # the speed trials and the load sweep (the report lists it with its figure). false: measure every variant.
    screen: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.screen, bool), "decision.screen", self.screen, "true or false")
        _one_of("decision.objective", self.objective,
                ("decode_speed", "memory", "capacity", "size", "throughput_at_slo"))
        _one_of("decision.confidence", self.confidence, ("point", "upper"))
        _one_of("decision.multiple_comparisons", self.multiple_comparisons, ("holm", "bonferroni", "none"))
        _require(isinstance(self.alpha, (int, float)) and 0 < self.alpha < 1, "decision.alpha", self.alpha,
                 "a probability in (0, 1)")
        for key in ("max_pass_drop", "max_degenerate_increase"):
            x = getattr(self, key)
            _require(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1),
                     f"decision.{key}", x, "a fraction in [0, 1) or null")
        _require(self.memory_budget_gb is None or (isinstance(self.memory_budget_gb, (int, float))
                                                   and not isinstance(self.memory_budget_gb, bool)
                                                   and self.memory_budget_gb > 0),
                 "decision.memory_budget_gb", self.memory_budget_gb, "a positive number of GB or null")
        _one_of("decision.latency_targets", self.latency_targets, ("report", "enforce"))
        _require(self.min_recovery is None or (isinstance(self.min_recovery, (int, float))
                                               and not isinstance(self.min_recovery, bool)
                                               and 0 < self.min_recovery <= 1),
                 "decision.min_recovery", self.min_recovery, "a ratio in (0, 1] (e.g. 0.95) or null")
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
    controls: dict = field(default_factory=dict)   # runtime -> a named speed control ({}: the runtime's other variants)
    control_relative: bool = True     # judge speed as a ratio to a control on the variant's runtime (same rounds)
    speed_margin: float = 0.05        # a control-relative change must lie wholly beyond this to regress
    detect_target: float = 0.10       # the detectable regression the gate says how to reach when above it

    KEYS = ("rel", "abs", "ratio", "interval", "better")

    def __post_init__(self) -> None:
        from pipeline.infra.backends import RUNTIMES
        from pipeline.config.summary_contract import METRICS

        judged = {m.name: m for m in METRICS if m.better}
        for key in ("speed_margin", "detect_target"):
            val = getattr(self, key)
            _require(isinstance(val, (int, float)) and 0 <= val < 1, f"regress.{key}", val, "a fraction in [0, 1)")
        _require(isinstance(self.controls, dict) and all(isinstance(v, str) and v for v in self.controls.values()),
                 "regress.controls", self.controls, "a mapping of runtime (hf, llamacpp) to a variant's name")
        for runtime in self.controls:
            _one_of("regress.controls runtime", runtime, tuple(RUNTIMES))
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
    # run a benchmark's model-written code (bench:humaneval) even where bubblewrap cannot confine it: refused
    # otherwise, with the reason (pipeline.suites.lmeval.sandbox)
    allow_unconfined: bool = False

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
    count and scored teacher-forced on the run's reference (pipeline.commands.calibration)."""

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
    concurrency: int = 1               # requests served at once: the KV cache the decision's memory judgment holds
    max_ttft_p99_s: float | None = 1.0
    max_itl_p99_s: float | None = 0.1
    max_e2e_p99_s: float | None = None

    def __post_init__(self) -> None:
        _positive_int("workload.context_tokens", self.context_tokens)
        _positive_int("workload.output_tokens", self.output_tokens)
        _positive_int("workload.concurrency", self.concurrency)
        for key in ("max_ttft_p99_s", "max_itl_p99_s", "max_e2e_p99_s"):
            x = getattr(self, key)
            _require(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0),
                     f"workload.{key}", x, "null or a positive number of seconds")


@dataclass
class LoadConfig:
    """The load sweep (conf/load/NAME.yaml; pipeline.stages.load): concurrency levels x context depths, each variant
    served by its engine, interleaved rounds."""

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

    def sweep_depths(self, workload_context: int) -> list[int]:
        """The context depths the sweep serves: depths, plus the workload's own context where asked."""
        return sorted(set(self.depths) | ({workload_context} if self.include_workload_depth else set()))

    def __post_init__(self) -> None:
        from pipeline.infra.backends import SERVERS

        _positive_int("load.generator_processes", self.generator_processes, allow_none=True)

        _require(isinstance(self.runtimes, list) and self.runtimes and all(r in SERVERS for r in self.runtimes),
                 "load.runtimes", self.runtimes,
                 f"a non-empty list of runtimes with a serving engine ({sorted(SERVERS)})")
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
