"""Developer tooling outside the installed package: the family matrix (``families``: small random models of each
family with their real tokenizers; ``families_matrix``: the `make families` driver). Nothing under ``pipeline``
imports it."""
