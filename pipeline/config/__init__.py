"""Typed configuration (``schema``, ``commands``), the settings helpers every backend validates its options with
(``settings``), the offline benchmark tasks' names (``bench_tasks``) and the summary contract
(``summary_contract``: every metric with its section, direction and interval). Its composition from Hydra, which
asks the backends to validate their options, is ``pipeline.compose``."""
