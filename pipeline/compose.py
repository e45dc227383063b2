"""The typed config composed: from Hydra's output (``from_omegaconf``) or a plain dict, each variant's options
validated by its own backends, its KV-cache setting folded in; a variant by name from conf/variant/."""

from __future__ import annotations

import dataclasses

from pipeline.infra.errors import ConfigError, Skip
from pipeline.config.settings import build_settings as _build
from pipeline.config.settings import one_of as _one_of
from pipeline.config.commands import (BenchConfig, CalibrationSweepConfig, CapacityConfig, CorpusConfig, DecisionConfig,
                                      LoadConfig, RegressConfig, WorkloadConfig)
from pipeline.config.schema import (PROJECT_ROOT, Config, KVCacheConfig, ModelConfig, PathsConfig, PlanConfig,
                                    ProfileConfig, ReferenceConfig, RunSection, RuntimeConfig, SuiteConfig,
                                    VariantConfig)


def validate_variant(variant: VariantConfig) -> VariantConfig:
    """The variant's quantizer and runtime exist, and each validates its own options now, before any stage runs (a
    misspelt key fails here)."""
    from pipeline.quantizers import QUANTIZERS, quantizer_class
    from pipeline.runtimes import RUNTIMES, runtime_class

    _one_of("variant.quantizer", variant.quantizer, tuple(sorted(QUANTIZERS)))
    _one_of("variant.runtime", variant.runtime, tuple(sorted(RUNTIMES)))
    quantizer_class(variant.quantizer).parse_options(variant.quantize, f"variant {variant.name}: quantize")
    runtime_class(variant.runtime).parse_options(variant.runtime_options, f"variant {variant.name}: runtime_options")
    return variant


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
        "workload": WorkloadConfig, "plan": PlanConfig,
    }
    built = {key: _build(cls, raw.pop(key, None), key) for key, cls in sections.items()}
    built["variant"] = apply_kv_cache(validate_variant(built["variant"]), built["kv_cache"])
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
    variant = validate_variant(_build(VariantConfig, OmegaConf.to_container(raw.variant, resolve=True),
                                      f"variant {name}"))
    return apply_kv_cache(variant, _build(KVCacheConfig, OmegaConf.to_container(raw.kv_cache, resolve=True),
                                          "kv_cache"))


def variant_of(cfg: Config, name: str) -> VariantConfig:
    """Variant ``name`` of a run: the config's own variant when it is that one, else conf/variant/NAME.yaml."""
    return cfg.variant if name == cfg.variant.name else load_variant(name)


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("qd.root"):
        OmegaConf.register_new_resolver("qd.root", lambda: str(PROJECT_ROOT))
