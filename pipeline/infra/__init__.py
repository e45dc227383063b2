"""Infrastructure every stage uses: files and hashes (``files``), stages on disk (``stage_cache``), code versions
in stage keys (``code_version``), child processes that never outlive a run (``child_processes``), llama.cpp's
own tools (``llama_tools``), the Makefile's cache paths (``make_paths``), offline guards (``offline``), GGUF file
readers (``gguf_file``), the backend registry lines (``backends``), where the model comes from (``model_source``)
and the errors every stage may raise (``errors``)."""
