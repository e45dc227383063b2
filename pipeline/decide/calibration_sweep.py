"""The calibration sweep's results file, written by `quantdrift calibration` (``pipeline.commands.calibration``) and
read into the run's summary."""

from __future__ import annotations

from pipeline.config.schema import Config
from pipeline.infra.files import read_json

SWEEP_FILE = "calibration_sweep.json"


def load_sweep(cfg: Config) -> dict | None:
    """The run's calibration sweep, when `quantdrift calibration` has written one."""
    path = cfg.results_dir / SWEEP_FILE
    return read_json(path) if path.is_file() else None
