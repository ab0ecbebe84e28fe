"""What the README and docs/ show a user works: every relative link resolves (file and anchor), and
every command in a shell code block is a real command with real options.

Checked per command line of a ```bash block (README.md, docs/guides/): `elixir-tune SUB` is a subcommand
whose `--help` runs and every `--option` given is one of SUB's; `elixir-run` options are its own, a recipe
name is a recipe and the options after it are the recipe's; `scripts/...` and `configs/...` files exist, an
option given to a Python or shell script appears in it, a `--hardware` name is a preset, and `python -m MODULE`
is importable. Placeholders (plan.yaml, DIR, train.py) are arguments, not checked. The last tests show that each check can fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from elixir_tune.paths import REPO_DIR

ROOT = Path(REPO_DIR)
PAGES = [
    *(ROOT / name for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "benchmarks/README.md")),
    *sorted((ROOT / "docs").rglob("*.md")),
]
COMMAND_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_fences(text: str) -> str:
    kept, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def shell_lines(text: str) -> list[str]:
    """The command lines of the ```bash/```sh blocks, continuation lines joined."""
    lines, language, pending = [], None, ""
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if fence:
            language = None if language is not None else fence.group(1)
            continue
        if language in ("bash", "sh", "shell", "console"):
            stripped = line.strip()
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            full = (pending + stripped).strip()
            pending = ""
            if full and not full.startswith("#"):
                lines.append(full)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _outside_fences(page.read_text())
    return {slug(match.group(1)) for match in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def link_problems(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in LINK.findall(_outside_fences(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}: {target}"
        if not resolved.is_relative_to(root):
            problems.append(f"{where} leaves the repository")
        elif not resolved.exists():
            problems.append(f"{where} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading gives #{anchor}")
    return problems


def _options(command: click.Command) -> dict[str, bool]:
    """Option string -> whether it takes a value."""
    found = {"--help": False, "-h": False}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in [*param.opts, *param.secondary_opts]:
                found[name] = not param.is_flag and not param.count
    return found


def _recipe_options(name: str) -> set[str]:
    parser = importlib.import_module(f"elixir_tune.recipes.{name}").build_parser()
    return set(parser._option_string_actions)


def _check_elixir_tune(tokens: list[str]) -> list[str]:
    from elixir_tune.cli.main import cli

    if len(tokens) < 2 or tokens[1].startswith("-"):
        return []
    sub = cli.commands.get(tokens[1])
    if sub is None:
        return [f"elixir-tune has no subcommand {tokens[1]!r}"]
    problems = []
    result = CliRunner().invoke(cli, [tokens[1], "--help"])
    if result.exit_code != 0:
        problems.append(f"elixir-tune {tokens[1]} --help exits {result.exit_code}")
    options = _options(sub)
    if tokens[1] == "train":  # its unknown options go to the recipe it runs (finetune or pretrain)
        options = {**options, **dict.fromkeys(_recipe_options("finetune") | _recipe_options("pretrain"), True)}
    problems += [
        f"elixir-tune {tokens[1]} has no option {token}"
        for token in tokens[2:]
        if token.startswith("--") and token != "--" and token.split("=")[0] not in options
    ]
    return problems


def _check_elixir_run(tokens: list[str]) -> list[str]:
    from elixir_tune.cli.run import run_command
    from elixir_tune.recipes import RECIPES, is_recipe_name

    options, rest = _options(run_command), tokens[1:]
    problems = []
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        name = option.split("=")[0]
        if name not in options:
            return [f"elixir-run has no option {name}"]
        if options[name] and "=" not in option and rest:
            rest.pop(0)
    if len(rest) < 2:
        return problems
    script, script_args = rest[1], [token for token in rest[2:] if token != "--"]
    if is_recipe_name(script):
        if script not in RECIPES:
            return [f"{script!r} is no recipe"]
        known = _recipe_options(script)
        problems += [
            f"recipe {script} has no option {token}"
            for token in script_args
            if token.startswith("--") and token.split("=")[0] not in known
        ]
    return problems


def _check_script(tokens: list[str]) -> list[str]:
    problems = []
    for index, token in enumerate(tokens):
        if token.startswith(("scripts/", "configs/", "constraints/")):
            path = ROOT / token
            if not path.is_file():
                problems.append(f"{token} does not exist")
            elif path.suffix in (".py", ".sh"):
                text = path.read_text()
                problems += [
                    f"{token} has no option {option}"
                    for option in tokens[index + 1 :]
                    if option.startswith("--") and option.split("=")[0] not in text
                ]
        if token == "--hardware" and index + 1 < len(tokens) and not tokens[index + 1].endswith(".yaml"):
            if not (ROOT / "configs" / "hardware" / f"{tokens[index + 1]}.yaml").is_file():
                problems.append(f"no hardware preset {tokens[index + 1]}")
        if token == "-m" and index + 1 < len(tokens) and tokens[index + 1].startswith("elixir_tune"):
            if importlib.util.find_spec(tokens[index + 1]) is None:
                problems.append(f"no module {tokens[index + 1]}")
    return problems


def command_problems(line: str) -> list[str]:
    """What is wrong with one shown command line ([] when it is real)."""
    tokens = shlex.split(line, comments=True)
    problems = _check_script(tokens)
    for index, token in enumerate(tokens):
        if token == "elixir-tune":
            problems += _check_elixir_tune(tokens[index:])
            break
        if token == "elixir-run":
            problems += _check_elixir_run(tokens[index:])
            break
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.is_file(), page
    assert link_problems(page) == []


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_shown_command_is_real(page):
    lines = shell_lines(page.read_text())
    problems = [f"{line!r}: {problem}" for line in lines for problem in command_problems(line)]
    assert problems == []


def test_the_readme_starts_with_the_two_commands_ci_runs():
    lines = shell_lines((ROOT / "README.md").read_text())
    first = [shlex.split(line, comments=True) for line in lines[:2]]
    assert first == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]], lines[:2]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert any(line.startswith("elixir-tune ") for line in lines) and any("elixir-run " in line for line in lines)


def _pins(path: Path) -> dict[str, str]:
    pins = (line.split("==") for line in path.read_text().splitlines() if "==" in line and not line.startswith("#"))
    return {name.lower(): version for name, version in pins}


def test_the_readme_names_the_versions_the_constraints_pin():
    """The README's "tested versions" line says what constraints/tested.txt and oldest.txt pin."""
    readme = (ROOT / "README.md").read_text()
    tested, oldest = _pins(ROOT / "constraints" / "tested.txt"), _pins(ROOT / "constraints" / "oldest.txt")
    for name in ("torch", "transformers", "peft", "datasets"):
        assert f"{name} {tested[name]}" in readme, name
    for name in ("torch", "transformers"):
        assert f"{name} {oldest[name].rpartition('.0')[0] or oldest[name]}" in readme, name
    # The metadata's lower bounds are the oldest set's versions.
    setup = (ROOT / "setup.cfg").read_text()
    for name in ("transformers", "tokenizers", "peft", "datasets", "tensorboard", "click", "rich", "pyyaml"):
        bound = re.search(rf"^\s+{name}>=([\d.]+)$", setup, re.MULTILINE | re.IGNORECASE)
        assert bound and oldest[name].startswith(bound.group(1)), (name, bound and bound.group(1), oldest[name])


def test_the_docs_stay_short():
    """README under 15 KB and docs/ under 80 KB (issue 37): a newcomer reads them in one sitting."""
    assert (ROOT / "README.md").stat().st_size < 15_000
    assert sum(page.stat().st_size for page in (ROOT / "docs").rglob("*.md")) < 80_000


def test_the_checks_can_fail(tmp_path):
    assert command_problems("elixir-tune nosuch plan.yaml")
    assert command_problems("elixir-tune search --gpus 2 --no-such-option 1")
    assert command_problems("elixir-run --no-such-option plan.yaml pretrain")
    assert command_problems("elixir-run plan.yaml nosuchrecipe")
    assert command_problems("elixir-run plan.yaml finetune --no-such-option 1")
    assert command_problems("bash scripts/no_such_script.sh")
    assert command_problems("bash scripts/test.sh --no-such-tier")
    assert command_problems("elixir-tune profile configs/models/no-such-model.yaml")
    assert command_problems("elixir-tune search --gpus 2 --hardware no-such-preset")
    assert command_problems("python scripts/gpu_validate.py --no-such-option")
    assert command_problems("python -m elixir_tune.no_such_module")
    assert command_problems("elixir-tune search --gpus 2 --hardware cpu") == []
    assert command_problems("elixir-run --dry-run plan.yaml finetune --model DIR --data x.txt") == []
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#title) [c](#nowhere) [d](https://example.com)\n")
    problems = link_problems(page, root=tmp_path)
    assert len(problems) == 2, problems  # missing.md and #nowhere
    sub = tmp_path / "sub"
    sub.mkdir()
    (tmp_path / "outside.md").write_text("# Outside\n")
    (sub / "in.md").write_text("[o](../outside.md)\n")
    assert link_problems(sub / "in.md", root=sub) == ["in.md: ../outside.md leaves the repository"]
