"""Pure figures: functions of their arguments only (no process started, no file read). Drift metrics (``drift``),
paired statistics (``stats``), memory and KV arithmetic with the capacity plan and roofline (``capacity``), how a
model's KV cache grows with the context (``kv_layout``), weights on disk and in memory (``footprint``), a served
sweep's figures (``served_load``) and the nightly gate's control-relative speed check (``speed_control``)."""
