"""Prompt suites: records and their validation (``records``), what a check means (``checks``), multi-turn
driving and chat rendering (``conversation``), and the generated long-context recall documents (``recall_docs``)."""
