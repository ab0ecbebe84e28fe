"""The probe's CUDA path (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from elixir_tune.hardware import load_hardware, probe, save_hardware, spec_problems

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without CUDA


def test_quick_probe_on_the_gpus(tmp_path):
    messages = []
    spec = probe(quick=True, progress=messages.append)
    assert spec_problems(spec) == []
    assert spec.device == "cuda" and spec.gpus_per_node == torch.cuda.device_count()
    assert spec.device_name == torch.cuda.get_device_name(0)
    assert 0 < spec.usable_memory_bytes <= spec.gpu_memory_bytes
    assert spec.gpu_memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert spec.matmul_tflops["fp32"] > 0.5
    if torch.cuda.is_bf16_supported():
        assert spec.matmul_tflops["bf16"] > spec.matmul_tflops["fp32"]
        # a whole block runs below its GEMMs, and a wider block faster than a narrow one
        curve = spec.block_tflops_curves["bf16"]
        assert 0 < spec.model_tflops["bf16"] <= 1.1 * spec.matmul_tflops["bf16"]
        assert curve[max(curve)] > curve[min(curve)]
    assert 0 < spec.block_call_overhead_s < 0.05
    assert spec.pointwise_gbps > 1  # HBM-bound elementwise work
    assert spec.hbm_gbps > spec.h2d_gbps > 1
    assert spec.gpu_adam_elems_per_s > spec.cpu_adam_elems_per_s
    for name in ("h2d_gbps", "d2h_gbps"):
        curve = spec.bandwidth_curves[name]
        assert min(curve) == 2**20 and max(curve) == 256 * 2**20
    if spec.gpus_per_node > 1:
        assert spec.sources["allgather_gbps"].startswith("measured: NCCL")
        assert spec.allgather_gbps > 1 and spec.reduce_scatter_gbps > 1
    assert any("matmul bf16" in message for message in messages)
    path = tmp_path / "gpu.yaml"
    save_hardware(spec, path)
    assert load_hardware(str(path)) == spec


def test_cpu_probe_still_works_on_a_gpu_machine():
    spec = probe(quick=True, device="cpu", procs=1)
    assert spec.device == "cpu" and spec.gpus_per_node == 1
    assert spec_problems(spec) == []
    assert spec.block_tflops_curves["fp32"] and spec.block_call_overhead_s > 0  # measured in this process
