"""Command drivers: the commands beside the comparison, each driving stages of its own. The cross-check against
llama.cpp's own tools (``llama_bench``), KL divergence over a text file (``corpus``), the calibration-size sweep
(``calibration``), and the build step that prunes ggml's CPU modules that die here (``prune_cpu``)."""
