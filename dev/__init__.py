"""Developer tooling outside the installed package: the family matrix (``families``: small random models of each
family with their real tokenizers; ``families_matrix``: the `make families` driver) and business_mc's generated
questions (``business_mc_hard``, with ``business_mc_policies`` and ``business_mc_dates``: `python -m
dev.business_mc_hard`; ``business_mc_accuracy``: a model's accuracy per category). Nothing under ``pipeline``
imports it."""
