"""PyTorch habits on what ``setup`` returns, in one process (a world of one on the CPU): each works as
on the plain model, or is refused at once with what to do instead (docs/guides/own-script.md).

The multi-process habits (rank 0 alone evaluating and saving, ports of whole DDP loops) are in
tests/dropin/.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import elixir_tune
import elixir_tune.engine.ownership
from elixir_tune.engine.grad_view import GradientInShardsError
from tests.distributed.engine_plans import batches, make_plan, tiny_gpt2

LR = 1e-2


def _setup(model: nn.Module, optimizer: torch.optim.Optimizer, cache="all", **plan_options):
    plan = make_plan(model, 1, 4096, cache=cache, **plan_options)
    return elixir_tune.setup(model, optimizer, plan=plan)


def _gpt2_pair():
    """The same tiny GPT-2 twice: one to set up, one plain reference; and a batch."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    reference = tiny_gpt2()
    reference.load_state_dict(model.state_dict())
    return model, reference, batches(1, 4, 16)[0]


def _train(model, optimizer, batch, steps, clip=None, zero_grad=None, scheduler=None):
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        if clip is not None:
            clip(model)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        (zero_grad or optimizer.zero_grad)()
        losses.append(loss.item())
    return losses


def test_torch_clip_grad_norm_and_model_zero_grad_act_on_the_shards():
    model, reference, batch = _gpt2_pair()
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=1e-6)
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6), cache="min")
    norms, expected_norms = [], []

    def clip(into):
        def run(m):
            into.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))

        return run

    found = _train(model, optimizer, batch, 4, clip(norms), zero_grad=model.zero_grad)
    expected = _train(reference, plain_opt, batch, 4, clip(expected_norms), zero_grad=reference.zero_grad)
    assert found == pytest.approx(expected, rel=1e-6)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    assert norms[0] > 0.05  # the clip did act


def test_a_scheduler_built_before_setup_drives_the_optimizer_that_steps():
    model, reference, batch = _gpt2_pair()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 3))  # lr 0 at first
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=1e-6)
    plain_scheduler = torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda step: min(1.0, step / 3))
    model, sharded = _setup(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = _train(model, sharded, batch, 5, scheduler=scheduler)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]  # its order check sees the steps
    expected = _train(reference, plain_opt, batch, 5, scheduler=plain_scheduler)
    assert found == pytest.approx(expected, rel=1e-6)
    assert found[-1] != found[1]  # the lr left 0: the loss moved
    assert sharded.param_groups is optimizer.param_groups


def test_the_users_optimizer_object_steps_the_shards_too():
    model, reference, batch = _gpt2_pair()
    users = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, _ = _setup(model, users, cache="min")
    found = _train(model, users, batch, 3)  # the script kept the name of the optimizer it built
    expected = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batch, 3)
    assert found == pytest.approx(expected, rel=1e-6)


def test_p_grad_is_a_placeholder_that_refuses_computation_until_zero_grad():
    model, _, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    model(**batch).loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    with pytest.raises(GradientInShardsError, match="clip_grad_norm_"):
        sum(p.grad.norm() for p in params)  # gradient logging
    with pytest.raises(ValueError, match=f"got 2 of the model's {len(params)} trainable parameters"):
        torch.nn.utils.clip_grad_norm_(params[:2], 1.0)
    assert float(optimizer.grad_norm()) > 0
    model.module.zero_grad()  # DDP scripts' raw_model
    assert all(p.grad is None for p in params)
    assert float(optimizer.grad_norm()) == 0.0
    model(**batch).loss.backward()
    optimizer.zero_grad(set_to_none=False)  # torch: zero tensors; here placeholders that refuse use
    assert all(p.grad is not None for p in params) and float(optimizer.grad_norm()) == 0.0
    with pytest.raises(GradientInShardsError):
        params[0].grad.add_(1.0)
    model(**batch).loss.backward()  # the next forward hides them: backward accumulates as usual
    assert float(optimizer.grad_norm()) > 0


def test_a_clip_function_imported_before_setup_is_refused_not_silent():
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_, _get_total_norm  # torch's own, unpatched

    model, _, batch = _gpt2_pair()
    model, _ = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    model(**batch).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with pytest.raises(GradientInShardsError):
        norm = _get_total_norm(grads, 2.0)  # torchtitan's clip: the norm of p.grad, then a scaling
        _clip_grads_with_norm_(list(model.parameters()), 1.0, norm)


def test_clip_grad_value_clamps_every_shard():
    model, reference, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    plain_opt = torch.optim.SGD(reference.parameters(), lr=1.0)

    def clip(m):
        torch.nn.utils.clip_grad_value_(m.parameters(), 1e-4)

    found = _train(model, optimizer, batch, 2, clip)
    expected = _train(reference, plain_opt, batch, 2, clip)
    assert found == pytest.approx(expected, rel=1e-6)


class _BareLoss(nn.Module):
    """Returns the loss itself; its forward takes no labels, so loss_fn must reach them."""

    def __init__(self, width=8):
        super().__init__()
        self.body = nn.Linear(width, width)

    def forward(self, x):
        return self.body(x)


def test_forward_backward_takes_bare_losses_tuples_and_models_without_labels():
    torch.manual_seed(0)
    model = _BareLoss()
    model, _ = _setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    batch = {"x": x, "labels": x.flip(0)}
    loss = model.forward_backward([batch], loss_fn=lambda out, b: (out - b["labels"]).pow(2).mean())
    expected = (model.module.body(x) - x.flip(0)).pow(2).mean()
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    from elixir_tune.engine.model import loss_of

    scalar = torch.tensor(2.0)
    assert loss_of(scalar) is scalar
    assert loss_of((torch.ones(3), scalar)) is scalar  # nanoGPT's (logits, loss)
    with pytest.raises(AttributeError, match="loss_fn"):
        loss_of((torch.ones(3), torch.ones(3)))


def test_state_dicts_hold_gathered_weights_and_save_pretrained_writes_them(tmp_path):
    model, reference, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6), cache="min")
    _train(model, optimizer, batch, 2)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, eps=1e-6), batch, 2)
    inner = model.module.state_dict()  # a released chunk's parameters hold NaN placeholders
    assert inner.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(inner[name], value, rtol=0, atol=1e-5, msg=name)
    assert any(torch.isnan(v).any() for v in model.module.state_dict(keep_vars=True).values())  # released ones
    # save_pretrained writes the gathered weights (Trainer's save_model calls it), for model and model.module.
    from transformers import GPT2LMHeadModel

    for saver, out in ((model.module.save_pretrained, tmp_path / "inner"), (model.save_pretrained, tmp_path / "outer")):
        saver(out)
        loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=1e-5, msg=name)


def test_an_fp16_plan_refuses_an_unscaled_backward_before_the_step():
    model, _, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR), dtype="fp16")
    before = [chunk.master.clone() for chunk in model.engine.chunks]
    model(**batch).loss.backward()  # DDP's habit; torch's GradScaler would not scale the shards either
    with pytest.raises(RuntimeError, match=r"call optimizer.backward\(loss\) instead"):
        optimizer.step()
    assert all(torch.equal(a, chunk.master) for a, chunk in zip(before, model.engine.chunks, strict=True))


def test_a_scalar_parameter_gets_a_placeholder_too():
    from elixir_tune.engine.grad_view import ShardedGrad

    temperature = nn.Parameter(torch.tensor(2.0))
    temperature.grad = ShardedGrad(temperature)
    assert temperature.grad.shape == ()
    with pytest.raises(GradientInShardsError):
        temperature.grad.abs()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_torch_form_optimizer_state_resumes_exactly_loaded_before_or_after_setup(when):
    """A DDP run's ``optimizer.state_dict()`` (whole parameters, torch's form) resumes under the engine:
    loaded into the optimizer before setup (nanoGPT's order) or into it after."""
    import copy

    model, reference, batch = _gpt2_pair()
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=1e-6)
    _train(reference, plain_opt, batch, 2)
    saved_weights, saved_state = copy.deepcopy(reference.state_dict()), copy.deepcopy(plain_opt.state_dict())
    expected = _train(reference, plain_opt, batch, 2)
    model.load_state_dict(saved_weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    if when == "before":
        optimizer.load_state_dict(saved_state)
    model, optimizer = _setup(model, optimizer, cache="min")
    if when == "after":
        optimizer.load_state_dict(saved_state)
    found = _train(model, optimizer, batch, 2)
    assert found == pytest.approx(expected, rel=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=1e-6, msg=name)


def test_another_ranks_optimizer_shard_is_refused():
    from elixir_tune.engine.optimizer_state import OptimizerStateError

    model, _, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(model, optimizer, batch, 1)
    state = optimizer.shard_state_dict()
    optimizer.load_state_dict(state)  # its own shard: taken
    state["shard_of"] = dict(state["shard_of"], rank=1, world_size=2)
    with pytest.raises(OptimizerStateError, match=r"one rank's shard of another place: rank 1 \(here 0\)"):
        optimizer.load_state_dict(state)


# --- objects beside the engine that would train it wrongly (engine/ownership.py) --------------------


def test_an_optimizer_over_another_model_is_refused_at_setup():
    model, other, _ = _gpt2_pair()
    with pytest.raises(elixir_tune.engine.ownership.OwnershipError, match="holds .* parameters outside the model"):
        _setup(model, torch.optim.AdamW(other.parameters(), lr=LR))


def test_a_second_optimizer_over_sharded_parameters_is_refused_at_its_first_step():
    model, _, batch = _gpt2_pair()
    embeddings = model.transformer.wte.weight
    second = torch.optim.SGD([embeddings], lr=LR)
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR), cache="min")
    model(**batch).loss.backward()
    optimizer.step()  # the optimizer given to setup steps as ever
    with pytest.raises(elixir_tune.engine.ownership.OwnershipError, match="a second optimizer .SGD. steps 1 param"):
        second.step()
    # An optimizer over tensors the engine does not own is no concern of it.
    free = nn.Parameter(torch.ones(3))
    free.grad = torch.ones(3)
    torch.optim.SGD([free], lr=1.0).step()
    assert torch.equal(free.detach(), torch.zeros(3))


def test_a_module_added_after_setup_is_refused_at_the_next_forward():
    model, _, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR), cache="min")
    model(**batch).loss.backward()
    optimizer.step()
    model.module.extra = nn.Linear(4, 4)
    with pytest.raises(elixir_tune.engine.ownership.OwnershipError, match=r"never saw \(extra.weight, extra.bias\)"):
        model(**batch)


def test_load_state_dict_on_the_model_and_on_model_module_works_like_torch():
    model, reference, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR), cache="min")
    _train(model, optimizer, batch, 2)
    trained = model.state_dict()
    model.module.load_state_dict(reference.state_dict())  # back to the start, through the inner module
    assert all(torch.equal(value, reference.state_dict()[name]) for name, value in model.state_dict().items())
    wrong = dict(trained, **{"transformer.wpe.weight": torch.zeros(3, 3)})
    with pytest.raises(
        RuntimeError, match=r"size mismatch for transformer.wpe.weight: copying a param with shape \[3, 3\]"
    ):
        model.load_state_dict(wrong)
    # Nothing was written by the refused call; a missing key is refused as torch refuses it.
    assert all(torch.equal(value, reference.state_dict()[name]) for name, value in model.state_dict().items())
    with pytest.raises(RuntimeError, match="Missing key\\(s\\): 'transformer.ln_f.bias'"):
        model.load_state_dict({k: v for k, v in trained.items() if k != "transformer.ln_f.bias"})
    result = model.load_state_dict(dict(trained, extra=torch.ones(1)), strict=False)
    assert result.unexpected_keys == ["extra"] and result.missing_keys == []
    assert all(torch.equal(value, trained[name]) for name, value in model.state_dict().items())


def test_no_sync_accumulation_trains_as_without_it():
    model, reference, batch = _gpt2_pair()
    plain_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model, optimizer = _setup(model, torch.optim.SGD(model.parameters(), lr=LR), cache="min")
    for wrapped, opt in ((model, optimizer), (reference, plain_opt)):
        with model.no_sync() if wrapped is model else contextlib.nullcontext():
            (wrapped(**batch).loss / 2).backward()
        (wrapped(**batch).loss / 2).backward()
        opt.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=1e-6)


def test_a_model_compiled_before_setup_trains_as_the_plain_one():
    model, reference, batch = _gpt2_pair()
    plain_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="torch.compile'd model"):
        plan = make_plan(model, 1, 4096, cache="min")  # the profile of the model, as `elixir-tune profile` makes it
        wrapped, optimizer = elixir_tune.setup(compiled, torch.optim.SGD(model.parameters(), lr=LR), plan=plan)
    assert _train(wrapped, optimizer, batch, 2) == pytest.approx(_train(reference, plain_opt, batch, 2), rel=1e-6)


def test_a_conversion_to_what_the_model_is_passes_and_any_other_is_refused():
    model, reference, batch = _gpt2_pair()
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert model.to("cpu") is model and model.float() is model and model.to(torch.float32) is model
    Ownership = elixir_tune.engine.ownership.OwnershipError
    with pytest.raises(Ownership, match=r"a torch.float16 conversion .* search with `--fix dtype=bf16`"):
        model.half()
    with pytest.raises(Ownership, match="a torch.float64 conversion"):
        model.to(torch.float64)
    if not torch.cuda.is_available():
        with pytest.raises(Ownership, match="the plan places the model on cpu"):
            model.cuda()
    # Nothing was converted: the run trains as the plain model.
    assert _train(model, optimizer, batch, 3) == pytest.approx(_train(reference, plain_opt, batch, 3), abs=1e-6)


def test_a_batch_of_zero_samples_is_refused_by_name():
    model, _, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    empty = {key: value[:0] for key, value in batch.items()}
    with pytest.raises(ValueError, match=r"a batch of 0 samples \(input_ids has shape \(0, 16\)\).*drop_last=True"):
        model(**empty)
    with pytest.raises(ValueError, match="a batch of 0 samples"):
        model.forward_backward([batch, empty])
    model(**batch).loss.backward()  # the run goes on with the next batch
    optimizer.step()


# fill_ and nn.init's constants write to the released parameter's placeholder without a word (a copy_ or
# normal_ there fails at once in torch: the placeholder expands one element).
@pytest.mark.parametrize("write", ["fill_", "init"])
def test_a_write_to_a_parameter_outside_a_forward_is_refused_at_the_next_forward(write):
    model, _, batch = _gpt2_pair()
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    model(**batch).loss.backward()
    optimizer.step()
    weight = model.module.transformer.h[0].mlp.c_fc.weight
    with torch.no_grad():
        weight.fill_(0) if write == "fill_" else nn.init.zeros_(weight)
    with pytest.raises(
        elixir_tune.engine.ownership.OwnershipError,
        match=r"transformer.h.0.mlp.c_fc.weight written in place after elixir_tune.setup .*load_state_dict",
    ):
        model(**batch)


def test_a_first_batch_of_another_shape_than_the_plans_gets_a_note():
    model, reference, batch = _gpt2_pair()  # 4 x 16 tokens; _setup's plan says 2 x 8
    model, optimizer = _setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    with pytest.warns(UserWarning, match=r"micro-batch is 4 x 16 tokens, the plan's 2 x 8.*--fix micro_batch_size=4"):
        model(**batch).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next steps say nothing
        model(**batch).loss.backward()
