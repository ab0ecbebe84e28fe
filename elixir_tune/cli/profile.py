"""`elixir-tune profile MODEL`: trace a model on the meta device and write profile.yaml."""

from __future__ import annotations

from pathlib import Path

import click

from elixir_tune.cli.console import Table, console, err_console, fail, print_json, refuse_output_over_input
from elixir_tune.cli.default_outputs import guards_default_output, refuse_replacing_profile
from elixir_tune.cli.types import FiniteRange
from elixir_tune.paths import split_model_spec

MODEL_HINT = (
    "MODEL is a .py file defining build_model() and example_batch(batch_size, seq_len) (file.py:builder names "
    "another builder), a model YAML, a config name from configs/models/ such as gpt2-tiny, or a Hugging Face "
    "model directory (its config.json; weights are not read)"
)


@click.command("profile")
@click.argument("model")
@click.option(
    "--batch-size", "-b", type=click.IntRange(min=1), default=8, show_default=True, help="Micro-batch size traced."
)
@click.option(
    "--seq-len",
    "-s",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per sample [default: the model YAML's seq_len, else 1024 or the model's positions if fewer].",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"], case_sensitive=False),
    default="fp32",
    show_default=True,
    help="Compute dtype.",
)
@click.option(
    "--checkpointing",
    type=click.Choice(["none", "all"], case_sensitive=False),
    default="none",
    show_default=True,
    help="'all' also records the access trace with every block checkpointed.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False),
    default="profile.yaml",
    show_default=True,
    help="Profile file to write.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace profile.yaml (when --out is not given) even if it holds another model's profile.",
)
@click.option(
    "--lora-rank",
    type=click.IntRange(min=1),
    default=None,
    help="Profile the model with LoRA adapters of this rank (PEFT): the base frozen, only the adapters trained.",
)
@click.option(
    "--lora-alpha", type=FiniteRange(min=0, min_open=True), default=None, help="LoRA alpha [default: 2 x rank]."
)
@click.option(
    "--lora-dropout", type=FiniteRange(0, 1, max_open=True), default=0.0, show_default=True, help="LoRA dropout."
)
@click.option(
    "--lora-targets",
    default=None,
    help="Comma-separated module names to adapt, e.g. q_proj,v_proj [default: PEFT's choice for the model family].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def profile_command(
    model: str,
    batch_size: int,
    seq_len: int | None,
    dtype: str,
    checkpointing: str,
    out: str,
    force: bool,
    lora_rank: int | None,
    lora_alpha: float | None,
    lora_dropout: float,
    lora_targets: str | None,
    as_json: bool,
) -> None:
    """Profile MODEL on the meta device (no weights, any size) and write profile.yaml.

    Records every parameter in first-use order, the forward+backward parameter access trace, the
    repeated blocks, FLOPs, activation memory as a function of the micro-batch size (with and
    without checkpointing), buffers and the model fingerprint a plan carries.

    \b
    Examples:
        elixir-tune profile configs/models/gpt2-tiny.yaml --batch-size 8 --seq-len 128
        elixir-tune profile gpt2-20b --batch-size 8 --seq-len 1024 --dtype bf16 --checkpointing all
        elixir-tune profile my_model.py:build_small --out small.yaml --json
        elixir-tune profile path/to/Llama-2-7b-hf --seq-len 1024 --dtype bf16   # a downloaded model
        elixir-tune profile path/to/Llama-2-7b-hf --lora-rank 16 --lora-targets q_proj,v_proj   # LoRA
    """
    # A missing file is answered before the profiler's imports (torch, transformers: seconds).
    model_path = Path(split_model_spec(model)[0])
    if model_path.suffix in (".py", ".yaml", ".yml") and not model_path.exists():
        fail(f"{model_path}: no such file", MODEL_HINT)
    refuse_output_over_input(out, {"MODEL": str(model_path)})
    from elixir_tune.profiler import ModelSourceError, profile_model, save_profile

    if lora_rank is None and (lora_alpha is not None or lora_targets is not None or lora_dropout):
        fail("--lora-alpha, --lora-dropout and --lora-targets need --lora-rank", "add --lora-rank R (e.g. 8)")
    lora = (
        {"rank": lora_rank, "alpha": lora_alpha, "dropout": lora_dropout, "target_modules": lora_targets}
        if lora_rank is not None
        else None
    )

    try:
        with err_console.status(f"profiling {model}") as status:
            profile = profile_model(
                model,
                batch_size=batch_size,
                seq_len=seq_len,
                dtype=dtype.lower(),
                checkpointing=checkpointing.lower(),
                progress=status.update,
                lora=lora,
            )
    except ModelSourceError as exc:
        fail(str(exc), MODEL_HINT)
    if guards_default_output("out", force):
        refuse_replacing_profile(out, profile)
    try:
        save_profile(profile, out)
    except OSError as exc:
        fail(f"cannot write {out}: {exc}", "pass another path with --out")

    batch = profile.batch_size
    ckpt = profile.activation_checkpointed
    shared = [p.name for p in profile.params if p.shared]
    if as_json:
        print_json(
            {
                "name": profile.name,
                "source": profile.source,
                "out": out,
                "fingerprint": profile.fingerprint,
                "num_params": profile.num_params,
                "shared_params": shared,
                "dtype": profile.dtype,
                "batch_size": batch,
                "seq_len": profile.seq_len,
                "block_list": profile.block_list,
                "num_blocks": len(profile.blocks),
                "flops_per_token": profile.flops_per_token,
                "flops_per_step": profile.flops_per_sample * batch,
                "recompute_flops_per_sample": profile.recompute_flops_per_sample,
                "activation_fixed_bytes": profile.activation.fixed_bytes,
                "activation_bytes_per_sample": profile.activation.per_sample_bytes,
                "activation_bytes_at_batch": profile.activation.at(batch),
                "activation_checkpointed_bytes_per_sample": ckpt.per_sample_bytes if ckpt else None,
                "activation_checkpointed_bytes_at_batch": ckpt.at(batch) if ckpt else None,
                "buffers_bytes": profile.buffers_bytes,
                "trace_steps": len(profile.trace),
                "trace_checkpointed_steps": len(profile.trace_checkpointed),
                "lora": profile.lora,
                "trainable_params": sum(p.numel for p in profile.params if p.requires_grad),
            }
        )
        return

    def activations(line) -> str:
        return f"{_scaled(line.at(batch), 1024)}B at batch {batch} ({_scaled(line.per_sample_bytes, 1024)}B per sample)"

    table = Table(title=f"profile of {profile.name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("parameters", f"{profile.num_params:,}" + (f"  (tied: {', '.join(shared)})" if shared else ""))
    if profile.lora:
        trained = sum(p.numel for p in profile.params if p.requires_grad)
        settings = ", ".join(f"{key} {value}" for key, value in profile.lora.items())
        table.add_row("LoRA", f"{settings}; {trained:,} trainable, the rest frozen")
    table.add_row("blocks", f"{len(profile.blocks)} in {profile.block_list}" if profile.blocks else "none found")
    table.add_row("traced at", f"batch {batch}, seq_len {profile.seq_len}, {profile.dtype}")
    table.add_row("FLOPs per token", f"{_scaled(profile.flops_per_token, 1000)}FLOP (forward+backward)")
    table.add_row("FLOPs per step", f"{_scaled(profile.flops_per_sample * batch, 1000)}FLOP at batch {batch}")
    table.add_row("activations", activations(profile.activation))
    if ckpt:
        table.add_row("  checkpointed", activations(ckpt))
    table.add_row("buffers", f"{_scaled(profile.buffers_bytes, 1024)}B")
    steps = f"{len(profile.trace)} steps"
    if profile.trace_checkpointed:
        steps += f", {len(profile.trace_checkpointed)} with checkpointing"
    table.add_row("access trace", steps)
    table.add_row("fingerprint", profile.fingerprint)
    console.print(table)
    console.print(f"wrote {out}")


def _scaled(value: float, base: int) -> str:
    """1234567 -> '1.23 M' (base 1000) or '1.18 Mi' (base 1024)."""
    units = ["", "K", "M", "G", "T", "P", "E"]
    i = 0
    while abs(value) >= base and i < len(units) - 1:
        value /= base
        i += 1
    suffix = units[i] + ("i" if base == 1024 and i else "")
    return f"{value:.3g} {suffix}" if i else f"{value:.0f} "
