"""The stages of a comparison, in pipeline order:

    prepare -> quantize -> reference -> evaluate (free-running) -> score (teacher-forced) -> outcomes (checks)
            -> deployment -> lmeval_tasks (bench:TASK) -> speed -> load -> report

``pipeline.commands.variant_job`` runs one variant through prepare .. deployment (one Hydra job), with the shared
reference set-up and the result file of ``variant_setup``; ``speed``, ``load`` and ``report`` run once per run over
every variant. ``standin`` is the dequantized F16-GGUF stand-in some free-running uses. Every stage is cached on
disk by its inputs and the version of the code that computes it (``pipeline.infra``)."""
