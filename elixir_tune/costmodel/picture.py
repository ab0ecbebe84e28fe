"""A picture of a predicted step: the timeline's lanes and device memory over the step, as SVG.

One panel per plan, stacked on one page with a shared time scale, so that two plans (the best and
the runner-up) compare at a glance. Each block of a lane is a rectangle with a tooltip naming what
it serves; each carries ``data-*`` attributes with its exact times, so that a program (or a test)
can read the figures back from the file. Plain SVG 1.1, no script: it opens in any browser.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from elixir_tune.costmodel.model import CostModel, Shape
from elixir_tune.units import gib

LANES = ("compute", "all-gather", "reduce-scatter", "host-to-device", "device-to-host", "cpu optimizer")
_COLOURS = {
    "compute": "#4c78a8",
    "all-gather": "#f58518",
    "reduce-scatter": "#e45756",
    "host-to-device": "#72b7b2",
    "device-to-host": "#54a24b",
    "cpu optimizer": "#b279a2",
}
_WIDTH_PX = 1200
_LABEL_PX = 130
_LANE_PX = 26
_MEMORY_PX = 120
_PANEL_GAP_PX = 40


@dataclass(frozen=True)
class Span:
    """One block of work on one lane.

    Attributes:
        lane: one of ``LANES``.
        start_s: when it starts, seconds from the start of the step.
        end_s: when it ends.
        label: what it serves (a chunk and the module that needs it, a step of compute, ...).
    """

    lane: str
    start_s: float
    end_s: float
    label: str


@dataclass
class StepPicture:
    """What one panel shows.

    Attributes:
        title: the panel's heading (the plan's shape).
        step_time_s: the predicted step time (the panel's time axis ends there at the latest).
        spans: the blocks of every lane.
        memory: (time_s, device bytes) points of device memory over the step.
        limit_bytes: the device memory the plan may use (drawn as a line).
    """

    title: str
    step_time_s: float
    spans: list[Span] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)
    limit_bytes: int = 0


def shape_title(rank: str, shape: Shape, step_time_s: float, peak_gpu_bytes: int) -> str:
    """A panel heading that names the plan's choices."""
    checkpointing = {0: "none", 1: "all"}.get(shape.every, f"every {shape.every}") + " selective" * shape.selective
    return (
        f"{rank}: chunk {shape.chunk_size * 4 / 2**20:.3g} MiB (fp32), cache {shape.cache_blocks}, "
        f"{shape.num_offloaded} shard(s) offloaded, prefetch {shape.prefetch}, checkpointing {checkpointing}, "
        f"micro-batch {shape.micro_batch_size} x {shape.grad_accum_steps}: "
        f"{_format_s(step_time_s)} per step, peak {gib(peak_gpu_bytes)}"
    )


def picture_of(model: CostModel, shape: Shape, title: str, limit_bytes: int) -> StepPicture:
    """The predicted step of one candidate, as the cost model sees it.

    Device memory over the step: model states, buffers and overhead all along, plus each
    micro-batch's activations growing through its forward and released through its backward (a
    straight line each way, reaching the predicted peak at the end of the forward).

    Args:
        model: the cost model the candidate was scored with.
        shape: the candidate.
        title: the panel's heading.
        limit_bytes: the device memory a rank may fill.

    Returns:
        The panel.
    """
    blocks: list[tuple[str, float, float, str, int]] = []
    estimate = model.step_time(shape, record=blocks)
    memory = model.memory(shape)
    layout = model.layout(shape.chunk_size)
    names = [_common_module([model.profile.params[i].name for i in chunk.params]) for chunk in layout.chunks]
    spans = [Span(lane, start_s, end_s, _label(what, index, names)) for lane, start_s, end_s, what, index in blocks]
    base_bytes = memory.peak_gpu_bytes - memory.activation_bytes
    compute_s, recompute_s = model.compute_s(shape.micro_batch_size, shape.every, shape.selective)
    forward_share = (compute_s - recompute_s) / 3 / compute_s if compute_s > 0 else 0.5
    points: list[tuple[float, int]] = [(0.0, base_bytes)]
    for start_s, end_s in _micro_batch_windows(blocks):
        peak_at_s = start_s + (end_s - start_s) * forward_share
        points += [(start_s, base_bytes), (peak_at_s, memory.peak_gpu_bytes), (end_s, base_bytes)]
    points.append((estimate.step_time_s, base_bytes))
    return StepPicture(
        title=title, step_time_s=estimate.step_time_s, spans=spans, memory=points, limit_bytes=limit_bytes
    )


def _micro_batch_windows(blocks: list[tuple[str, float, float, str, int]]) -> list[tuple[float, float]]:
    """(start, end) of each micro-batch's compute: each one starts again at step 0."""
    windows: list[tuple[float, float]] = []
    for _lane, start_s, end_s, what, index in blocks:
        if what != "step":
            continue
        if index == 0 or not windows:
            windows.append((start_s, end_s))
        else:
            windows[-1] = (windows[-1][0], end_s)
    return windows


def _common_module(params: list[str]) -> str:
    """The module path all of a chunk's parameters share (or the first one's module)."""
    prefix = os.path.commonprefix([p.split(".") for p in params]) if params else []
    if not prefix and params:
        prefix = params[0].split(".")[:-1]
    return ".".join(prefix) or "<model>"


def _label(what: str, index: int, names: list[str]) -> str:
    if what == "step":
        return f"step {index}"
    if what == "chunk":
        return f"chunk {index} ({names[index]})" if index < len(names) else f"chunk {index}"
    if what == "norm":
        return "gradient-norm all-reduce"
    return "optimizer step"


def write_svg(path: str | os.PathLike, pictures: list[StepPicture]) -> None:
    """Writes the panels to ``path`` as one SVG page (see ``render_svg``)."""
    with open(path, "w", encoding="utf-8") as out:
        out.write(render_svg(pictures))


def render_svg(pictures: list[StepPicture]) -> str:
    """The SVG document for one or more panels, stacked, on one time scale.

    Args:
        pictures: the panels, top to bottom.

    Returns:
        The SVG text.
    """
    horizon_s = max((p.step_time_s for p in pictures), default=0.0) or 1.0
    panel_px = 24 + len(LANES) * _LANE_PX + 30 + _MEMORY_PX + 20
    height_px = len(pictures) * (panel_px + _PANEL_GAP_PX)
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH_PX}" height="{height_px}" '
        f'font-family="sans-serif" font-size="11" data-horizon-s="{horizon_s!r}">',
    ]
    for index, picture in enumerate(pictures):
        parts += _panel(picture, index * (panel_px + _PANEL_GAP_PX), horizon_s)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _x(time_s: float, horizon_s: float) -> float:
    return _LABEL_PX + (_WIDTH_PX - _LABEL_PX - 20) * time_s / horizon_s


def _panel(picture: StepPicture, top_px: float, horizon_s: float) -> list[str]:
    out = [
        f'<g class="panel" data-title={quoteattr(picture.title)} data-step-time-s="{picture.step_time_s!r}">',
        f'<text x="4" y="{top_px + 14}" font-size="13" font-weight="bold">{escape(picture.title)}</text>',
    ]
    lanes_top = top_px + 24
    for row, lane in enumerate(LANES):
        y = lanes_top + row * _LANE_PX
        out.append(
            f'<g class="lane" data-lane="{lane}"><text x="4" y="{y + 17}">{lane}</text>'
            f'<line x1="{_LABEL_PX}" y1="{y + _LANE_PX}" x2="{_WIDTH_PX - 20}" y2="{y + _LANE_PX}" stroke="#ddd"/>'
        )
        for span in picture.spans:
            if span.lane == lane:
                out.append(_block(span, y, horizon_s))
        out.append("</g>")
    axis_y = lanes_top + len(LANES) * _LANE_PX
    out += _time_axis(axis_y, horizon_s, picture.step_time_s)
    out += _memory(picture, axis_y + 30, horizon_s)
    out.append("</g>")
    return out


def _block(span: Span, lane_y: float, horizon_s: float) -> str:
    x0, x1 = _x(span.start_s, horizon_s), _x(span.end_s, horizon_s)
    width = max(x1 - x0, 0.5)  # a block too short to see still shows as a hairline
    tip = f"{span.label}: {span.start_s * 1e3:.3f}-{span.end_s * 1e3:.3f} ms"
    text = ""
    if width > 7 * len(span.label):
        text = f'<text x="{x0 + 2:.1f}" y="{lane_y + 16}" fill="white">{escape(span.label)}</text>'
    return (
        f'<g class="block" data-lane="{span.lane}" data-label={quoteattr(span.label)} '
        f'data-start-s="{span.start_s!r}" data-end-s="{span.end_s!r}">'
        f'<rect x="{x0:.2f}" y="{lane_y + 3}" width="{width:.2f}" height="{_LANE_PX - 6}" '
        f'fill="{_COLOURS[span.lane]}" stroke="white" stroke-width="0.5"><title>{escape(tip)}</title></rect>{text}</g>'
    )


def _time_axis(y: float, horizon_s: float, step_time_s: float) -> list[str]:
    tick_s = _nice_step(horizon_s / 8)
    out = [f'<line x1="{_LABEL_PX}" y1="{y}" x2="{_WIDTH_PX - 20}" y2="{y}" stroke="#333"/>']
    count = int(horizon_s / tick_s + 1e-9)
    for k in range(count + 1):
        x = _x(k * tick_s, horizon_s)
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{_format_s(k * tick_s)}</text>')
    end_x = _x(step_time_s, horizon_s)
    out.append(
        f'<line class="step-end" x1="{end_x:.1f}" y1="{y - len(LANES) * _LANE_PX}" x2="{end_x:.1f}" y2="{y}" '
        'stroke="#000" stroke-dasharray="3,3"/>'
    )
    return out


def _memory(picture: StepPicture, top: float, horizon_s: float) -> list[str]:
    peak = max([b for _, b in picture.memory] + [picture.limit_bytes, 1])
    bottom = top + _MEMORY_PX

    def y_of(value: int) -> float:
        return bottom - _MEMORY_PX * value / peak

    points = " ".join(f"{_x(t, horizon_s):.1f},{y_of(b):.1f}" for t, b in picture.memory)
    out = [
        f'<g class="memory" data-peak-bytes="{max((b for _, b in picture.memory), default=0)}">',
        f'<text x="4" y="{top + 12}">device memory</text>',
        f'<text x="4" y="{top + 26}">(peak {gib(max((b for _, b in picture.memory), default=0))})</text>',
        f'<line x1="{_LABEL_PX}" y1="{bottom}" x2="{_WIDTH_PX - 20}" y2="{bottom}" stroke="#333"/>',
        f'<polyline class="memory-line" points="{points}" fill="none" stroke="#4c78a8" stroke-width="1.5"/>',
    ]
    if picture.limit_bytes:
        y = y_of(picture.limit_bytes)
        out.append(
            f'<line class="limit" data-limit-bytes="{picture.limit_bytes}" x1="{_LABEL_PX}" y1="{y:.1f}" '
            f'x2="{_WIDTH_PX - 20}" y2="{y:.1f}" stroke="#e45756" stroke-dasharray="6,3"/>'
        )
        out.append(f'<text x="{_WIDTH_PX - 24}" y="{y - 3:.1f}" text-anchor="end" fill="#e45756">'
                   f"limit {gib(picture.limit_bytes)}</text>")  # fmt: skip
    out.append("</g>")
    return out


def _nice_step(raw_s: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw_s``."""
    if raw_s <= 0:
        return 1.0
    power = 10.0 ** _floor_log10(raw_s)
    for factor in (1, 2, 5, 10):
        if factor * power >= raw_s:
            return factor * power
    return 10 * power


def _floor_log10(value: float) -> int:
    exponent = 0
    while value >= 10:
        value /= 10
        exponent += 1
    while value < 1:
        value *= 10
        exponent -= 1
    return exponent


def _format_s(seconds: float) -> str:
    if seconds == 0:
        return "0"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
