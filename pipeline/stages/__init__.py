"""The stages of a comparison, in pipeline order:

    prepare -> quantize -> reference -> evaluate (free-running) -> score (teacher-forced) -> checks
            -> deployment -> speed -> load -> report

``variant_job`` runs one variant through prepare .. deployment (one Hydra job); ``speed``, ``load`` and ``report``
run once per run over every variant. ``standin`` is the dequantized F16-GGUF stand-in some free-running uses.
Every stage is cached on disk by its inputs and the version of the code that computes it (``pipeline.infra``)."""
