"""The batch limit of a training run, from published scaling laws (an estimate, not a measurement).

Past the critical batch size a larger global batch buys few fewer optimizer steps: it costs more
tokens for the same loss instead (Kaplan et al. 2020, section 5; McCandlish et al. 2018). So the
fastest way to train on a token budget D is bounded by how far the batch may grow, whatever the
cluster. The limit here is the critical batch at the loss the run ends at:

* the loss from the model's non-embedding parameters N and the tokens D, Kaplan et al. 2020
  ("Scaling Laws for Neural Language Models", arXiv 2001.08361) equation 1.5 with the fit of
  their table 2: ``L(N, D) = ((N_c / N) ** (alpha_N / alpha_D) + D_c / D) ** alpha_D`` in nats
  per token;
* the critical batch at that loss, their equation 1.4 (section 5.1):
  ``B_crit(L) = B_star / L ** (1 / alpha_B)`` tokens.

The fits come from GPT-2-style models of up to 1.5B non-embedding parameters trained on WebText2
(BPE vocabulary of 50257, context 1024) for up to 23B tokens; a 175B model on trillions of tokens
is far outside that range. A critical batch is the batch at which the steps and the tokens to reach
a loss are both twice their minimum, not a hard wall. Treat the limit as an order of magnitude and
override it (``--batch-limit TOKENS``) when your own runs say otherwise. Newer work (Zhang et al.
2025, "How Does Critical Batch Size Scale in Pre-training?", ICLR 2025) finds the critical batch
grows mainly with the data size; it publishes no closed form this module could use, so Kaplan's
law is the default.

This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from elixir_tune.profiler.schema import ModelProfile

# Kaplan et al. 2020 (arXiv 2001.08361), table 2 "Fits to L(N, D)", used with their equation 1.5.
# N counts non-embedding parameters, D tokens; the loss is in nats per token.
KAPLAN_ALPHA_N = 0.076
KAPLAN_ALPHA_D = 0.103
KAPLAN_N_C = 6.4e13  # non-embedding parameters
KAPLAN_D_C = 1.8e13  # tokens
# Kaplan et al. 2020, equation 1.4 and section 5.1: B_crit(L) = B* / L^(1/alpha_B), B* ~ 2e8 tokens
# (their table 5 lists 2.1e8), alpha_B ~ 0.21.
KAPLAN_B_STAR_TOKENS = 2.0e8
KAPLAN_ALPHA_B = 0.21
# Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", arXiv 2203.15556): the
# compute-optimal model is trained on about 20 tokens per parameter (their table 3: 67B -> 1.5T,
# 175B -> 3.7T, 1T -> 21.2T tokens).
CHINCHILLA_TOKENS_PER_PARAM = 20.0
# Where Kaplan's fits were measured (section 2 and figure 1 of the paper): beyond these the law is
# extrapolated, which the limit's description says.
KAPLAN_FIT_MAX_PARAMS = 1.5e9
KAPLAN_FIT_MAX_TOKENS = 2.3e10


@dataclass(frozen=True)
class BatchLimit:
    """The largest useful global batch of a run, and where the figure comes from.

    Attributes:
        tokens: the limit in tokens per optimizer step.
        source: ``kaplan`` (the scaling law) or ``user`` (``--batch-limit``).
        loss_nats: the loss the law expects at the end of the run (None for a user limit).
        non_embedding_params: N of the law (None for a user limit).
        extrapolated: the model or the token count is beyond the range the law was fitted on.
    """

    tokens: float
    source: str
    loss_nats: float | None = None
    non_embedding_params: int | None = None
    extrapolated: bool = False

    def samples(self, seq_len: int) -> int:
        """The limit in samples of ``seq_len`` tokens (at least 1)."""
        return max(1, int(self.tokens // seq_len))

    def describe(self) -> str:
        """One line: the limit and how it was obtained."""
        if self.source == "user":
            return f"batch limit {self.tokens:,.0f} tokens (--batch-limit)"
        line = (
            f"batch limit {self.tokens:,.0f} tokens: Kaplan et al. 2020's critical batch at the loss "
            f"{self.loss_nats:.3f} nats/token that their L(N, D) predicts for {self.non_embedding_params:,} "
            "non-embedding parameters (an estimate"
        )
        if self.extrapolated:
            line += ", extrapolated far beyond the law's fitted range of <= 1.5B parameters and 23B tokens"
        return line + "; override with --batch-limit TOKENS)"


def kaplan_loss_nats(non_embedding_params: float, train_tokens: float) -> float:
    """The loss (nats per token) Kaplan et al. 2020's L(N, D) predicts after ``train_tokens``.

    Args:
        non_embedding_params: N, parameters outside the embeddings.
        train_tokens: D, tokens trained on.

    Returns:
        ``((N_c / N) ** (alpha_N / alpha_D) + D_c / D) ** alpha_D``.

    Raises:
        ValueError: a non-positive N or D.
    """
    if non_embedding_params <= 0 or train_tokens <= 0:
        raise ValueError("the scaling law needs a positive parameter count and token count")
    model_term = (KAPLAN_N_C / non_embedding_params) ** (KAPLAN_ALPHA_N / KAPLAN_ALPHA_D)
    return float((model_term + KAPLAN_D_C / train_tokens) ** KAPLAN_ALPHA_D)


def critical_batch_tokens(loss_nats: float) -> float:
    """Kaplan et al. 2020's critical batch size (tokens) at a loss: ``B* / L ** (1 / alpha_B)``.

    Raises:
        ValueError: a non-positive loss.
    """
    if loss_nats <= 0:
        raise ValueError("the critical batch needs a positive loss")
    return float(KAPLAN_B_STAR_TOKENS / loss_nats ** (1.0 / KAPLAN_ALPHA_B))


def non_embedding_params(profile: ModelProfile) -> int:
    """N of Kaplan's law: the parameters of the model's repeated blocks (its transformer layers).

    Embeddings, the final norm and an untied output head are left out, as Kaplan et al. count N;
    a profile without blocks falls back to every parameter.
    """
    inside = sum(
        profile.params[i].numel
        for block in profile.blocks
        for i in range(block.first_param, block.first_param + block.num_params)
    )
    return inside or profile.num_params


def batch_limit(profile: ModelProfile, train_tokens: float, override_tokens: float | None = None) -> BatchLimit:
    """The run's batch limit: ``override_tokens`` when given, else Kaplan's critical batch at the final loss.

    Args:
        profile: the model.
        train_tokens: tokens the run trains on.
        override_tokens: the user's limit (``--batch-limit``), in tokens.

    Returns:
        The limit.

    Raises:
        ValueError: a non-positive token count or override.
    """
    if override_tokens is not None:
        if override_tokens <= 0:
            raise ValueError(f"--batch-limit {override_tokens:g}: expected a positive number of tokens")
        return BatchLimit(tokens=float(override_tokens), source="user")
    n = non_embedding_params(profile)
    loss = kaplan_loss_nats(n, train_tokens)
    return BatchLimit(
        tokens=critical_batch_tokens(loss),
        source="kaplan",
        loss_nats=loss,
        non_embedding_params=n,
        extrapolated=n > KAPLAN_FIT_MAX_PARAMS or train_tokens > KAPLAN_FIT_MAX_TOKENS,
    )


def compute_optimal_tokens(num_params: float) -> float:
    """Chinchilla's compute-optimal token count: 20 tokens per parameter (Hoffmann et al. 2022)."""
    return CHINCHILLA_TOKENS_PER_PARAM * num_params
