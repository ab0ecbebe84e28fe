"""Context parallelism, Ulysses form: each rank of a context group computes 1/C of every sequence.

The ranks of a context group are fed the same micro-batches. A forward pre-hook on the user's
module keeps this rank's contiguous shard of the tokens (``input_ids``, ``token_type_ids``,
``inputs_embeds``) and of ``position_ids`` (made ``0..S-1`` when the batch has none, so rotary and
learned position embeddings see the global positions). Attention runs through an implementation
registered with transformers' ``AttentionInterface`` (the model's code is not changed): an
all-to-all turns "every head, 1/C of the tokens" into "1/C of the heads, every token"
(``engine/comm/context.py``), the model's own ``sdpa`` or ``eager`` function runs on the whole
sequence, and the reverse all-to-all brings the output back. The full padding mask travels to it
as a keyword argument, which transformers passes from the model's forward down to the attention
function (also when a checkpointed block recomputes). Modes ``allgather`` and ``ring`` give each
rank chunks i and 2C - 1 - i of 2C instead (``balanced_tokens``); ``ring`` computes attention itself
(``ring_attention.py``).

Loss: labels are shifted on the whole sequence before slicing, so the token at the end of one
shard predicts the first token of the next. A forward hook computes the shard's summed
cross-entropy and returns ``C x shard_sum / N`` (N: the micro-batch's counted tokens) as the
differentiable part: the engine averages gradients over data x context, so the gradient is exactly
plain PyTorch's token mean. The loss's value is the micro-batch's whole loss on every rank of the
group (one scalar all-reduce), so scripts log what they would without context parallelism. The
logits in the output are this rank's shard only.

Beside a pipeline (``pipeline_adapters.py``) the first stage's forward slices the tokens as above;
later stages run inside ``received()``: their ``inputs_embeds`` are this rank's hidden states already,
only the position ids and the padding mask (whole sequence) are sliced or passed down. The last stage
computes ``loss`` from its logits and the micro-batch's labels.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from elixir_tune.engine.comm import Comm, gather_objects
from elixir_tune.engine.comm.context import gather_sequence, heads_to_sequence, sequence_to_heads, sum_over
from elixir_tune.engine.contract import input_fingerprint
from elixir_tune.engine.parallel.ring_attention import RingSpec, ring_attention
from elixir_tune.errors import ContractError

ATTENTION_NAME = "elixir_context"  # the name registered with transformers' AttentionInterface
EXCHANGE_KWARG = "elixir_context_exchange"  # the keyword the model passes down to the attention function
IGNORE_INDEX = -100
_INNER = ("sdpa", "eager")  # the attention implementations that run between the exchanges
_SHARDED_INPUTS = ("input_ids", "inputs_embeds", "token_type_ids")


def balanced_tokens(length: int, size: int, rank: int) -> torch.Tensor:
    """The tokens of context rank ``rank`` under the load-balanced causal split: chunks ``rank`` and
    ``2C - 1 - rank`` of 2C, so every rank has as many early (cheap) as late (costly) queries."""
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class _Exchange:
    """One forward's attention exchange: the group, the mode, the inner implementation, the full
    padding mask and (all-gather mode) which tokens each rank holds."""

    def __init__(self, comm: Comm, mode: str, inner: str, padding: torch.Tensor | None, length: int):
        self.comm = comm
        self.mode = mode
        self.inner = inner
        self.padding = padding  # (batch, seq) 1 where a token is real, or None: no padding
        self.length = length
        # The forward's labels and this rank's tokens, for the loss hook (on the exchange, which the
        # forward hook receives, so a forward ended early by a pipeline stage leaves nothing behind).
        self.labels: torch.Tensor | None = None
        self.shard: slice | torch.Tensor = slice(None)

    def _mask(
        self, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype, window: int | None
    ) -> torch.Tensor | None:
        """The additive mask of queries at token positions ``queries`` over keys at ``keys``; None
        where sdpa's causal flag is exact (the whole sequence in order, no padding, no window).

        ``window``: a sliding-window layer's span (Gemma2, Mistral): key j is seen from query i when
        i - window < j <= i, as transformers' ``sliding_window_overlay`` says.
        """
        whole = self.mode == "ulysses"
        if whole and self.padding is None and self.inner == "sdpa" and window is None:
            return None
        allowed = keys[None, :] <= queries[:, None]
        if window is not None:
            allowed = allowed & (keys[None, :] > queries[:, None] - window)
        allowed = allowed[None, None]
        if self.padding is not None:
            allowed = allowed & self.padding.to(device=keys.device, dtype=torch.bool)[:, keys][:, None, None, :]
        # An additive mask, not a boolean one: a row with no allowed key (a padded query under left
        # padding) then attends uniformly instead of giving NaN; its label is -100 either way.
        return torch.zeros(allowed.shape, dtype=dtype, device=keys.device).masked_fill(~allowed, torch.finfo(dtype).min)

    def attend(self, module: torch.nn.Module, query, key, value, kwargs: dict) -> tuple[torch.Tensor, None]:
        window = kwargs.get("sliding_window")
        if self.mode == "ring":
            return ring_attention(self._ring_spec(query, kwargs, window), query, key, value), None
        inner = _inner_function(module, self.inner)
        size, device = self.comm.world_size, query.device
        if self.mode == "allgather":
            # Every rank's keys and values, whole; this rank's queries only (its two chunks).
            key, value = gather_sequence(self.comm, key), gather_sequence(self.comm, value)
            keys = torch.cat([balanced_tokens(self.length, size, r) for r in range(size)]).to(device)
            queries = balanced_tokens(self.length, size, self.comm.rank).to(device)
            output, _ = inner(module, query, key, value, self._mask(queries, keys, query.dtype, window), **kwargs)
            return output, None
        query, key, value = (sequence_to_heads(self.comm, states) for states in (query, key, value))
        positions = torch.arange(self.length, device=device)
        output, _ = inner(module, query, key, value, self._mask(positions, positions, query.dtype, window), **kwargs)
        return heads_to_sequence(self.comm, output), None

    def _ring_spec(self, query: torch.Tensor, kwargs: dict, window: int | None) -> RingSpec:
        """The layer's ring attention: its scaling, soft-capping and window from the model's keywords.

        Raises:
            ValueError: attention dropout while training, or attention sinks: ring attention computes
                the softmax itself and has neither (mode allgather or ulysses runs the model's own function).
        """
        if kwargs.get("dropout"):
            raise ValueError(
                f"parallel.context.mode ring runs attention without dropout, but the model's attention dropout is "
                f"{kwargs['dropout']}; set it to 0 in the model's config or use mode allgather"
            )
        if any(kwargs.get(key) is not None for key in ("s_aux", "sinks")):
            raise ValueError("parallel.context.mode ring does not run attention sinks; use mode allgather")
        scaling = kwargs.get("scaling")
        padding = None if self.padding is None else self.padding.to(device=query.device, dtype=torch.bool)
        return RingSpec(
            comm=self.comm,
            length=self.length,
            padding=padding,
            scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
            softcap=kwargs.get("softcap"),
            window=window,
        )


def _inner_function(module: torch.nn.Module, name: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        # Each family's eager function lives in its own modeling file (GPT-2's and Llama's differ).
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def context_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``ATTENTION_NAME`` (transformers' signature: states of
    shape (batch, heads, local_len, head_dim), output (batch, local_len, heads, head_dim)).

    Raises:
        RuntimeError: called outside a forward of a context-parallel model (no exchange passed down).
    """
    exchange = kwargs.pop(EXCHANGE_KWARG, None)
    if exchange is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME} runs only inside a context-parallel ElixirModel forward"
        )
    return exchange.attend(module, query, key, value, kwargs)


class ContextParallel:
    """The hooks that shard a causal LM's sequences over a context group (installed by ``install``).

    Attributes:
        comm: the context group (C ranks, shards in rank order).
        inner: the model's own attention implementation (``sdpa`` or ``eager``).
    """

    def __init__(self, module: torch.nn.Module, comm: Comm, mode: str = "ulysses"):
        from transformers import AttentionInterface

        config: Any = module.config
        self.inner: str = config._attn_implementation or "eager"
        if self.inner == ATTENTION_NAME:
            raise ValueError("the model is context-parallel already (setup was called twice on it)")
        if self.inner not in _INNER:
            raise ValueError(
                f"context parallelism runs attention implementations {', '.join(_INNER)}, not {self.inner!r}; "
                "load the model with attn_implementation='sdpa' or 'eager'"
            )
        self.comm = comm
        self.mode = mode
        self._received = threading.local()  # per thread: True inside a later pipeline stage's forward
        self._inputs_checked = False
        AttentionInterface.register(ATTENTION_NAME, context_attention)
        config._attn_implementation = ATTENTION_NAME
        module.register_forward_pre_hook(self._shard_inputs, with_kwargs=True)
        module.register_forward_hook(self._shard_loss, with_kwargs=True)

    @contextlib.contextmanager
    def received(self) -> Iterator[None]:
        """The forwards of a later pipeline stage (``pipeline_adapters.py``): ``inputs_embeds`` are the
        hidden states of this rank's tokens already (the first stage sliced them), the padding mask and
        position ids still cover the whole sequence."""
        self._received.active = True
        try:
            yield
        finally:
            self._received.active = False

    def _is_received(self) -> bool:
        return getattr(self._received, "active", False)

    def shard_of(self, length: int, device: torch.device) -> slice | torch.Tensor:
        """This rank's tokens of a sequence of ``length``: a contiguous 1/C (Ulysses) or chunks i and
        2C - 1 - i of 2C (modes allgather and ring).

        Raises:
            ValueError: the length is not a multiple of C (Ulysses) or 2C.
        """
        size, rank = self.comm.world_size, self.comm.rank
        balanced = self.mode in ("allgather", "ring")
        parts = 2 * size if balanced else size
        if length % parts:
            raise ValueError(
                f"sequence length {length} is not a multiple of {parts} (context degree {size}, mode {self.mode}): "
                "every rank of a context group takes an equal share; pad the batch to a multiple (labels -100, "
                "attention_mask 0)"
            )
        if balanced:
            return balanced_tokens(length, size, rank).to(device)
        return slice(rank * length // size, (rank + 1) * length // size)

    def _check_inputs_once(self, kwargs: dict) -> None:
        """At the first forward: the ranks of the group must hold the same batch (each keeps its own
        shard of it), which slicing the data by RANK instead of ``data_rank()`` breaks silently."""
        if self._inputs_checked:
            return
        self._inputs_checked = True
        if self._is_received():  # a later stage's hidden states differ by rank: the rest must not
            kwargs = {key: value for key, value in kwargs.items() if key not in _SHARDED_INPUTS}
        prints = gather_objects(self.comm, input_fingerprint([kwargs]), all_ranks=True)
        assert prints is not None  # all_ranks
        differ = [rank for rank, other in enumerate(prints) if other != prints[0]]
        if differ:
            raise ContractError(
                f"the ranks of a context group must be fed the same micro-batches (each computes its own share of "
                f"every sequence), but context ranks {differ} got other inputs than context rank 0 at the first "
                "forward. Take each rank's slice of the global batch with elixir_tune.data_rank() and "
                "elixir_tune.data_size(), not RANK and WORLD_SIZE"
            )

    def _shard_inputs(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        if args:  # input_ids given by position, as transformers' forwards allow
            kwargs["input_ids"], args = args[0], args[1:]
        self._check_inputs_once(kwargs)
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise ValueError("a context-parallel forward needs input_ids or inputs_embeds")
        batch, length = tokens.shape[:2]
        received = self._is_received()
        if received:  # this rank's share of the sequence already
            length *= self.comm.world_size
        shard = self.shard_of(length, tokens.device)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=tokens.device).expand(batch, length)
        elif bool((positions.diff(dim=-1) != 1).any()):
            # Packed rows (positions restarting inside a row): transformers masks across their
            # documents, the masks here are causal by token only; refused rather than wrong.
            raise ValueError(
                "context parallelism does not run packed sequences yet (position_ids that restart inside a row); "
                "pass one sequence per row, or set parallel.context.degree to 1"
            )
        kwargs["position_ids"] = positions[..., shard]
        for key in _SHARDED_INPUTS if not received else ():
            if isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = kwargs[key][:, shard]
        padding = kwargs.pop("attention_mask", None)
        if padding is not None and bool(padding.all()):
            padding = None  # no padding: sdpa's causal kernel, as transformers itself skips the mask
        exchange = _Exchange(self.comm, self.mode, self.inner, padding, length)
        exchange.labels, exchange.shard = kwargs.pop("labels", None), shard
        kwargs[EXCHANGE_KWARG] = exchange
        kwargs["use_cache"] = False  # a cache of one shard's keys could not serve generation
        return args, kwargs

    def _shard_loss(self, module, args: tuple, kwargs: dict, output: Any) -> Any:
        exchange = kwargs.get(EXCHANGE_KWARG)
        if exchange is None or exchange.labels is None:
            return output
        logits = output["logits"] if isinstance(output, dict) else output[0]
        loss = self.loss(logits, exchange.labels, exchange.shard)
        if isinstance(output, dict):
            return type(output)(**{**output, "loss": loss})
        return (loss, *output)

    def loss(
        self, logits: torch.Tensor, labels: torch.Tensor, shard: slice | torch.Tensor | None = None
    ) -> torch.Tensor:
        """The micro-batch's causal-LM loss from this rank's logits: its value is the whole sequence's
        token mean on every rank of the group; its gradient, averaged over data x context, plain PyTorch's.

        Args:
            logits: (batch, local_len, vocab), this rank's tokens.
            labels: (batch, length), the whole sequence's (not shifted).
            shard: this rank's tokens (None: ``shard_of(length)``).
        """
        if shard is None:
            shard = self.shard_of(labels.shape[1], logits.device)
        # Shifted on the whole sequence: a shard's last token predicts the next shard's first.
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)[:, shard].to(logits.device)
        shard_sum = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            shifted.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        counted = (labels[:, 1:] != IGNORE_INDEX).sum().to(logits.device)
        # Gradients are averaged over data x context: C x the shard's share makes them the token mean.
        share = shard_sum * self.comm.world_size / counted
        whole = sum_over(self.comm, shard_sum) / counted
        return share + (whole - share.detach())


def install(module: torch.nn.Module, comm: Comm, mode: str = "ulysses") -> ContextParallel:
    """Makes ``module`` (a transformers causal LM) run context-parallel over ``comm``.

    Args:
        module: the user's model, before the engine wraps it.
        comm: this rank's context group.
        mode: ``ulysses`` (all-to-all over heads), ``allgather`` (load-balanced causal split, every
            rank's keys and values gathered whole) or ``ring`` (the same split, keys and values passed
            around the group: ``ring_attention.py``).

    Returns:
        The installed hooks.

    Raises:
        ValueError: the model's attention implementation is neither sdpa nor eager.
    """
    return ContextParallel(module, comm, mode)
