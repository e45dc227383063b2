"""The cost planner: what a run will take in disk, memory and time before it starts (``estimate``), and a finished
run against its plan (``compare``). Its parts: the memory of each stage (``stage_plan``), the stages' times from
measured runs (``plan_times``, ``stage_rates``, ``speed_rates``, ``one_off_rates``, ``prompt_rates``,
``quant_rates``), the runs read back (``measured_runs``, ``stage_folders``), and a run budget kept by cutting the
profile's work (``budget``), given back after the screen where it can (``budget_screen``)."""
