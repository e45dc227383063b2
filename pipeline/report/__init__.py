"""Rendering a run's summary.json, measuring and deciding nothing: ``sections`` and ``tables`` (what both formats
render, with ``cells``' formatting), ``plots``, ``markdown`` and ``html``; ``write`` writes them beside the summary."""
