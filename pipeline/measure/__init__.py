"""Measurement: drift metrics (``drift``), paired statistics (``stats``), memory readings (``memory``), memory and
KV arithmetic with the capacity plan and roofline (``capacity``), host bandwidth (``bandwidth``), the speed
probe (``probe``), load generation (``loadgen``) and a served sweep's figures (``served_load``), and the
cross-checks against llama.cpp's tools (``bench``, ``batched_bench``, ``corpus_kld``, ``calibration_sweep``)."""
