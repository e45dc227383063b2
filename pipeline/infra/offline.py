"""No network at run time unless the model source needs the hub: the HF libraries read these variables when
first imported, so the CLI calls ``configure`` before importing any of them."""

from __future__ import annotations

import os

_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def configure(needs_hub: bool) -> None:
    for var in _VARS:
        if needs_hub:
            os.environ.pop(var, None)
        else:
            os.environ[var] = "1"
    # Telemetry is network access too.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
