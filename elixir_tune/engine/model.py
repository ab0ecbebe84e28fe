"""The model wrapper that ``setup`` returns: the user's module, driven by the engine."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import torch

from elixir_tune.engine.contract import batch_shape_note, check_shared_inputs
from elixir_tune.engine.engine import Engine
from elixir_tune.engine.layered import MicroBatchThreads, run_layer_major
from elixir_tune.engine.module_view import stand_in_for_module
from elixir_tune.engine.ownership import check_conversion
from elixir_tune.engine.parallel.pipeline_stages import pipeline_call_message
from elixir_tune.engine.parallel.tensor_parallel import plain
from elixir_tune.engine.token_weights import is_causal_lm, token_weights, wants_token_weights
from elixir_tune.engine.uneven import STATE

LossFn = Callable[[Any, dict], torch.Tensor]

T_destination = TypeVar("T_destination", bound=dict[str, Any])


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output itself when it is a scalar tensor, its ``loss``
    (Hugging Face), or the one scalar tensor of a tuple (``(logits, loss)``, as nanoGPT returns).

    Raises:
        AttributeError: no loss can be told apart; says to pass ``loss_fn``.
    """
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)):
        scalars = [item for item in output if isinstance(item, torch.Tensor) and item.dim() == 0]
        if len(scalars) == 1:
            return scalars[0]
    raise AttributeError(
        f"the model's output ({type(output).__name__}) has no loss that forward_backward can tell apart (a scalar "
        "tensor, an output with .loss, or a tuple with one scalar tensor): pass labels in the batch or "
        "forward_backward(..., loss_fn=lambda output, batch: ...)"
    )


def check_micro_batches(micro_batches: Sequence[Any]) -> None:
    """Raises ValueError unless ``micro_batches`` is a non-empty list of keyword-argument dicts."""
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    for index, batch in enumerate(micro_batches):
        if not isinstance(batch, dict):
            raise ValueError(
                f"micro-batch {index} is a {type(batch).__name__}; forward_backward takes a list of dicts of "
                "the model's keyword arguments (e.g. input_ids, labels)"
            )


# The inputs whose first dimension is the batch, in every transformers causal LM.
_BATCH_INPUTS = ("input_ids", "inputs_embeds", "labels", "attention_mask")


def check_not_empty(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Raises ValueError for a batch of 0 samples (a loader's short last batch split over ranks), which
    would otherwise fail deep in the model's attention reshape."""
    named = [(f"argument {i}", value) for i, value in enumerate(args[:1])]
    named += [(key, kwargs[key]) for key in _BATCH_INPUTS if key in kwargs]
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 0:
            raise ValueError(
                f"a batch of 0 samples ({name} has shape {tuple(value.shape)}); skip empty batches, or give "
                "the DataLoader drop_last=True so that its last batch is never empty on a rank"
            )


def forward_keywords(module: torch.nn.Module) -> frozenset[str]:
    """The keyword names ``module.forward`` takes; empty when it takes ``**kwargs`` (every key goes)."""
    parameters = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset()
    return frozenset(p.name for p in parameters)


def keep_keywords(batch: dict, keys: frozenset[str]) -> dict:
    """The entries of ``batch`` that ``forward_keywords`` named (all of them when it named none)."""
    return batch if not keys else {key: value for key, value in batch.items() if key in keys}


def with_prefix(state: dict[str, Any], prefix: str, destination: dict[str, Any] | None) -> dict[str, Any]:
    """``state`` under nn.Module.state_dict's conventions: names prefixed, put into ``destination``."""
    if prefix:
        state = {prefix + name: value for name, value in state.items()}
    if destination is None:
        return state
    destination.update(state)
    return destination


class ElixirModel(torch.nn.Module):
    """Wraps the user's module; call it exactly like the module.

    Attributes:
        module: the user's module (its chunked parameters hold data only while in use).
        engine: the Engine (chunks, cache, hooks).
    """

    def __init__(self, module: torch.nn.Module, engine: Engine):
        super().__init__()
        self.module = module
        object.__setattr__(self, "engine", engine)  # not a submodule: keep it out of modules()
        self._micro_batch_threads = MicroBatchThreads()  # layered accumulation's, kept across steps
        self._inputs_checked = False  # the data contract, compared once over the ranks (engine/contract.py)
        self._forward_keys: frozenset[str] | None = None  # what the module's forward takes (empty: **kwargs)
        stand_in_for_module(module, self)
        # The module's signature on our forward: Trainer keeps the data columns that the model's forward
        # names, and would drop every one for (*args, **kwargs).
        self.forward = functools.update_wrapper(functools.partial(type(self).forward, self), module.forward)  # type: ignore[method-assign]

    def _apply(self, fn, recurse=True):
        # model.half(), .to(...), .cuda() reach here: a no-op conversion passes, any other is refused.
        check_conversion(fn, self.engine.compute_dtype, self.engine.device, self.engine.plan.training.dtype)
        return self

    def _check_inputs_once(self, micro_batches: Sequence[Any]) -> None:
        if not self._inputs_checked:
            self._inputs_checked = True
            check_shared_inputs(self.engine.mesh, micro_batches)
            training = self.engine.plan.training
            note = batch_shape_note(micro_batches, training.micro_batch_size, training.seq_len)
            # A context group splits each sequence: its ranks' shapes are not the plan's by design.
            if note and self.engine.mesh.world.rank == 0 and self.engine.plan.parallel.context.degree == 1:
                warnings.warn(note, stacklevel=3)

    def forward(self, *args, **kwargs):
        if self.engine.pipeline is not None:
            raise RuntimeError(pipeline_call_message(self.engine.plan.parallel.pipeline.stages))
        with self.engine.passes.through_wrapper():
            self.engine.begin_forward()  # first: a rank that runs it alone must not meet a collective before
            self._check_inputs_once([dict(kwargs, **{f"arg{i}": a for i, a in enumerate(args)})])
            check_not_empty(args, kwargs)  # after the first step's contract check, which every rank meets
            # A vocabulary-parallel loss (tensor parallelism) runs inside loss_context; the first step's
            # forward runs under the engine's read check.
            with self.engine.loss_context(), self.engine.read_check():
                return self.module(*args, **kwargs)

    def forward_backward(
        self,
        micro_batches: Sequence[dict],
        loss_fn: LossFn | None = None,
        *,
        weight_by_tokens: bool | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of one step, as the plan's accumulation says.

        ``training.accumulation: standard`` runs the micro-batches one after the other; ``layered``
        runs each block for all of them before the next (engine/layered.py), in forward and in
        backward. Either way the gradients of the step's loss are accumulated and reduced into the
        shards afterwards, ready for ``optimizer.clip_grad_norm`` and ``optimizer.step``. On a
        pipeline plan (``parallel.pipeline.stages`` > 1) the plan's pipeline schedule runs them
        through the stages (engine/parallel/pipeline.py): every rank passes the micro-batches of its data
        index (``input_ids`` of one batch size, an optional ``attention_mask``, and ``labels``;
        lengths may differ) and gets the step's loss; ``loss_fn`` then sees an output with ``logits``
        (at the micro-batch's length) and ``loss``.

        The step's loss is token-weighted (engine/token_weights.py) when the micro-batches carry
        ``labels`` and the loss is the model's own: the mean over every counted token (labels after the
        first position that are not -100) of all micro-batches of all data ranks, whatever each
        micro-batch's count; with ``loss_fn`` the plain mean of the micro-batch losses, unless
        ``weight_by_tokens=True`` says ``loss_fn`` returns the mean over those tokens too.

        Args:
            micro_batches: one dict of keyword arguments of the model per micro-batch.
            loss_fn: ``loss_fn(output, batch)`` gives a micro-batch's loss; None takes ``output.loss``.
            weight_by_tokens: weigh each micro-batch's loss by its counted tokens (a collective over
                the data group); None: for a causal LM when ``loss_fn`` is None and every micro-batch
                has labels.

        Returns:
            This rank's share of the step's loss (detached, 0-dim): the mean over the data ranks of
            what each returns is the step's loss (token-weighted: the loss over all counted tokens;
            otherwise the mean of the micro-batch losses, which is what each rank returns).

        Raises:
            ValueError: no micro-batches, a micro-batch is not a dict, or ``weight_by_tokens=True``
                with a micro-batch without token labels.
            ContractError: at the first step, ranks of one data index (a tensor or pipeline group) were
                fed different micro-batches (engine/contract.py).
            NonFiniteError: an fp32/bf16 step was not finite (engine/finite.py); the run has stopped.
            AttributeError: no ``loss_fn`` and the output has no ``loss``.
        """
        check_micro_batches(micro_batches)
        if self.engine.finite_guard is not None and self.engine.finite_guard.failed is not None:
            raise self.engine.finite_guard.failed  # known already: the run stopped at that step
        self._check_inputs_once(micro_batches)
        for batch in micro_batches:  # after the first step's contract check, which every rank meets
            check_not_empty((), batch)
        causal = is_causal_lm(self.module)
        weighted = wants_token_weights(micro_batches, weight_by_tokens, loss_fn is not None, causal)
        weights = token_weights(micro_batches, self.engine.comm, shift=causal) if weighted else None
        if self.engine.pipeline is not None:
            return self.engine.pipeline.forward_backward(micro_batches, loss_fn, weights)
        count = len(micro_batches)
        loss_scale = self.engine.loss_scale()
        # Without weights (or all of them 1/K) the scale is the one the plain mean always used: bitwise unchanged.
        scales = [loss_scale / count] * count if weights is None else [loss_scale * weight for weight in weights]

        def scaled_loss(index: int) -> torch.Tensor:
            batch = micro_batches[index]
            output = self.module(**self._model_inputs(batch))
            if loss_fn is not None:
                return loss_fn(output, batch) * scales[index]
            return loss_of(output) * scales[index]

        layered = self.engine.plan.training.accumulation == "layered" and count > 1 and torch.is_grad_enabled()
        with self.engine.loss_context(), self.engine.scaled_backward():
            losses = self._run(scaled_loss, count, layered)
        for loss in losses:
            self.engine.note_loss(loss)
        summed = torch.stack([plain(loss.detach()) for loss in losses]).sum()
        return summed / (scales[0] * count) if weights is None else summed / loss_scale

    def _model_inputs(self, batch: dict) -> dict:
        """The micro-batch's keys the module's forward takes (all of them when it takes ``**kwargs``):
        a model whose forward takes no ``labels`` still gets them to ``loss_fn`` through the batch."""
        if self._forward_keys is None:
            self._forward_keys = forward_keywords(self.module)
        return keep_keywords(batch, self._forward_keys)

    def token_weights(self, micro_batches: Sequence[dict]) -> list[float]:
        """What each micro-batch's mean loss is multiplied by in a plain loop (``model(**batch)`` and
        ``optimizer.backward(loss * weight)``) for the token-weighted step ``forward_backward`` takes:
        ``n_k * D / N`` (engine/token_weights.py), 1/K each when the counts are all alike. A collective
        over the data group: every rank calls it with its micro-batches.

        Args:
            micro_batches: this rank's micro-batches of the step, each with ``labels`` (-100: no loss).

        Returns:
            One weight per micro-batch.

        Raises:
            ValueError: a micro-batch without labels of shape (batch, length).
        """
        wants_token_weights(micro_batches, True, False)
        weights = token_weights(micro_batches, self.engine.comm, shift=is_causal_lm(self.module))
        return weights if weights is not None else [1 / len(micro_batches)] * len(micro_batches)

    def _run(self, scaled_loss: Callable[[int], torch.Tensor], count: int, layered: bool) -> list[torch.Tensor]:
        """Forward and backward of ``count`` micro-batches; their scaled losses."""
        with self.engine.passes.through_wrapper():
            return self._run_through_wrapper(scaled_loss, count, layered)

    def _run_through_wrapper(
        self, scaled_loss: Callable[[int], torch.Tensor], count: int, layered: bool
    ) -> list[torch.Tensor]:
        if layered:
            self.engine.begin_forward()
            losses = run_layer_major(scaled_loss, count, self.engine.set_baton, self._micro_batch_threads)
            torch.autograd.backward(losses)
        else:
            losses = []
            for index in range(count):
                self.engine.begin_forward()
                with self.engine.read_check():
                    loss = scaled_loss(index)
                loss.backward()
                losses.append(loss.detach())
        return losses

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)  # e.g. model.config

    # The same call forms as nn.Module.state_dict (so the override is type-correct), plus ``all_ranks``.
    @overload
    def state_dict(
        self, *, destination: T_destination, prefix: str = ..., keep_vars: bool = ..., all_ranks: bool = ...
    ) -> T_destination: ...

    @overload
    def state_dict(
        self, *, prefix: str = ..., keep_vars: bool = ..., all_ranks: bool = ...
    ) -> dict[str, torch.Tensor]: ...

    def state_dict(
        self,
        *args: Any,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        all_ranks: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Full fp32 weights with the original names, frozen parameters and buffers included (on the CPU).

        A collective: every rank calls it, or rank 0 alone where the other ranks are about to run a
        forward (they serve its gathers, engine/uneven.py). Rank 0 gets the full dictionary and the
        other ranks an empty one, unless ``all_ranks`` (then every rank holds the whole model at
        once). ``keep_vars`` is accepted for nn.Module compatibility and ignored (the values are
        gathered copies).

        Args:
            destination: a dictionary to put the weights in and return (default: a new one), as
                nn.Module.state_dict does when an enclosing module collects its children's.
            prefix: prepended to every name (nn.Module's convention for an enclosing module).
            all_ranks: every rank gets the full dictionary, not only rank 0.

        Returns:
            The weights by name (empty on ranks other than 0 unless ``all_ranks``).
        """
        self.check_finite()
        if self.engine.agreement is not None:  # rank 0 alone may ask, as DDP scripts do (uneven.py)
            self.engine.agreement.enter(STATE, all_ranks)
        state = (self.engine.pipeline or self.engine).full_state_dict(all_ranks=all_ranks)
        return with_prefix(state, prefix, destination)

    def check_finite(self) -> None:
        """Raises ``NonFiniteError`` if a step of this fp32/bf16 run was not finite (engine/finite.py):
        on a GPU the last step's check is read here, before its weights are written anywhere."""
        if self.engine.finite_guard is not None:
            self.engine.finite_guard.check()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads full weights (original names, as ``state_dict`` returns) into the shards.

        As torch's: ``strict`` refuses missing and unexpected keys, a wrong shape names its key, and the
        missing and unexpected keys are returned. Every rank calls it with the same dictionary.
        """
        # A pipeline stage holds part of the model: the other stages' keys are theirs, not unexpected.
        whole = self.engine.pipeline is None
        missing, unexpected = self.engine.load_full_state_dict(state_dict, strict and whole)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected if whole else [])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's context for accumulation steps, accepted as is: the engine reduces each backward's
        gradients into the shards as it ends (that frees them), and the step's gradient is the same sum."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, as the optimizer's ``zero_grad`` does (they live in the shards)."""
        if self.engine.optimizer is not None:
            self.engine.optimizer.zero_grad(set_to_none)
        else:
            self.engine.zero_grad(set_to_none)

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes of this rank (keys ``elixir_tune.plan.MODEL_STATE_KEYS``)."""
        return self.engine.memory_report()
