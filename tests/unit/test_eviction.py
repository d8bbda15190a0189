"""The quota's eviction policies (kvstore/engine/eviction.py) on hand-made
candidates: which blocks go, in which order, what the ghosts remember and
how the share of the quota kept on probation moves."""

from __future__ import annotations

import pytest

from kvstore.engine.eviction import MAX_SHARE, MIN_SHARE, Candidate, Ghosts, Probation, lru, probation
from kvstore.engine.index import IndexEntry

SIZE = 100
QUOTA = 10 * SIZE


def cand(key: str, created: int, touched: int = 0, size: int = SIZE) -> Candidate:
    entry = IndexEntry(1, 0, size, 0, size, 0, 1, b"\0" * 16, created * 1_000_000)
    return Candidate(key, entry, created, touched)


def keys(cs: list[Candidate]) -> list[str]:
    return [c.key for c in cs]


def state(share: float) -> Probation:
    return Probation(incarnation=1, share=share)


def test_lru_takes_the_least_recently_used_adding_up_to_the_need() -> None:
    cs = [cand("a", 1, touched=50), cand("b", 2), cand("c", 3), cand("d", 4, touched=40)]
    assert keys(lru(cs, 2 * SIZE)) == ["b", "c"]
    assert keys(lru(cs, 2 * SIZE + 1)) == ["b", "c", "d"]
    assert keys(lru(cs, 10 * SIZE)) == ["b", "c", "d", "a"]


def test_probation_takes_blocks_never_read_first_but_keeps_the_newest() -> None:
    reused = [cand("r1", 1, touched=5), cand("r2", 2, touched=6)]
    new = [cand(f"n{i}", 10 + i) for i in range(5)]
    # Need 3 blocks: the three oldest never read, though r1 and r2 are older.
    choice = probation(reused + new, 3 * SIZE, QUOTA, state(0.2))
    assert keys(choice.victims) == ["n0", "n1", "n2"]
    assert choice.on_probation == ["n0", "n1", "n2"] and choice.after_reads == [] and choice.held == 7
    # Need 5: the newest 2 on probation (a fifth of the quota) stay; the rest comes from the reused, LRU.
    choice = probation(reused + new, 5 * SIZE, QUOTA, state(0.2))
    assert keys(choice.victims) == ["n0", "n1", "n2", "r1", "r2"]
    assert choice.on_probation == ["n0", "n1", "n2"] and choice.after_reads == ["r1", "r2"]
    assert choice.share == 0.2  # no ghost came back: the share stays


def test_a_touch_before_the_block_was_stored_again_does_not_count() -> None:
    """A touch older than the record (the key was deleted and put again) is
    not a read of this block."""
    choice = probation([cand("old", 10, touched=5), cand("new", 20)], SIZE, QUOTA, state(MIN_SHARE))
    assert keys(choice.victims) == ["old"]


def test_a_ghost_evicted_on_probation_comes_back_reused_and_grows_the_share() -> None:
    s = state(0.1)
    s.evicted_new.add(["g"], when_ms=100, bound=10)
    cs = [cand("g", 150), cand("n1", 120), cand("n2", 130), cand("n3", 140)]  # g came back after it was evicted
    choice = probation(cs, SIZE, QUOTA, s)
    assert choice.share == pytest.approx(0.1 + SIZE / QUOTA)  # one block's worth (no ghost read before)
    # g is reused now; of the three on probation the newest two (the grown share) stay.
    assert keys(choice.victims) == ["n1"] and keys(choice.returned_new) == ["g"]
    stale = [cand("g", 50), cand("n", 120)]  # a g stored before that eviction is not a return
    choice = probation(stale, SIZE, QUOTA, s)
    assert keys(choice.victims) == ["g"] and choice.returned_new == [] and choice.share == 0.1


def test_a_ghost_evicted_after_a_read_comes_back_on_probation_and_shrinks_the_share() -> None:
    s = state(0.3)
    s.evicted_reused.add(["r"], when_ms=100, bound=10)
    s.evicted_new.add(["x", "y"], when_ms=100, bound=10)  # twice as many ghosts of the other kind
    choice = probation([cand("r", 150), cand("n", 160)], SIZE, QUOTA, s)
    assert choice.returned_reused == ["r"] and choice.returned_new == []
    assert choice.share == pytest.approx(0.3 - 2 * SIZE / QUOTA)
    assert keys(choice.victims) == ["r"]  # on probation again, and the oldest


def test_the_share_stays_within_its_bounds() -> None:
    s = state(MAX_SHARE)
    s.evicted_new.add(["g"], when_ms=1, bound=10)
    assert probation([cand("g", 5)], SIZE, QUOTA, s).share == MAX_SHARE
    s = state(MIN_SHARE)
    s.evicted_reused.add(["r"], when_ms=1, bound=10)
    assert probation([cand("r", 5)], SIZE, QUOTA, s).share == MIN_SHARE


def test_ghosts_forget_the_longest_remembered_first() -> None:
    ghosts = Ghosts()
    ghosts.add(["a", "b", "c"], when_ms=1, bound=3)
    ghosts.add(["a"], when_ms=2, bound=3)  # evicted again: remembered anew
    ghosts.add(["d"], when_ms=3, bound=3)
    assert len(ghosts) == 3
    assert not ghosts.returned(cand("b", 10))
    assert all(ghosts.returned(cand(k, 10)) for k in ("a", "c", "d"))
    ghosts.forget(["a", "zzz"])
    assert not ghosts.returned(cand("a", 10)) and len(ghosts) == 2


def test_the_state_is_kept_and_read_back_whole() -> None:
    s = Probation(incarnation=1234567890123, share=0.37)
    s.evicted_new.add(["a", "bé", "c" * 300], 10, 100)
    s.evicted_reused.add(["x", "y"], 20, 100)
    back = Probation.decode(s.encode())
    assert back is not None
    assert (back.incarnation, back.share) == (s.incarnation, s.share)
    assert list(back.evicted_new.items()) == [("a", 10), ("bé", 10), ("c" * 300, 10)]
    assert list(back.evicted_reused.items()) == [("x", 20), ("y", 20)]
    assert back.evicted_new.returned(cand("bé", created=11)) and not back.evicted_reused.returned(cand("a", 30))


@pytest.mark.parametrize("damage", ["short", "version", "cut"])
def test_a_state_this_release_cannot_read_is_no_state(damage: str) -> None:
    s = Probation(incarnation=1)
    s.evicted_new.add(["a", "b"], 10, 100)
    raw = s.encode()
    bad = {"short": raw[:5], "version": bytes([raw[0] + 1]) + raw[1:], "cut": raw[:-1]}[damage]
    assert Probation.decode(bad) is None
