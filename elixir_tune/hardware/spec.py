"""HardwareSpec: the numbers the cost model needs about one kind of node.

A preset (configs/hardware/*.yaml) and a probe result (`elixir-tune probe`) have the same fields,
so either can drive a search. This module imports no torch.

Units are in the names: bytes, seconds, GB/s (1e9 bytes per second), TFLOP/s (1e12 FLOP/s),
elements per second.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from elixir_tune.files import InputFileError, load_yaml_mapping


@dataclass
class HardwareSpec:
    """One node type: its accelerators, host and links.

    Attributes:
        name: preset id or a description of the probed machine.
        device: ``cuda`` or ``cpu`` (the CPU described as the device).
        device_name: e.g. "NVIDIA H100 80GB HBM3".
        gpus_per_node: accelerators per node (for cpu: worker processes the node runs well).
        gpu_memory_bytes: total memory of one device.
        usable_memory_bytes: what tensors can use after the driver/context.
        allocator_overhead_bytes: fragmentation and workspace the allocator adds on top of tensors.
        matmul_tflops: dense matmul rate reached at transformer shapes, per dtype (fp32/bf16/fp16).
        hbm_gbps: device memory copy bandwidth.
        h2d_gbps: pinned host->device bandwidth, one device copying.
        d2h_gbps: pinned device->host bandwidth, one device copying.
        h2d_gbps_all: per-device host->device bandwidth when all devices of the node copy at once.
        d2h_gbps_all: per-device device->host bandwidth when all devices of the node copy at once.
        copy_latency_s: fixed cost of one host<->device copy.
        allgather_gbps: all-gather bus bandwidth inside a node.
        reduce_scatter_gbps: reduce-scatter bus bandwidth inside a node.
        inter_node_gbps: bus bandwidth of collectives spanning nodes (per device).
        collective_latency_s: fixed cost of one collective.
        gpu_adam_elems_per_s: fused Adam update rate on the device.
        cpu_adam_elems_per_s: Adam update rate of one process on the host, with the cores one rank
            gets (DeepSpeed's CPU Adam: ~1.4e9 elements/s per process, DeepSpeed issue #735).
        host_memory_bytes: host RAM of the node.
        host_cores: host CPU cores of the node.
        sources: where each number comes from (field name -> datasheet, measurement, benchmark).
        matmul_peak_tflops: datasheet dense peak per dtype, so that matmul_tflops / peak is the
            efficiency reached at transformer shapes (empty when unknown, e.g. a probed CPU).
        bandwidth_curves: measured bandwidth over transfer sizes, field name (h2d_gbps,
            d2h_gbps, h2d_gbps_all, d2h_gbps_all, allgather_gbps, reduce_scatter_gbps) ->
            {bytes: GB/s}; the scalar field is the median over the sizes of at least 1/16 of the
            largest (the asymptotic rate, robust to one noisy point). Empty in presets.
        cpu_adam_node_elems_per_s: Adam update rate of the whole host with every rank stepping at
            once (memory-bandwidth bound: a node does not scale with its ranks, DeepSpeed issue
            #6834). 0: unknown, taken as ``cpu_adam_elems_per_s x gpus_per_node`` (older files).
        model_tflops: effective rate of a large transformer model's forward+backward per dtype
            (attention, norms, activations and launch gaps included), below ``matmul_tflops``;
            empty: the matmul rate is used.
        block_tflops_curves: measured rate of one transformer block's forward+backward over sizes,
            dtype -> {block parameter count: TFLOP/s}; narrow blocks run far below the matmul rate
            (small GEMMs, per-op overhead). Takes precedence over ``model_tflops``.
        block_call_overhead_s: fixed time of one block's forward+backward call whatever its size
            (op dispatch, kernel launches): what a tiny block takes. The curve's rates are net of it.
        pointwise_gbps: rate of memory-bound pointwise ops, in bytes they write per second
            (``elixir_tune.pointwise``), measured on an unfused tanh-GELU's forward+backward. When
            set, the block curve is net of the probe block's own pointwise time and a model's
            pointwise bytes are priced at this rate; 0 (older files): the block or model rate
            stands for them.
        rate_pointwise_elems: pointwise output elements per layer, token and hidden unit (forward
            + backward) that the block or model rate already includes: those of the model a
            preset's rate was fitted to, whose pointwise ops ran inside the measured time (MPT as
            llm-foundry runs it: 15, ``scripts/published_pointwise.py``). A model is priced at
            ``pointwise_gbps`` only for its pointwise bytes beyond them. 0: the rate is net of all
            pointwise ops (the probe's curve).
        rate_fused_attention: the flat model rate was taken from runs of a fused attention
            (llm-foundry's FlashAttention runs), so an eager attention's seq x seq score traffic is
            not in it and is priced at ``hbm_gbps`` (``costmodel.rates.attention_scores_bytes``), as
            it is beside an ``attention_tflops`` rate. A probed GPU file sets it from the kernel its
            block's ``scaled_dot_product_attention`` dispatched (``bench_compute.block_attention_fused``).
            False (a CPU, a rate from an eager attention such as Megatron-LM's of 2020): the rate
            stands for the scores.
        dropout_attention_s_per_score: on a CPU device, the seconds one attention score element
            (heads x query x key) with dropout adds to a forward+backward: torch's CPU flash kernel
            takes no dropout, so such an attention runs the math path (the whole seq^2 products, a
            softmax, the dropout's random numbers and multiplications) where the block rate was
            measured on the flash kernel (``bench_compute.dropout_attention_s_per_score``); 0: not
            measured, not priced.
        thread_handoff_s: one hand-over between two Python threads, as layered accumulation
            makes at every layer of every micro-batch; 0: not measured.
        shared_host_link: the GPUs have no NVLink, so collectives cross the same PCIe link as the
            host<->device copies: one inbound and one outbound link per GPU in the timeline.
        attention_tflops: useful-FLOP rate of the attention core (the seq x seq products, fused
            as FlashAttention runs them) per dtype, counted as 4 x seq^2 x hidden FLOPs per layer
            forward (non-causal, as MFU tables count them); when set, a model's attention FLOPs
            run at this rate and the rest at the block or model rate, so that the rate falls with
            the sequence length. Empty: one rate for all FLOPs.
        tensor2_block_extra_ratio: on a CPU device, what splitting a transformer block over 2
            tensor ranks adds beyond half its work (DTensor dispatch, the all-gathers and
            reduce-scatters and their waits, narrower matrices), as a share of the plain block's
            forward+backward time (``hardware/bench_layout.py``); 0: not measured, the collectives
            are priced from the links alone.
        pipeline_microbatch_extra_ratio: on a CPU device, what a pipeline's schedule and its
            stages' hand-overs (activations and their gradients) add beyond the bubble, as a share
            of a stage's compute (``hardware/bench_layout.py``); 0: not measured, the sends are
            priced from the links alone.
        tensor2_block_fixed_s: on a CPU device, the fixed seconds a tensor split over 2 ranks adds
            to one block's forward+backward whatever its size (DTensor dispatch of every op, the
            collectives' calls and wake-ups), beside ``tensor2_block_extra_ratio``'s share
            (``hardware/bench_layout.py``, from a tiny block); 0: not measured.
        pipeline_stage_microbatch_s: on a CPU device, the fixed seconds of one virtual stage's
            forward+backward of one micro-batch in a pipeline step (the schedule's actions, the
            stage's receive and send of activations and gradients and their waits), beside
            ``pipeline_microbatch_extra_ratio``'s share (``hardware/bench_layout.py``); 0: not
            measured.
        sm_count: streaming multiprocessors of one GPU (datasheet): how many GEMM tiles run per wave, so
            the block rate depends on the tokens of a micro-batch (``costmodel/gemm_waves.py``). 0: no
            wave model (a CPU, or a file written before it).
        recompute_speedup: how much faster per FLOP a recomputed forward runs than the step's
            forward+backward mean that the block and attention rates give (a backward's products and
            FlashAttention's backward run slower per counted FLOP than a forward); fitted with the rates
            (``scripts/published_overlap_fit.py``). 1.0: recomputation at the mean rate.
        collective_compute_loss: seconds of compute lost per second a data-parallel all-gather or
            reduce-scatter runs beside it (the collective's kernels take SMs and memory bandwidth from
            the compute they overlap), so a micro-batch's parameter traffic costs time even when it is
            hidden (``costmodel/lanes.py``). 0: none (a CPU, where collectives stall compute outright).
        best_mfu: the best model-FLOPs utilisation published for this hardware class per dtype
            (useful FLOPs over the datasheet peak): the search predicts no plan faster
            (``costmodel.rates.plausibility_bound``). Empty: no compute bound.
        probe_load: the load a probed file was measured under (``hardware/load.py``'s
            ``load_record``: ``loaded`` 1 or 0, other processes' busy cores before and after,
            the stolen share, the load averages, the reference loop's spread). Empty: a preset,
            or a file written before the probe recorded it.
    """

    name: str
    device: str
    device_name: str
    gpus_per_node: int
    gpu_memory_bytes: int
    usable_memory_bytes: int
    matmul_tflops: dict[str, float]
    hbm_gbps: float
    h2d_gbps: float
    d2h_gbps: float
    h2d_gbps_all: float
    d2h_gbps_all: float
    allgather_gbps: float
    reduce_scatter_gbps: float
    inter_node_gbps: float
    gpu_adam_elems_per_s: float
    cpu_adam_elems_per_s: float
    host_memory_bytes: int
    host_cores: int
    allocator_overhead_bytes: int = 0
    copy_latency_s: float = 10e-6
    collective_latency_s: float = 30e-6
    sources: dict[str, str] = field(default_factory=dict)
    matmul_peak_tflops: dict[str, float] = field(default_factory=dict)
    bandwidth_curves: dict[str, dict[int, float]] = field(default_factory=dict)
    cpu_adam_node_elems_per_s: float = 0.0
    model_tflops: dict[str, float] = field(default_factory=dict)
    block_tflops_curves: dict[str, dict[int, float]] = field(default_factory=dict)
    shared_host_link: bool = False
    block_call_overhead_s: float = 0.0
    pointwise_gbps: float = 0.0
    rate_pointwise_elems: float = 0.0
    rate_fused_attention: bool = False
    thread_handoff_s: float = 0.0
    dropout_attention_s_per_score: float = 0.0
    attention_tflops: dict[str, float] = field(default_factory=dict)
    best_mfu: dict[str, float] = field(default_factory=dict)
    tensor2_block_extra_ratio: float = 0.0
    pipeline_microbatch_extra_ratio: float = 0.0
    tensor2_block_fixed_s: float = 0.0
    pipeline_stage_microbatch_s: float = 0.0
    sm_count: int = 0
    collective_compute_loss: float = 0.0
    recompute_speedup: float = 1.0
    probe_load: dict[str, float] = field(default_factory=dict)

    @property
    def measured_under_load(self) -> bool:
        """The probe judged the machine loaded while it measured (``hardware/load.py``)."""
        return bool(self.probe_load.get("loaded"))

    def cpu_adam_rate_per_rank(self, ranks_on_node: int) -> float:
        """Host Adam elements/s one rank gets when ``ranks_on_node`` ranks step at once.

        The smaller of one process's rate and the node's rate shared out: one process is limited
        by its cores (DeepSpeed CPU Adam ~1.4e9 elements/s per process, DeepSpeed issue #735), a
        node by its memory bandwidth, which does not grow with the ranks (ZeRO-3 offload of
        Qwen-72B on 4x8 A100: ~1.8e9 elements/s per node, DeepSpeed issue #6834).
        """
        node = self.cpu_adam_node_elems_per_s or self.cpu_adam_elems_per_s * self.gpus_per_node
        return min(self.cpu_adam_elems_per_s, node / max(1, ranks_on_node))

    def compute_tflops(self, dtype: str, block_numel: float = 0.0) -> float:
        """The rate a model's forward+backward runs at, in TFLOP/s.

        Measured block curve (interpolated at ``block_numel``, the parameters of one block, log-log
        between points, clamped at the ends), else the model-level rate, else the
        matmul rate (the bare GEMM rate, optimistic for whole models). ``fp32`` stands in for a
        dtype a field lacks.

        Raises:
            ValueError: no rate at all for the dtype.
        """
        for name in (dtype, "fp32"):
            if self.block_tflops_curves.get(name):
                return interpolate_log(self.block_tflops_curves[name], block_numel)
            rate = self.model_tflops.get(name) or self.matmul_tflops.get(name)
            if rate:
                return rate
        raise ValueError(f"hardware {self.name} has no compute rate for {dtype}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> HardwareSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown hardware field(s): {', '.join(unknown)}")
        return cls(**raw)


def interpolate_log(curve: dict[int, float], x: float) -> float:
    """Log-log linear interpolation of ``curve`` ({x: y}) at ``x``, clamped to the end points."""
    points = sorted(curve.items())
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return points[-1][1]  # not reached


def save_hardware(spec: HardwareSpec, path: str | Path, header: str = "") -> None:
    """Writes a spec as YAML with an optional comment header."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).write_text(comment + yaml.safe_dump(spec.to_dict(), sort_keys=False, width=100))


def load_hardware_file(path: str | Path) -> HardwareSpec:
    """Reads a spec written by save_hardware or a preset file.

    Raises:
        FileNotFoundError: no such file.
        InputFileError: (a ValueError) the file is unreadable, not YAML, truncated or does not describe
            a HardwareSpec; one line naming the file and what is wrong.
    """
    path = Path(path)
    if not path.is_file() and not path.is_dir():
        raise FileNotFoundError(f"{path}: no such hardware file")
    hint = "write it again with `elixir-tune probe --out FILE` or use a preset id"
    raw = load_yaml_mapping(path, "hardware spec", hint)
    known = {f.name for f in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InputFileError(path, f"unknown hardware field(s): {', '.join(unknown)}", hint)
    missing = [
        f.name
        for f in dataclasses.fields(HardwareSpec)
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise InputFileError(path, f"incomplete hardware spec (truncated?): missing {', '.join(missing)}", hint)
    try:
        return HardwareSpec.from_dict(raw)
    except (TypeError, ValueError) as error:
        raise InputFileError(path, str(error), hint) from None
