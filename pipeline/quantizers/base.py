"""The quantizer interface (the stage that runs a quantizer is ``pipeline.stages.quantize``)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from pipeline.infra.errors import Skip  # noqa: F401  (re-exported for quantizers)
from pipeline.config.settings import build_settings
from pipeline.infra.files import dir_bytes

if TYPE_CHECKING:   # annotations only: a backend never imports the config at run time (no import cycle)
    from pipeline.config.schema import Config, VariantConfig
    from pipeline.infra.model_source import Original

@dataclass
class Artifact:
    variant: str
    path: Path           # what the variant's runtime loads (a folder or a file)
    bytes: int           # on-disk size of the weights
    info: dict           # quantizer facts: real tensor types, group size, wall time, ...
    hash: str            # changes whenever the artifact does; downstream stages key on it


@dataclass
class NoSettings:
    """A quantizer without options."""


class Quantizer(abc.ABC):
    """Turns the original into one artifact. ``Settings``: the dataclass that ``variant.quantize`` must fit,
    validated when the config loads (``parse_options``), so a misspelt option fails before any stage runs."""

    Settings: type = NoSettings

    @classmethod
    def parse_options(cls, options: dict, where: str = "variant.quantize"):
        return build_settings(cls.Settings, options, where)

    @classmethod
    def preflight(cls, cfg: Config, checkpoint: Path) -> str | None:
        """What would stop every variant of this quantizer on this checkpoint, found in seconds before any stage
        runs (``pipeline.stages.preflight``), with the setting that gets past it; None when nothing does."""
        return None

    def __init__(self, variant: VariantConfig, original: Original, cfg: Config):
        self.variant = variant
        self.original = original
        self.cfg = cfg

    @property
    def out_dir(self) -> Path:
        return self.cfg.model_dir / "variants" / self.variant.base   # KV variants share their weights' artifact

    @abc.abstractmethod
    def key(self) -> dict:
        """Everything besides the original that determines the artifact (settings, tool versions)."""

    @abc.abstractmethod
    def build(self, tmp: Path) -> dict:
        """Write the artifact into ``tmp``; return facts for the manifest (must include 'artifact': file name)."""

    def producer(self, manifest: dict) -> dict | None:
        """Who made the artifact and how, for the report: {"tool", "version", "recipe"} from the stage's manifest
        (its key holds the tool version the artifact was built with)."""
        return None

    def needed_bytes(self) -> float:
        """Free disk space to ask for before building: the original checkpoint's size (every quantized format is
        smaller) plus 10 %."""
        return 1.1 * dir_bytes(self.original.checkpoint)

    def checked_build(self, tmp: Path) -> dict:
        """``build``, after checking the disk can hold what it writes."""
        from pipeline.infra.files import check_free_space

        check_free_space(tmp, self.needed_bytes(), f"quantizing {self.variant.base}")
        return self.build(tmp)

    def ready_made(self) -> Artifact | None:
        """An artifact that needs no build (the original itself), else None: the quantize stage builds one."""
        return None


class Passthrough(Quantizer):
    """The original itself (quantizer: none)."""

    def key(self) -> dict:
        return {}

    def build(self, tmp: Path) -> dict:  # pragma: no cover - never built
        raise NotImplementedError

    def ready_made(self) -> Artifact:
        ckpt = self.original.checkpoint
        weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        return Artifact(variant=self.variant.name, path=ckpt, bytes=weights, hash=self.original.hash,
                        info={"format": "hf-safetensors", "dtype": self.original.facts.get("torch_dtype")})


def run_worker(argv: list[str], scratch: Path, env: dict, what: str) -> tuple[dict, float]:
    """Run a quantization child process in ``scratch`` with its output streamed through (minutes of per-layer
    progress stay visible); it must write ``scratch/stats.json``. Returns (its stats, wall seconds); a failure
    raises with the child's last lines. The child is killed if this process is interrupted."""
    import json
    import subprocess
    import sys
    import time

    started = time.time()
    from pipeline.infra.child_processes import child_options

    proc = subprocess.Popen(argv, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **child_options())
    tail: list[str] = []
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-12:]
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.time() - started
    stats_path = Path(scratch) / "stats.json"
    if proc.returncode != 0 or not stats_path.is_file():
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return json.loads(stats_path.read_text()), wall


