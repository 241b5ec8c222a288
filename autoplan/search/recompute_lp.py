"""The recompute memory forces, as the search's bounds price it (:mod:`autoplan.search.bounds`).

Each recompute option saves some activation bytes of a block per micro-batch in flight and
adds some seconds; the lower convex hull of those (bytes saved, seconds added) points
(:func:`lower_hull`, :func:`hull_at`) is the least a fractional mix of the options costs for
what it saves.  :func:`recompute_lp` spreads the bytes each pipeline rank must save over
the blocks it holds and places the blocks where that costs least: the least recompute
seconds per micro-batch any layout of the combination can spend, a term of
:meth:`Bounds.zero_bound <autoplan.search.bounds.Bounds.zero_bound>`.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["lower_hull", "hull_at", "recompute_lp"]


def lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of ``(x, y)`` points, by increasing ``x`` (Andrew's monotone
    chain; of points at one ``x`` the least ``y``).

    >>> lower_hull([(0.0, 0.0), (3.0, 1.0), (4.0, 12.0), (2.0, 5.0)])
    [(0.0, 0.0), (3.0, 1.0), (4.0, 12.0)]
    """
    hull: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if hull and hull[-1][0] == x:
            continue
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (y - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])) <= 0:
            hull.pop()
        hull.append((x, y))
    return hull


def hull_at(hull: list[tuple[float, float]], x: float) -> float:
    """The hull's value at ``x`` (inf beyond its last point)."""
    if x > hull[-1][0] * (1 + 1e-12):
        return math.inf
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return hull[-1][1]


def recompute_lp(room_of: Sequence[tuple[float, float]], block: float, a_none: float,
                  hull: list[tuple[float, float]], n: int, v: int) -> float | None:
    """The least recompute seconds per micro-batch that lets the ranks hold ``n`` blocks
    (the fractional relaxation; None when they cannot, whatever recompute).

    Rank ``p`` has ``free`` bytes for blocks of ``block`` bytes of states and ``a_none``
    of activations per micro-batch in flight (``flight``).  Holding ``k`` blocks, it saves
    ``k (block + flight a_none) - free`` bytes, ``x = P / f - free / (k f)`` per block and
    micro-batch in flight (``P = block + f a_none``), at ``hull(x)`` seconds each (the
    options' lower convex hull, :func:`lower_hull`).  On a segment of the hull ``y = a + s
    x`` that is ``k a + s (k P - free) / f``: linear in ``k``, so each rank offers blocks in
    bands of one price per block, rising band by band (the hull is convex).  Every rank
    takes its first ``v`` blocks (a block per chunk) from its cheapest bands, then the
    rest go to the cheapest bands of any rank.

    >>> hull = [(0.0, 0.0), (10.0, 1.0)]        # saving 10 bytes a block costs 1 s
    >>> recompute_lp([(100.0, 1.0)], 0.0, 10.0, hull, 10, 1)   # 10 blocks fit as they are
    0.0
    >>> recompute_lp([(100.0, 1.0)], 0.0, 10.0, hull, 20, 1)   # 100 bytes over: 10 s
    10.0
    >>> recompute_lp([(100.0, 1.0)], 5.0, 10.0, hull, 21, 1) is None   # states: 105 > 100
    True
    """
    xs = [x for x, _ in hull]
    # each segment of the hull, y = a + s x: (a, s), the same for every rank
    segments = []
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        slope = (y1 - y0) / (x1 - x0)
        segments.append((y0 - slope * x0, slope))
    bands: list[tuple[float, float]] = []
    held, spent = 0.0, 0.0
    for free, flight in room_of:
        plain = block + flight * a_none
        if plain <= 0:
            offers = [(0.0, float(n))]
        else:
            # blocks held when each saves x (each point of the hull): free / (P - f x)
            room = max(0.0, free)
            ks = [room / left if (left := plain - flight * x) > 0 else math.inf
                  for x in xs]
            offers = [(0.0, ks[0])]
            for i, (a, slope) in enumerate(segments):
                offers.append((max(0.0, a + slope * plain / flight), ks[i + 1] - ks[i]))
            if free < 0 or ks[-1] < v:
                return None                     # not one block per chunk
        # this rank's first v blocks, from its cheapest bands
        need = float(v)
        for price, blocks in offers:
            take = min(need, blocks)
            spent += take * price
            need -= take
            if take < blocks:
                bands.append((price, blocks - take))
        held += v
    left = n - held
    for price, blocks in sorted(bands):
        if left <= 0:
            break
        take = min(left, blocks)
        spent += take * price
        left -= take
    return spent if left <= 1e-9 else None
