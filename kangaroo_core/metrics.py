"""CR and CTAR: the one place they are computed (engine results, bench, replays, training evaluation).

A round is anything with ``accepted`` (drafts accepted), ``emitted`` (tokens it appended: accepted + 1, fewer at EOS
or the token budget) and ``drafted`` — :class:`kangaroo_core.results.RoundResult`.

* CR (compression rate, paper §4): tokens emitted per verification pass, ``Σ emitted / rounds``.
* CTAR(w) (consecutive top-w acceptance rate, paper Fig. 2): share of rounds whose first w drafts were all accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def compression_rate(rounds: Sequence[Any]) -> float | None:
    """Σ emitted / number of rounds; None without rounds."""
    return sum(r.emitted for r in rounds) / len(rounds) if rounds else None


def ctar(rounds: Sequence[Any], windows: int) -> list[float] | None:
    """[CTAR(1), ..., CTAR(windows)]; None without rounds."""
    n = len(rounds)
    return [sum(r.accepted >= w for r in rounds) / n for w in range(1, windows + 1)] if n else None


def mean_drafted(rounds: Sequence[Any]) -> float | None:
    return sum(r.drafted for r in rounds) / len(rounds) if rounds else None


def round_summary(rounds: Sequence[Any], windows: int) -> dict[str, Any]:
    """``rounds``, ``cr``, ``ctar``, ``drafts_per_round``, ``wasted_drafts_per_round`` (verified, rejected) and
    ``dropped_drafts_per_round`` (proposed, never verified) of a set of rounds."""
    n = len(rounds)
    return {"rounds": n, "cr": compression_rate(rounds), "ctar": ctar(rounds, windows),
            "drafts_per_round": mean_drafted(rounds),
            "wasted_drafts_per_round": sum(r.drafted - r.accepted for r in rounds) / n if n else None,
            "dropped_drafts_per_round": sum(r.dropped for r in rounds) / n if n else None}
