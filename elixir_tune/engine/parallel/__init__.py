"""Pipeline and tensor parallelism around the chunk engine: pipeline stages (pipeline.py, who holds
what in pipeline_stages.py, per-family
stage adapters in pipeline_adapters.py, the looped breadth-first schedule in pipeline_schedule.py)
and tensor parallelism on DTensor (tensor_parallel.py, tp_adapters.py, 2D grid in tp_grid.py,
tp_layout.py)."""
