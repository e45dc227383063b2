"""The report's rendering: ``summary`` (build_summary), ``variant_summary`` (one variant's entry), ``sections``
and ``tables`` (what both formats render, with ``cells``' formatting), ``plots``, ``markdown`` and ``html``. The stage
that writes them is ``pipeline.stages.report``."""
