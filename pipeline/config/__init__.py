"""Typed configuration (``schema``, ``commands``), its composition from Hydra (``compose``), the settings helpers
every backend validates its options with (``settings``), the backend registry lines (``backends``) and the
summary contract (``summary_contract``: every metric with its section, direction and interval)."""
