"""Galloc: static offsets for tensors with known lifetimes, on plain intervals (no IR).

A tensor is an `Interval`: `size` bytes, live over op steps [start, end] inclusive (made at
`start`, last read at `end`). Two tensors may share bytes only if their lifetimes are disjoint,
or if one is the in-place output of the other: the op at step `in.end == out.start` reads the
input element by element and writes the output at the same offset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping


class PlanError(ValueError):
    """An arena plan that is unsafe; the message names the tensors at fault."""


@dataclass(frozen=True)
class Interval:
    name: str
    size: int    # bytes
    start: int   # op step that makes it (0 for graph inputs)
    end: int     # last op step that reads it, inclusive


@dataclass
class InplaceGroups:
    """Chains of in-place reuse, each planned as one tensor.

    groups: one Interval per chain, its head's name, its members' union lifetime and the
            head's size (a member is never larger than the one whose storage it takes)
    group_of: tensor name -> its group's name
    reuses: {out: in} for each in-place reuse honoured
    """
    groups: list[Interval]
    group_of: dict[str, str]
    reuses: dict[str, str]


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _overlap_in_time(a: Interval, b: Interval) -> bool:
    return a.start <= b.end and b.start <= a.end


def inplace_groups(intervals: Iterable[Interval], candidates: Mapping[str, str] | None = None) -> InplaceGroups:
    """Honour each candidate {out: in} where `in` dies at the step that makes `out`, `out`
    fits in `in`'s bytes, and no other output already took `in`."""
    by_name = {iv.name: iv for iv in intervals}
    reuses: dict[str, str] = {}
    taken: set[str] = set()
    for out, src in sorted((candidates or {}).items()):
        if out not in by_name or src not in by_name or out == src or src in taken:
            continue
        o, i = by_name[out], by_name[src]
        # a chain link made and read at one step would put three members live at once
        # (and could close a cycle), so a one-step tensor is never both an out and an in
        mid = (src in reuses and i.start == i.end) or (out in taken and o.start == o.end)
        if i.end == o.start and o.size <= i.size and not mid:
            reuses[out] = src
            taken.add(src)

    def head(name: str) -> str:
        while name in reuses:
            name = reuses[name]
        return name

    group_of = {name: head(name) for name in by_name}
    members: dict[str, list[Interval]] = {}
    for iv in by_name.values():
        members.setdefault(group_of[iv.name], []).append(iv)
    groups = [Interval(h, by_name[h].size, min(m.start for m in ms), max(m.end for m in ms))
              for h, ms in members.items()]
    return InplaceGroups(groups, group_of, reuses)


def _best_fit(iv: Interval, placed: list[tuple[int, Interval]], alignment: int) -> int:
    """Lowest-waste aligned gap among tensors live at the same time as iv, else above them."""
    busy = sorted((off, off + p.size) for off, p in placed if _overlap_in_time(iv, p))
    best, best_waste, cursor = None, None, 0
    for lo, hi in busy:
        gap = lo - cursor
        if gap >= iv.size and (best_waste is None or gap - iv.size < best_waste):
            best, best_waste = cursor, gap - iv.size
        cursor = max(cursor, align_up(hi, alignment))
    return cursor if best is None else best


def plan_greedy_by_size(intervals: Iterable[Interval], alignment: int = 64,
                        inplace: Mapping[str, str] | None = None) -> dict[str, int]:
    """Offsets by greedy-by-size: largest tensor first, each into the best-fitting gap left by
    the tensors already placed that overlap it in time. `inplace` holds candidate reuses
    {out: in}; those honoured (see `inplace_groups`) get the same offset."""
    ivs = list(intervals)
    grouped = inplace_groups(ivs, inplace)
    placed: list[tuple[int, Interval]] = []
    group_offset: dict[str, int] = {}
    # big first: they are the hardest to fit; ties by start then name keep plans deterministic
    for g in sorted(grouped.groups, key=lambda g: (-g.size, g.start, g.name)):
        off = _best_fit(g, placed, alignment)
        group_offset[g.name] = off
        placed.append((off, g))
    return {iv.name: group_offset[grouped.group_of[iv.name]] for iv in ivs}


def plan_naive(intervals: Iterable[Interval], alignment: int = 64) -> dict[str, int]:
    """Each tensor its own aligned slot, one after another: the baseline with no reuse."""
    offsets, cursor = {}, 0
    for iv in intervals:
        offsets[iv.name] = cursor
        cursor += align_up(iv.size, alignment)
    return offsets


def arena_bytes(intervals: Iterable[Interval], offsets: Mapping[str, int], alignment: int = 64) -> int:
    """Bytes an arena needs to hold every tensor at its offset, rounded up to the alignment."""
    return align_up(max((offsets[iv.name] + iv.size for iv in intervals), default=0), alignment)


def naive_bytes(intervals: Iterable[Interval], alignment: int = 64) -> int:
    return sum(align_up(iv.size, alignment) for iv in intervals)


def lower_bound(intervals: Iterable[Interval]) -> int:
    """Max over steps of the bytes live at that step: no plan of these lifetimes fits in less."""
    delta: dict[int, int] = {}
    for iv in intervals:
        delta[iv.start] = delta.get(iv.start, 0) + iv.size
        delta[iv.end + 1] = delta.get(iv.end + 1, 0) - iv.size
    live = peak = 0
    for step in sorted(delta):
        live += delta[step]
        peak = max(peak, live)
    return peak


def verify_storage_reuse(intervals: Iterable[Interval], offsets: Mapping[str, int], size: int,
                         alignment: int = 64, inplace: Mapping[str, str] | None = None) -> None:
    """The oracle: raise PlanError if a tensor lacks an offset, is misaligned or leaves the
    arena, or if two tensors overlap in both lifetime and storage (allowed only for an in-place
    pair {out: in} at the same offset whose lifetimes meet at the one step that makes out)."""
    ivs = list(intervals)
    pairs = {(o, i) for o, i in (inplace or {}).items()}
    for iv in ivs:
        if iv.name not in offsets:
            raise PlanError(f"tensor {iv.name!r} has no arena offset")
        off = offsets[iv.name]
        if off % alignment:
            raise PlanError(f"tensor {iv.name!r} at offset {off} is not {alignment}-byte aligned")
        if off < 0 or off + iv.size > size:
            raise PlanError(f"tensor {iv.name!r} at [{off}, {off + iv.size}) lies outside the {size}-byte arena")
    # sweep in start order: only tensors still live when another starts can collide
    ivs.sort(key=lambda iv: iv.start)
    for n, a in enumerate(ivs):
        a_lo, a_hi = offsets[a.name], offsets[a.name] + a.size
        for b in ivs[n + 1:]:
            if b.start > a.end:
                break
            b_lo, b_hi = offsets[b.name], offsets[b.name] + b.size
            if not (a_lo < b_hi and b_lo < a_hi) or a.size == 0 or b.size == 0:
                continue
            if _inplace_ok(a, b, a_lo, b_lo, pairs) or _inplace_ok(b, a, b_lo, a_lo, pairs):
                continue
            raise PlanError(f"tensors {a.name!r} (steps {a.start}..{a.end}, bytes {a_lo}..{a_hi}) and "
                            f"{b.name!r} (steps {b.start}..{b.end}, bytes {b_lo}..{b_hi}) overlap in "
                            "lifetime and storage")


def _inplace_ok(src: Interval, out: Interval, src_off: int, out_off: int, pairs: set[tuple[str, str]]) -> bool:
    return (out.name, src.name) in pairs and src_off == out_off and src.end == out.start
