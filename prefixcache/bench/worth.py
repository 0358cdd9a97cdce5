"""The "worth enabling" calculus, now in :mod:`prefixcache.cache.worth` (the server's dashboard applies it
live, and the server may not import the benchmarks); re-exported here for the benchmarks."""

from prefixcache.cache.worth import (
    INCONCLUSIVE,
    MARGINAL,
    MIN_CONFIRMING_REPEATS,
    NOT_WORTH,
    NOT_WORTH_MAX_SAVED_S_PER_S,
    NOISY_SPREAD,
    SLOWER_TOLERANCE,
    WORTH,
    WORTH_MIN_SAVED_S_PER_S,
    WORTH_MIN_SAVED_S_PER_S_PER_GIB,
    WorthEstimate,
    WorthInputs,
    estimate_worth,
)

__all__ = [
    "INCONCLUSIVE",
    "MARGINAL",
    "MIN_CONFIRMING_REPEATS",
    "NOT_WORTH",
    "NOT_WORTH_MAX_SAVED_S_PER_S",
    "NOISY_SPREAD",
    "SLOWER_TOLERANCE",
    "WORTH",
    "WORTH_MIN_SAVED_S_PER_S",
    "WORTH_MIN_SAVED_S_PER_S_PER_GIB",
    "WorthEstimate",
    "WorthInputs",
    "estimate_worth",
]
