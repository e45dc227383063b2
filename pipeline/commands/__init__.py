"""The commands: one module per command that runs stages, each listing them in the order they run. The comparison
(``compare``), one variant's job (``variant_job``), the cross-check against llama.cpp's own tools (``llama_bench``),
KL divergence over a text file (``corpus``), the calibration-size sweep (``calibration``), and the build step that
prunes ggml's CPU modules that die on the machine it runs on (``prune_cpu``)."""
