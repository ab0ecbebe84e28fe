"""Search: the plan shape (chunking, caching, offload, checkpointing, batching) that the cost model
predicts fastest, returned as a Plan.

    from elixir_tune.search import search
    result = search(profile, hardware, gpus_per_node=4)
    save_plan(result.plan, "plan.yaml")
"""

from elixir_tune.search.candidate import Candidate
from elixir_tune.search.driver import STRATEGIES, InfeasibleError, SearchResult, explain_winner, search
from elixir_tune.search.space import FIX_KEYS, parse_fixed

__all__ = [
    "Candidate",
    "FIX_KEYS",
    "InfeasibleError",
    "STRATEGIES",
    "SearchResult",
    "explain_winner",
    "parse_fixed",
    "search",
]
