"""A step whose loss or gradient norm is not finite: fp32 and bf16 stop the run (NonFiniteError, the
weights the last finite ones, no save after it); fp16 skips the step and lowers its loss scale.
World of one on the CPU (the check raises in the step itself there; engine/finite.py)."""

from __future__ import annotations

import pytest
import torch

import elixir_tune
from elixir_tune.engine.io.checkpoint import read_meta  # the latest step directory
from tests.distributed.engine_plans import batches, make_plan, tiny_gpt2

MICRO = 2
ACCUM = 2


def set_up(dtype: str, lr: float):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    plan = make_plan(model, 1, 4096, block_list="transformer.h", dtype=dtype, grad_accum_steps=ACCUM)
    return elixir_tune.setup(model, opt, plan=plan)


def micro_batches(batch: dict, nan_micro_batch: bool = False) -> list[dict]:
    """The step's micro-batches; ``nan_micro_batch``: the last one's labels all ignored (-100), so its
    mean cross-entropy is 0 / 0 = NaN, as a data pipeline bug gives."""
    result = [{k: v[i * MICRO : (i + 1) * MICRO] for k, v in batch.items()} for i in range(ACCUM)]
    if nan_micro_batch:
        result[-1]["labels"] = torch.full_like(result[-1]["labels"], -100)
    return result


def masters(model) -> list[torch.Tensor]:
    return [chunk.master.detach().clone() for chunk in model.engine.chunks]


def test_the_errors_are_exported_with_their_bases():
    assert issubclass(elixir_tune.NonFiniteError, RuntimeError)
    assert issubclass(elixir_tune.ContractError, ValueError)
    assert {"NonFiniteError", "ContractError"} <= set(elixir_tune.__all__)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_diverging_learning_rate_stops_at_the_step_with_the_last_finite_weights(dtype, tmp_path):
    model, opt = set_up(dtype, lr=1e6)
    steps = batches(10, MICRO * ACCUM, 8)
    checkpoint = tmp_path / "ckpt"
    before = masters(model)
    with pytest.raises(elixir_tune.NonFiniteError) as caught:
        for step, batch in enumerate(steps):
            model.forward_backward(micro_batches(batch))
            before = masters(model)  # what the failing step must leave
            opt.step()
            opt.zero_grad()
            elixir_tune.save_checkpoint(checkpoint, model, opt, step + 1)  # a good one, never overwritten
    message = str(caught.value)
    failed_step = opt.steps_done
    assert failed_step >= 2  # the first step's gradients are finite: lr 1e6 blows the weights up after it
    assert f"optimizer step {failed_step} (counted from 1) is not finite in {dtype}" in message
    assert "learning rate" in message and "data" in message and "dtype" in message
    after = masters(model)
    assert all(bool(torch.isfinite(m).all()) for m in after)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the update was skipped
    # The run stays stopped: no further step, no save over the good checkpoint, no weights out.
    saved_step = read_meta(checkpoint)["step"]
    assert saved_step == failed_step - 1
    for call in (
        lambda: elixir_tune.save_checkpoint(checkpoint, model, opt, failed_step),
        lambda: model.state_dict(),
        lambda: model.forward_backward(micro_batches(steps[0])),
        lambda: opt.step(),
    ):
        with pytest.raises(elixir_tune.NonFiniteError, match=f"optimizer step {failed_step} "):
            call()
    assert read_meta(checkpoint)["step"] == saved_step


@pytest.mark.parametrize("loop", ["forward_backward", "plain"])
def test_one_nan_micro_batch_stops_the_run_at_its_step(loop):
    model, opt = set_up("fp32", lr=1e-3)
    with pytest.raises(elixir_tune.NonFiniteError, match="optimizer step 3 .*a micro-batch loss not finite"):
        for step, batch in enumerate(batches(5, MICRO * ACCUM, 8)):
            bad = step == 2
            before = masters(model)
            if loop == "forward_backward":
                model.forward_backward(micro_batches(batch, nan_micro_batch=bad))
            else:  # model(...) per micro-batch and optimizer.backward
                for micro in micro_batches(batch, nan_micro_batch=bad):
                    opt.backward(model(**micro).loss / ACCUM)
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(masters(model), before, strict=True))
    assert all(bool(torch.isfinite(m).all()) for m in before)


def test_fp16_skips_a_nan_micro_batch_and_lowers_its_loss_scale():
    model, opt = set_up("fp16", lr=1e-3)
    steps = batches(4, MICRO * ACCUM, 8)
    scales, skipped = [], []
    for step, batch in enumerate(steps):
        before = masters(model)
        model.forward_backward(micro_batches(batch, nan_micro_batch=step == 1))
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
        skipped.append(opt.skipped_steps)
        if step == 1:
            assert all(torch.equal(a, b) for a, b in zip(masters(model), before, strict=True))
    assert skipped == [0, 1, 1, 1]  # only the NaN step, and training goes on
    assert scales[1] == scales[0] / 2 and scales[2] == scales[1]
    assert all(bool(torch.isfinite(m).all()) for m in masters(model))
