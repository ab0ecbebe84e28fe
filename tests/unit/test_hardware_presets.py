"""Hardware presets and load_hardware: every preset is a valid spec with sane magnitudes."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml

from elixir_tune import paths
from elixir_tune.hardware import (
    HardwareSpec,
    closest_preset,
    list_presets,
    load_hardware,
    load_hardware_file,
    preset_path,
    save_hardware,
    spec_problems,
    with_borrowed_constants,
)

GiB = 2**30
REQUIRED = {
    "a100-40gb-pcie",
    "a100-40gb-sxm",
    "a100-80gb-pcie",
    "a100-80gb-sxm",
    "h100-80gb-sxm",
    "h200-141gb",
    "rtx4090-24gb",
    "l4-24gb",
    "cpu",
    "v100-32gb-sxm3",
}
NUMBER_LINE = re.compile(r"^\s*[a-z0-9_]+:\s*-?[0-9][0-9.e+\-_]*\s*(#.*)?$")


def test_required_presets_are_shipped():
    assert REQUIRED <= set(list_presets())


@pytest.mark.parametrize("preset_id", sorted(REQUIRED))
def test_preset_is_valid_with_sane_magnitudes(preset_id):
    spec = load_hardware(preset_id)
    assert spec_problems(spec) == []
    assert spec.name == preset_id
    gap = spec.gpu_memory_bytes - spec.usable_memory_bytes
    assert 0 < gap <= 2 * GiB, "usable memory is total minus a CUDA context / host share"
    assert spec.h2d_gbps_all <= spec.h2d_gbps and spec.d2h_gbps_all <= spec.d2h_gbps
    assert spec.inter_node_gbps <= spec.allgather_gbps * 1.01
    assert 1e-7 <= spec.copy_latency_s < 1e-2 and 1e-6 <= spec.collective_latency_s < 1e-1
    if spec.device == "cuda":
        assert 16 * GiB < spec.gpu_memory_bytes < 200 * GiB
        # V100 (Volta) has fp16 tensor cores and no bf16: its preset has no bf16 rate.
        half = {"fp16"} if preset_id.startswith("v100") else {"bf16", "fp16"}
        assert {"fp32"} | half <= set(spec.matmul_tflops)
        assert spec.matmul_tflops["fp32"] < spec.matmul_tflops["fp16"] < 1000
        for dtype, tflops in spec.matmul_tflops.items():
            efficiency = tflops / spec.matmul_peak_tflops[dtype]
            assert 0.5 <= efficiency <= 0.95, (dtype, efficiency)
        assert 200 <= spec.hbm_gbps <= 5000
        assert 10 <= spec.h2d_gbps <= 64 and 10 <= spec.d2h_gbps <= 64
        assert 5 <= spec.allgather_gbps <= 500
        assert spec.gpu_adam_elems_per_s > 5 * spec.cpu_adam_elems_per_s
        assert 1e8 <= spec.cpu_adam_elems_per_s <= 5e9
        assert spec.host_memory_bytes >= spec.gpus_per_node * spec.gpu_memory_bytes
        if preset_id.endswith("sxm") or preset_id.startswith("h200"):
            assert spec.gpus_per_node == 8
    else:
        assert spec.gpus_per_node >= 1 and spec.host_cores >= 1
        assert 0.001 <= spec.matmul_tflops["fp32"] <= 10
        assert spec.hbm_gbps < 1000 and spec.allgather_gbps < 100
        assert spec.gpu_adam_elems_per_s == spec.cpu_adam_elems_per_s
        assert spec.gpu_memory_bytes * spec.gpus_per_node <= spec.host_memory_bytes


@pytest.mark.parametrize("preset_id", sorted(REQUIRED))
def test_every_preset_number_has_a_source(preset_id):
    path = preset_path(preset_id)
    text = path.read_text()
    assert "elixir-tune search" in text and f"--hardware {preset_id}" in text, "header shows usage"
    body = text.split("\nsources:")[0]
    unsourced = [line for line in body.splitlines() if NUMBER_LINE.match(line) and "# source:" not in line]
    assert unsourced == []
    raw = yaml.safe_load(text)
    numeric = {
        key
        for key, value in raw.items()
        if isinstance(value, (int, float, dict)) and key not in ("sources", "bandwidth_curves")
    }
    assert numeric <= set(raw["sources"]), numeric - set(raw["sources"])


def test_load_by_id_and_by_file_agree(tmp_path):
    by_id = load_hardware("a100-40gb-pcie")
    copy = tmp_path / "mine.yaml"
    save_hardware(by_id, copy, header="a copy")
    assert copy.read_text().startswith("# a copy\n")
    assert load_hardware(str(copy)) == by_id
    assert load_hardware_file(copy) == by_id
    assert load_hardware(str(preset_path("cpu"))) == load_hardware("cpu")


def test_unknown_id_lists_the_presets():
    with pytest.raises(ValueError) as error:
        load_hardware("a100-999gb")
    for preset_id in REQUIRED:
        assert preset_id in str(error.value)


def test_missing_file_lists_the_presets(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_hardware(str(tmp_path / "nope.yaml"))
    assert "h100-80gb-sxm" in str(error.value) and "elixir-tune probe" in str(error.value)


def test_invalid_file_names_the_field(tmp_path):
    raw = yaml.safe_load(preset_path("l4-24gb").read_text())
    raw["hbm_gbps"] = "1e9"  # what YAML makes of 1e9 without a dot: a string
    raw["usable_memory_bytes"] = raw["gpu_memory_bytes"] + 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError) as error:
        load_hardware(str(bad))
    assert "hbm_gbps" in str(error.value) and "usable_memory_bytes" in str(error.value)
    bad.write_text(yaml.safe_dump({**raw, "warp_drive": 1}))
    with pytest.raises(ValueError, match="warp_drive"):
        load_hardware(str(bad))


def test_closest_preset_of_a_preset_is_itself():
    for preset_id in REQUIRED:
        assert closest_preset(load_hardware(preset_id)) == preset_id


def test_spec_defaults_keep_old_files_loading(tmp_path):
    raw = yaml.safe_load(preset_path("h100-80gb-sxm").read_text())
    for optional in (
        "matmul_peak_tflops",
        "bandwidth_curves",
        "allocator_overhead_bytes",
        "copy_latency_s",
        "collective_latency_s",
        "sources",
    ):
        raw.pop(optional, None)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(raw))
    spec = load_hardware(str(old))
    assert isinstance(spec, HardwareSpec) and spec.bandwidth_curves == {}


def test_hardware_package_imports_no_torch():
    code = (
        "import sys, elixir_tune.hardware as h; h.load_hardware('cpu'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_presets_live_in_the_configs_dir():
    assert preset_path("cpu").parent == paths.HARDWARE_CONFIGS_DIR


@pytest.mark.parametrize("preset_id", sorted(REQUIRED - {"cpu"}))
def test_gpu_preset_rates_are_useful_flop_rates_within_their_bound(preset_id):
    """A flat model rate is a whole model's useful-FLOP rate, so no faster than the class's best published
    MFU allows (a hardware-FLOPs rate, recomputation counted, is); a preset without a bound says why."""
    spec = load_hardware(preset_id)
    if not spec.best_mfu:
        assert "# best_mfu: none" in preset_path(preset_id).read_text()
        return
    for dtype, best in spec.best_mfu.items():
        if spec.block_tflops_curves.get(dtype):
            continue  # a curve is the blocks' matmuls alone; the search clamps whole plans to the bound
        assert spec.model_tflops[dtype] <= best * spec.matmul_peak_tflops[dtype], dtype


def test_a_probed_gpu_borrows_what_the_probe_cannot_measure_from_its_closest_preset():
    h100 = load_hardware("h100-80gb-sxm")
    probed = dataclasses.replace(h100, name="probe of node", recompute_speedup=1.0, collective_compute_loss=0.0)
    borrowed = with_borrowed_constants(probed)
    assert borrowed.recompute_speedup == h100.recompute_speedup > 1.0
    assert borrowed.collective_compute_loss == h100.collective_compute_loss > 0.0
    assert "closest preset's (h100-80gb-sxm)" in borrowed.sources["collective_compute_loss"]
    # no NVLink (the presets' value comes from NVLink runs), one GPU, or a CPU: nothing of it is borrowed
    assert with_borrowed_constants(dataclasses.replace(probed, shared_host_link=True)).collective_compute_loss == 0.0
    assert with_borrowed_constants(dataclasses.replace(probed, gpus_per_node=1)).collective_compute_loss == 0.0
    cpu = load_hardware("cpu")
    assert with_borrowed_constants(cpu) is cpu


def test_the_fitted_constants_out_of_range_are_named():
    h100 = load_hardware("h100-80gb-sxm")
    problems = spec_problems(dataclasses.replace(h100, collective_compute_loss=-1.0, recompute_speedup=0.0))
    assert any(p.startswith("collective_compute_loss:") for p in problems)
    assert any(p.startswith("recompute_speedup:") for p in problems)
