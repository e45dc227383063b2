"""The summary and the decisions taken from measured figures: the summary of a run's finished stages
(``summary``, with ``variant_summary``, ``bench_summary`` and ``stage_times``), the recommendation
(``recommendation``), the nightly regression gate (``nightly_gate``) and the GPU check's verdict (``gpu_verdict``)."""
