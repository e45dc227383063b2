"""Typed configuration: Hydra's DictConfig is converted once, at the entry point, into these
dataclasses. Validation lives in ``__post_init__`` and names the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A user-facing configuration or input problem. The CLI prints it without a traceback and exits 2."""


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not valid: expected {allowed}")


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    _require(value in allowed, key, value, "one of " + ", ".join(map(str, allowed)))


def _positive_int(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value, "a positive integer")


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

    def __post_init__(self) -> None:
        _require(bool(self.name) and all(c.isalnum() or c in "-_.+" for c in self.name), "variant.name", self.name,
                 "letters, digits, '-', '_', '.', '+'")
        from pipeline.quantizers import QUANTIZERS
        from pipeline.runtimes import RUNTIMES

        _one_of("variant.quantizer", self.quantizer, tuple(sorted(QUANTIZERS)))
        _one_of("variant.runtime", self.runtime, tuple(sorted(RUNTIMES)))


@dataclass
class SuiteConfig:
    name: str
    path: str

    def __post_init__(self) -> None:
        _require(bool(self.path), f"suites.{self.name}.path", self.path, "a path to a JSONL file")


@dataclass
class SpeedConfig:
    prompt_tokens: int = 256
    decode_tokens: int = 64
    repeats: int = 3
    warmup: int = 1
    # Other processes' share of CPU time above which a speed figure is flagged noisy and re-measured once.
    max_cpu_noise: float = 0.15

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "decode_tokens", "repeats"):
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

    def __post_init__(self) -> None:
        _positive_int("profile.max_conversations", self.max_conversations, allow_none=True)
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
    score_chunk: int = 1024       # HF: positions per log-softmax chunk when scoring

    def __post_init__(self) -> None:
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
    # auto: the F16 GGUF on llama.cpp produces the transcripts when the parity checks hold, else the original on hf.
    runtime: str = "auto"
    top_k: int = 32
    # Parity gates: F16 GGUF vs original on the same ids.
    parity_max_kld: float = 1e-3
    parity_tokens: int = 512

    def __post_init__(self) -> None:
        _one_of("reference.runtime", self.runtime, ("auto", "hf", "llamacpp"))
        _positive_int("reference.top_k", self.top_k)


@dataclass
class DecisionConfig:
    name: str = "default"
    objective: str = "decode_speed"   # decode_speed | memory | size
    max_kld_mean: float | None = None
    max_kld_p99: float | None = None
    max_flip_rate: float | None = None
    min_pass_rate_ratio: float | None = None   # variant pass rate / original pass rate
    min_decode_tokens_per_s: float | None = None
    max_peak_rss_mb: float | None = None
    max_artifact_bytes: int | None = None

    def __post_init__(self) -> None:
        _one_of("decision.objective", self.objective, ("decode_speed", "memory", "size"))


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
    force: bool = False
    seed: int = 0

    COMMANDS = ("evaluate", "report", "corpus", "bench", "prepare")

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


def _build(cls, data: Any, key: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key} must be a mapping, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{key} has unknown key(s) {', '.join(unknown)}: expected some of {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:  # a missing required key
        raise ConfigError(f"{key}: {exc}") from None


def from_dict(raw: dict) -> Config:
    """Build the typed config from a plain (resolved) dict, as produced by OmegaConf.to_container."""
    raw = dict(raw)
    raw.pop("hydra", None)
    suites = {name: _build(SuiteConfig, {"name": name, **(body or {})}, f"suites.{name}")
              for name, body in (raw.pop("suites", None) or {}).items()}
    sections = {
        "model": ModelConfig, "variant": VariantConfig, "profile": ProfileConfig, "runtime": RuntimeConfig,
        "reference": ReferenceConfig, "decision": DecisionConfig, "paths": PathsConfig, "run": RunSection,
        "corpus": CorpusConfig,
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


def load_variant(name: str) -> VariantConfig:
    """conf/variant/NAME.yaml as a typed VariantConfig; an unknown name lists the known ones."""
    from omegaconf import OmegaConf

    if name not in known_variants():
        raise ConfigError(f"unknown variant {name!r}: expected one of {', '.join(known_variants())}")
    register_resolvers()
    raw = OmegaConf.to_container(OmegaConf.load(PROJECT_ROOT / "conf" / "variant" / f"{name}.yaml"), resolve=True)
    return _build(VariantConfig, raw, f"variant {name}")


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("qd.root"):
        OmegaConf.register_new_resolver("qd.root", lambda: str(PROJECT_ROOT))
