"""The dependency rules of docs/overview.md (import rules), checked by importing each package in a fresh
interpreter and looking at what came along."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# package -> module prefixes it must not pull in
FORBIDDEN = {
    "elixir_tune.plan": ["torch", "click", "rich", "elixir_tune.engine", "elixir_tune.search"],
    "elixir_tune.profiler.schema": ["torch", "click", "rich"],
    "elixir_tune.hardware.spec": ["torch", "click", "rich"],
    # elixir-tune export writes the engines' configurations from a plan alone (engine/peers/ reads it too)
    "elixir_tune.export.deepspeed_config": ["torch", "click", "rich", "elixir_tune.engine"],
    "elixir_tune.export.fsdp2_setup": ["torch", "click", "rich", "elixir_tune.engine"],
    "elixir_tune.export.peer_plans": ["torch", "click", "rich", "elixir_tune.engine"],
    "elixir_tune.costmodel": ["elixir_tune.engine", "elixir_tune.launcher", "elixir_tune.cli", "click", "rich"],
    "elixir_tune.search": ["elixir_tune.engine", "elixir_tune.launcher", "elixir_tune.cli", "click", "rich"],
    "elixir_tune.profiler": ["elixir_tune.engine", "elixir_tune.launcher", "elixir_tune.cli", "click", "rich"],
    "elixir_tune.hardware": ["elixir_tune.engine", "elixir_tune.launcher", "elixir_tune.cli", "click", "rich"],
    "elixir_tune.engine": [
        "elixir_tune.search",
        "elixir_tune.costmodel",
        "elixir_tune.profiler",
        "elixir_tune.cli",
        "click",
        "rich",
        # DTensor costs about 0.5 s to import: engine/comm/ loads it when tensor parallelism is used
        "torch.distributed.tensor",
    ],
    "elixir_tune.launcher": [
        "elixir_tune.search",
        "elixir_tune.costmodel",
        "elixir_tune.profiler",
        "elixir_tune.cli",
        "click",
        "rich",
    ],
    # The recipe registry elixir-run reads: a recipe's own module imports torch, the registry nothing heavy.
    "elixir_tune.recipes": ["torch", "click", "rich", "transformers"],
    "elixir_tune.hf_cache": ["torch", "click", "rich"],
    # The model-side modules (docs/overview.md, import rule 7): the profiler and the engine both read them.
    "elixir_tune.models.stage_plans": ["torch", "elixir_tune.engine", "elixir_tune.profiler", "click", "rich"],
    "elixir_tune.models.lora": ["peft", "elixir_tune.engine", "elixir_tune.profiler", "elixir_tune.cli", "rich"],
    "elixir_tune": ["torch", "click", "rich"],
}


def _imported_by(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_package_imports_only_what_the_design_allows(module: str):
    loaded = _imported_by(module)
    bad = sorted(
        name for name in loaded for prefix in FORBIDDEN[module] if name == prefix or name.startswith(prefix + ".")
    )
    assert not bad, f"{module} pulls in {bad}"


def _importers(library: str) -> list[str]:
    import re
    from pathlib import Path

    import elixir_tune

    package = Path(elixir_tune.__file__).parent
    return sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(rf"^\s*(from|import)\s+{library}\b", path.read_text(), re.MULTILINE)
    )


def test_only_the_programs_users_run_import_rich_and_only_cli_imports_click():
    """cli/ (through console.py) and recipes/ (through progress.py) show progress; only cli/ parses with click."""
    assert _importers("rich") == ["cli/console.py", "cli/progress.py"]
    assert _importers("click") and all(path.startswith("cli/") for path in _importers("click"))


def test_only_comm_calls_torch_distributed_in_the_engine():
    """The engine's torch.distributed calls all sit in its comm/ package (docs/overview.md, import rule 4)."""
    import re
    from pathlib import Path

    import elixir_tune

    engine = Path(elixir_tune.__file__).parent / "engine"
    users = sorted(
        str(path.relative_to(engine))
        for path in engine.rglob("*.py")
        if re.search(r"torch\.distributed|from torch import distributed", path.read_text())
    )
    # engine/peers/ runs plans on PyTorch FSDP2 and DeepSpeed: those engines are torch's (and
    # DeepSpeed's) own distributed code, called there as a user's script would call them.
    assert users and all(path.startswith(("comm/", "peers/")) for path in users), users


def test_only_the_device_module_calls_torch_cuda():
    """Streams, events, pinned memory and synchronisation go through elixir_tune/device.py, so that the
    CPU tests reach the code paths that use them (tests/unit/test_device_ops.py). Strings don't count."""
    import ast
    from pathlib import Path

    import elixir_tune

    package = Path(elixir_tune.__file__).parent
    allowed = {"device.py", "engine/io/checkpoint.py"}  # checkpoint.py: the CUDA RNG state, saved and restored
    users = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            cuda = isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node) == "torch.cuda"
            pinned = isinstance(node, ast.keyword) and node.arg == "pin_memory"
            if cuda or pinned:
                users.add(str(path.relative_to(package)))
    assert users <= allowed, sorted(users - allowed)
