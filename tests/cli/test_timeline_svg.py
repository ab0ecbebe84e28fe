"""The picture of a predicted step: `search --timeline` and `show --timeline` write an SVG whose lanes,
blocks and memory line are those of the cost model's timeline."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from elixir_tune.cli.main import cli
from elixir_tune.costmodel.picture import LANES
from elixir_tune.costmodel.synthetic import gpt2_profile
from elixir_tune.plan import load_plan
from elixir_tune.profiler.schema import save_profile

SVG = "{http://www.w3.org/2000/svg}"


def _panels(path) -> list[ET.Element]:
    root = ET.parse(path).getroot()  # a parse error fails the test: the file must be well-formed XML
    assert root.tag == f"{SVG}svg"
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"]


def _blocks(panel: ET.Element) -> list[tuple[str, str, float, float]]:
    return [
        (g.get("data-lane"), g.get("data-label"), float(g.get("data-start-s")), float(g.get("data-end-s")))
        for g in panel.iter(f"{SVG}g")
        if g.get("class") == "block"
    ]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """gpt2-10b on 4 x a100-40gb-pcie, micro-batch 4 x 2 (so two micro-batches are drawn)."""
    folder = tmp_path_factory.mktemp("timeline")
    save_profile(gpt2_profile("gpt2-10b"), folder / "profile.yaml")
    args = ["search", "--gpus", "4", "--hardware", "a100-40gb-pcie", "--profile", str(folder / "profile.yaml")]
    args += ["--global-batch-size", "32", "--fix", "micro_batch_size=4", "--fix", "accumulation=standard"]
    args += ["--out", str(folder / "plan.yaml")]
    result = CliRunner().invoke(cli, [*args, "--timeline", str(folder / "step.svg")])
    assert result.exit_code == 0, result.output
    return folder


def test_search_draws_best_and_runner_up_with_every_lane(searched):
    panels = _panels(searched / "step.svg")
    assert [p.get("data-title").split(":")[0] for p in panels] == ["#1 best", "#2 runner-up"]
    for panel in panels:
        lanes = [g.get("data-lane") for g in panel.iter(f"{SVG}g") if g.get("class") == "lane"]
        assert lanes == list(LANES)
        memory = [e for e in panel.iter() if e.get("class") == "memory-line"]
        limit = [e for e in panel.iter() if e.get("class") == "limit"]
        assert len(memory) == 1 and len(memory[0].get("points").split()) >= 4
        assert len(limit) == 1 and int(limit[0].get("data-limit-bytes")) > 0


def test_blocks_add_up_to_the_predicted_step(searched):
    plan = load_plan(searched / "plan.yaml")
    best = _panels(searched / "step.svg")[0]
    blocks = _blocks(best)
    step_time_s = float(best.get("data-step-time-s"))
    assert step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-6)  # the plan keeps 7 digits
    # The step ends with its last block (the optimizer), and nothing runs before 0.
    assert max(end for *_, end in blocks) == pytest.approx(step_time_s, rel=1e-12)
    assert min(start for _, _, start, _ in blocks) >= 0
    # The compute lane's steps are the predicted compute (recomputation included), micro-batch by micro-batch.
    compute_s = sum(end - start for lane, label, start, end in blocks if lane == "compute" and label.startswith("step"))
    assert compute_s == pytest.approx(plan.prediction.breakdown["compute_s"], rel=1e-6)
    assert sum(label == "step 0" for lane, label, *_ in blocks if lane == "compute") == 2  # two micro-batches
    # Each offloaded shard crosses the link: uploads on host-to-device, gradients down on device-to-host.
    offloaded = sum(chunk.offload for chunk in plan.memory.chunks)
    if offloaded:
        assert any(lane == "host-to-device" for lane, *_ in blocks)
        assert sum(lane == "device-to-host" for lane, *_ in blocks) == 2 * offloaded
    for lane, label, start, end in blocks:
        assert end >= start, (lane, label)
        assert lane in LANES


def test_show_draws_the_same_step_from_the_plan(searched, tmp_path):
    args = ["show", str(searched / "plan.yaml"), "--profile", str(searched / "profile.yaml")]
    result = CliRunner().invoke(cli, [*args, "--timeline", str(tmp_path / "show.svg")])
    assert result.exit_code == 0, result.output
    (shown,) = _panels(tmp_path / "show.svg")
    best = _panels(searched / "step.svg")[0]
    assert _blocks(shown) == _blocks(best)


def test_show_refuses_a_profile_of_another_model(searched, tmp_path):
    other = gpt2_profile("gpt2-4b")
    other.fingerprint = "0123456789abcdef"
    save_profile(other, tmp_path / "other.yaml")
    args = ["show", str(searched / "plan.yaml"), "--profile", str(tmp_path / "other.yaml")]
    result = CliRunner().invoke(cli, [*args, "--timeline", str(tmp_path / "show.svg")])
    assert result.exit_code == 1
    assert "profiles another model" in result.output and "--profile" in result.output
    assert not (tmp_path / "show.svg").exists()


def test_show_refuses_chunks_the_profile_does_not_pack_to(searched, tmp_path):
    # Same fingerprint (synthetic profiles share one), other shapes: as a plan edited by hand would be.
    save_profile(gpt2_profile("gpt2-4b"), tmp_path / "other.yaml")
    args = ["show", str(searched / "plan.yaml"), "--profile", str(tmp_path / "other.yaml")]
    result = CliRunner().invoke(cli, [*args, "--timeline", str(tmp_path / "show.svg")])
    assert result.exit_code == 1
    assert "cannot be simulated" in result.output
    assert not (tmp_path / "show.svg").exists()
