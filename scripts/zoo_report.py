#!/usr/bin/env python
"""Runs the zoo (tests/zoo/) and prints its table: each model's family, the layout the default
search chose for each training loop, and whether each loop matched plain PyTorch.

    .venv/bin/python scripts/zoo_report.py                 # every model, about a minute on 2 cores
    .venv/bin/python scripts/zoo_report.py gpt2 mamba      # some of them
    .venv/bin/python scripts/zoo_report.py --errors        # also each failure's message
    .venv/bin/python scripts/zoo_report.py --out benchmarks/results/zoo-cpu   # writes the report (.md, .json)
    .venv/bin/python scripts/zoo_report.py mamba --fix chunk_size=4096 --fix cache_blocks=2   # more search pins

Each model is profiled on the meta device and searched at world 2 on the ``cpu`` preset (global
batch 8) once per loop (tests/zoo/harness.py ``zoo_plan``); one launch of two gloo processes trains
it for 4 steps with a plain loop (``model(**batch)`` + ``optimizer.backward``) and with
``model.forward_backward``, and compares with plain PyTorch on the same global batches. Columns:

    layout      data x pipeline x tensor, accumulation steps (kind), offloaded / all chunks
    verdict     PASS (losses within 1e-5 relative, weights within 1e-5 absolute) or FAIL
    loss rel    the largest relative loss difference over both loops
    weight abs  the largest absolute weight difference over both loops
    torch ctl   plain PyTorch accumulating the same micro-batches, against plain PyTorch on the
                whole batch: the fp32 summation-order floor under ``weight abs``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.zoo.harness import LOOPS, ZooResult, run_zoo  # noqa: E402
from tests.zoo.models import ZOO  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
from report_meta import generated, load_average, with_header, write_pair  # noqa: E402


def _worst(values: list[float | None]) -> str:
    known = [value for value in values if value is not None]
    if not known:
        return "-"
    return "nan" if any(value != value for value in known) else f"{max(known):.1e}"


def _verdict(result: ZooResult) -> str:
    if result.ok:
        return "PASS"
    if not result.layout:
        return "FAIL (no plan)"
    return "FAIL (NaN)" if result.loss_rel is not None and result.loss_rel != result.loss_rel else "FAIL"


def table(results: list[ZooResult]) -> str:
    """The markdown table, one row per model."""
    by_key = {(result.model, result.loop): result for result in results}
    lines = [
        "| model | family | plain layout | plain | forward_backward layout | forward_backward | loss rel | weight abs "
        "| torch ctl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(result.model for result in results):
        plain, fb = (by_key[name, loop] for loop in LOOPS)
        pair = (plain, fb)
        lines.append(
            f"| {name} | {ZOO[name].family} | {plain.layout or '-'} | {_verdict(plain)} | {fb.layout or '-'} | "
            f"{_verdict(fb)} | {_worst([r.loss_rel for r in pair])} | {_worst([r.weight_abs for r in pair])} | "
            f"{_worst([r.control_abs for r in pair])} |"
        )
    return "\n".join(lines)


def write_report(prefix: Path, results: list[ZooResult], summary: str, g: dict) -> None:
    """PREFIX.md (the table, with the columns explained) and PREFIX.json (every result)."""
    import torch
    import transformers

    text = (
        "# The zoo: every model through the default search at world 2 on the cpu preset, both loops, against "
        f"plain PyTorch\n\ntorch {torch.__version__}, transformers {transformers.__version__}. Layout: data x "
        'pipeline x tensor. Tolerances: loss 1e-5 relative, weights 1e-5 absolute after 4 steps, fp32; "torch '
        'ctl" is plain PyTorch accumulating the same micro-batches against the whole-batch reference (its own '
        f"summation-order floor). The test: `pytest tests/zoo`.\n\n{table(results)}\n\n{summary}.\n"
    )
    report = {"generated": g, "summary": summary, "results": [dataclasses.asdict(result) for result in results]}
    write_pair(prefix, report, with_header(text, g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help=f"zoo models (default all: {', '.join(ZOO)})")
    parser.add_argument("--errors", action="store_true", help="print each failure's message")
    parser.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE", help="pin a search choice")
    parser.add_argument("--out", help="write the report as PREFIX.md and PREFIX.json")
    args = parser.parse_args()
    load_before = load_average()
    unknown = [name for name in args.models if name not in ZOO]
    if unknown:
        parser.error(f"unknown zoo models {unknown}; known: {', '.join(ZOO)}")
    results, wall_s = run_zoo(args.models or None, tuple(args.fix))
    print(table(results))
    passed = sum(result.ok for result in results)
    summary = f"{passed}/{len(results)} model x loop cases pass; the zoo took {wall_s:.0f} s"
    print(f"\n{summary}")
    if args.out:
        write_report(
            Path(args.out),
            results,
            summary,
            generated(load_before, " ".join(["python scripts/zoo_report.py"] + sys.argv[1:])),
        )
    if args.errors:
        for result in results:
            if not result.ok:
                print(f"\n{result.model} / {result.loop} ({result.layout or 'no plan'}): {result.error[:600]}")


if __name__ == "__main__":
    main()
