"""Decisions from measured figures: the recommendation (``recommendation``), the nightly regression gate
(``nightly_gate``) and the GPU check's verdict (``gpu_verdict``)."""
