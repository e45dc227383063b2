"""Instruments: what starts processes, times them and reads memory. The speed probe (``probe``), host bandwidth
and compute (``bandwidth``), load generation (``loadgen``), llama.cpp's batched bench (``batched_bench``) and
memory readings (``memory``)."""
