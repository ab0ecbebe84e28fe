"""Pipeline and tensor parallelism around the chunk engine.

Pipeline stages: pipeline_stages.py (which modules and chunks each rank holds), pipeline_adapters.py
(running a stage through the model's own forward), pipeline_schedule.py (the looped breadth-first
schedule), pipeline.py (the step). Tensor parallelism on DTensor: tensor_parallel.py, tp_adapters.py
(styles from the model's tensor table), tp_experts.py (mixture-of-experts blocks),
tp_grid.py (2D), tp_layout.py. Both in one mesh: pipeline_tensor.py (what crosses a stage
boundary when each stage is tensor-parallel).
"""
