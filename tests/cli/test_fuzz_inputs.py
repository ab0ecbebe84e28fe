"""Fuzzing the files users edit by hand: a searched plan, its profile and a hardware file, each
mutated at random (a field's value replaced by another type, a bound's edge, nan, a huge number or
nothing; a field deleted; an alias bomb). Every mutant must end within a second in one clear line
(exit 1, no traceback), or be valid; a plan that ``validate`` calls valid must then run a step in the
engine (or be refused there by name). Seeds are fixed, so a failure names its mutant.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

import elixir_tune
from elixir_tune.cli.main import cli
from elixir_tune.hardware import load_hardware, preset_path
from elixir_tune.plan import load_plan
from elixir_tune.profiler import load_model_source, profile_model, save_profile
from elixir_tune.search import search

SECOND_S = 1.0
# What a hand edit puts in a field: other types, bounds' edges, non-finite and huge numbers.
VALUES: list[Any] = [None, -1, 0, 1, 7, 10**30, 1e30, math.nan, math.inf, "x", "", [], {}, True, [1, 2], {"a": 1}]
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key or index path in a YAML tree (lists: their first three items)."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:3]):
            found += _paths(value, (*prefix, index))
    return found


def _mutant(tree: dict, rng: random.Random) -> tuple[dict, str]:
    """One random edit of ``tree``, and what it was."""
    out = copy.deepcopy(tree)
    path = rng.choice(_paths(out))
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.2:
        del parent[path[-1]]
        return out, f"deleted {'.'.join(map(str, path))}"
    value = rng.choice(VALUES)
    parent[path[-1]] = value
    return out, f"{'.'.join(map(str, path))} = {value!r}"


def _write(tree: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


class Failures(list):
    """What went wrong over a whole fuzz run, every mutant listed (not only the first)."""

    def check(self, args: list[str], what: str) -> tuple[int, str]:
        """Runs one command in process: it must end within a second, in exit 0 or 1, in words."""
        started = time.perf_counter()
        result = CliRunner().invoke(cli, args)
        elapsed_s = time.perf_counter() - started
        fault = ""
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            fault = f"raised {result.exception!r}"
        elif result.exit_code not in (0, 1) or "Traceback" in result.output:
            fault = f"exit {result.exit_code}: {result.output[-300:]}"
        elif result.exit_code == 1 and not result.output.strip():
            fault = "exit 1 without a word"
        elif elapsed_s >= SECOND_S:
            fault = f"took {elapsed_s:.2f} s"
        if fault:
            self.append(f"{what}: {args[0]} {fault}")
        return result.exit_code, result.output


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Any]:
    """GPT-2 tiny profiled, and a one-process plan searched from it (so the engine can run a mutant here)."""
    folder = tmp_path_factory.mktemp("fuzz")
    source = load_model_source("gpt2-tiny")
    profile = profile_model(source, batch_size=2, seq_len=16)
    profile_path = folder / "profile.yaml"
    save_profile(profile, profile_path)
    plan = search(profile, load_hardware("cpu"), gpus_per_node=1, global_batch_size=2).plan
    plan.search.profile = str(profile_path)
    plan_path = folder / "plan.yaml"
    _write(plan.to_dict(), plan_path)
    return {
        "folder": folder,
        "source": source,
        "plan": yaml.safe_load(plan_path.read_text()),
        "profile": yaml.safe_load(profile_path.read_text()),
        "hardware": yaml.safe_load(Path(preset_path("cpu")).read_text()),
        "plan_path": plan_path,
        "profile_path": profile_path,
    }


def _runs_a_step(source, plan_path: Path, what: str) -> list[str]:
    """A mutant validate accepted: the engine runs a step with it, or refuses it by name."""
    plan = load_plan(plan_path)
    torch.manual_seed(0)
    model = source.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        model, optimizer = elixir_tune.setup(model, optimizer, plan=plan)
        batch = source.example_batch(plan.training.micro_batch_size, plan.training.seq_len)
        model(**batch).loss.backward()
        optimizer.step()
    except ValueError as error:
        # The fingerprint is the model's alone: only the engine, holding the model, can compare it.
        if "the plan was made for another model" not in str(error):
            return [f"{what}: valid, but the engine raised {error!r}"]
    except Exception as error:  # noqa: BLE001 - the fuzz reports every kind
        return [f"{what}: valid, but the engine raised {error!r}"]
    return []


@pytest.mark.slow
def test_mutated_plans_are_valid_and_run_or_end_in_one_clear_line(files):
    rng = random.Random(0)
    failures, valid = Failures(), 0
    for index in range(150):
        tree, what = _mutant(files["plan"], rng)
        path = files["folder"] / f"plan_{index}.yaml"
        _write(tree, path)
        code, output = failures.check(["validate", str(path), "--json"], what)
        show_code, _ = failures.check(["show", str(path)], what)
        if code == 0 and show_code != 0:
            failures.append(f"{what}: validate says valid, show refuses it")
        if code == 0 and json.loads(output)["valid"]:
            valid += 1
            failures += _runs_a_step(files["source"], path, what)
    assert not failures, "\n".join(failures)
    assert valid > 10  # the fuzz reached the engine, not only the checks


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["profile", "hardware"])
def test_mutated_profiles_and_hardware_files_end_in_a_plan_or_one_clear_line(files, kind):
    rng = random.Random(1)
    failures = Failures()
    for index in range(60):
        tree, what = _mutant(files[kind], rng)
        path = files["folder"] / f"{kind}_{index}.yaml"
        _write(tree, path)
        profile = path if kind == "profile" else files["profile_path"]
        hardware = path if kind == "hardware" else "cpu"
        out = files["folder"] / f"searched_{kind}_{index}.yaml"
        args = ["search", "--profile", str(profile), "--hardware", str(hardware), "--gpus", "1", "--out", str(out)]
        code, _ = failures.check(args, what)
        if code == 0:
            failures.check(["validate", str(out)], what)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kind", ["plan", "profile", "hardware"])
def test_an_alias_bomb_in_any_file_is_one_clear_line(files, kind):
    path = files["folder"] / f"bomb_{kind}.yaml"
    path.write_text(ALIAS_BOMB)
    args = {
        "plan": ["validate", str(path)],
        "profile": ["search", "--profile", str(path), "--hardware", "cpu", "--gpus", "1"],
        "hardware": ["search", "--profile", str(files["profile_path"]), "--hardware", str(path), "--gpus", "1"],
    }[kind]
    failures = Failures()
    code, _ = failures.check(args, f"alias bomb as {kind}")
    assert not failures and code == 1, failures
