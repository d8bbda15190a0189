"""The quota's eviction policies (kvstore/engine/eviction.py) on hand-made
candidates: which blocks go, in which order, and what the ghosts remember."""

from __future__ import annotations

from kvstore.engine.eviction import Candidate, Ghosts, lru, probation
from kvstore.engine.index import IndexEntry

SIZE = 100


def cand(key: str, created: int, touched: int = 0, size: int = SIZE) -> Candidate:
    entry = IndexEntry(1, 0, size, 0, size, 0, 1, b"\0" * 16, created * 1_000_000)
    return Candidate(key, entry, created, touched)


def keys(cs: list[Candidate]) -> list[str]:
    return [c.key for c in cs]


def test_lru_takes_the_least_recently_used_adding_up_to_the_need() -> None:
    cs = [cand("a", 1, touched=50), cand("b", 2), cand("c", 3), cand("d", 4, touched=40)]
    assert keys(lru(cs, 2 * SIZE)) == ["b", "c"]
    assert keys(lru(cs, 2 * SIZE + 1)) == ["b", "c", "d"]
    assert keys(lru(cs, 10 * SIZE)) == ["b", "c", "d", "a"]


def test_probation_takes_blocks_never_read_first_but_keeps_the_newest() -> None:
    reused = [cand("r1", 1, touched=5), cand("r2", 2, touched=6)]
    new = [cand(f"n{i}", 10 + i) for i in range(5)]
    # Need 3 blocks: the three oldest never read, though r1 and r2 are older.
    choice = probation(reused + new, 3 * SIZE, keep_new=2 * SIZE, ghosts=None)
    assert keys(choice.victims) == ["n0", "n1", "n2"]
    assert choice.on_probation == ["n0", "n1", "n2"] and choice.held == 7
    # Need 5: the newest 2 on probation stay; the rest comes from the reused, LRU.
    choice = probation(reused + new, 5 * SIZE, keep_new=2 * SIZE, ghosts=None)
    assert keys(choice.victims) == ["n0", "n1", "n2", "r1", "r2"]
    assert choice.on_probation == ["n0", "n1", "n2"]


def test_a_touch_before_the_block_was_stored_again_does_not_count() -> None:
    """A touch older than the record (the key was deleted and put again) is
    not a read of this block."""
    choice = probation([cand("old", 10, touched=5), cand("new", 20)], SIZE, keep_new=0, ghosts=None)
    assert keys(choice.victims) == ["old"]


def test_a_ghost_stored_again_counts_as_reused() -> None:
    ghosts = Ghosts(incarnation=1)
    ghosts.add(["g"], when_ms=100, bound=10)
    cs = [cand("g", 150), cand("n", 120)]  # g came back after it was evicted
    choice = probation(cs, SIZE, keep_new=0, ghosts=ghosts)
    assert keys(choice.victims) == ["n"] and keys(choice.returned) == ["g"]
    stale = [cand("g", 50), cand("n", 120)]  # a g stored before that eviction is not a return
    assert keys(probation(stale, SIZE, keep_new=0, ghosts=ghosts).victims) == ["g"]


def test_ghosts_forget_the_longest_remembered_first() -> None:
    ghosts = Ghosts(incarnation=1)
    ghosts.add(["a", "b", "c"], when_ms=1, bound=3)
    ghosts.add(["a"], when_ms=2, bound=3)  # evicted again: remembered anew
    ghosts.add(["d"], when_ms=3, bound=3)
    assert len(ghosts) == 3
    assert not ghosts.returned(cand("b", 10))
    assert all(ghosts.returned(cand(k, 10)) for k in ("a", "c", "d"))
