"""The spare-arena rule (ray_velo.memory.spares): a spare only for a size that repeats within
the window, never above the size bound, never past the warm limit; its table stays bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ray_velo.config import GiB, MiB
from ray_velo.memory.spares import SparePolicy


def policy(**overrides: float) -> SparePolicy:
    settings = {"repeat_window_s": 30.0, "max_bytes": 768 * MiB, "warm_limit_bytes": 6 * GiB}
    settings.update(overrides)
    return SparePolicy(
        repeat_window_s=settings["repeat_window_s"],
        max_bytes=int(settings["max_bytes"]),
        warm_limit_bytes=int(settings["warm_limit_bytes"]),
    )


def test_the_first_put_of_a_size_asks_for_no_spare() -> None:
    rule = policy()
    assert not rule.placed(256 * MiB, 0.0, warm_held_bytes=0, has_warm=False)


def test_a_size_seen_again_within_the_window_asks_for_a_spare() -> None:
    rule = policy()
    rule.placed(256 * MiB, 0.0, warm_held_bytes=0, has_warm=False)
    assert rule.placed(256 * MiB + 4096, 1.0, warm_held_bytes=0, has_warm=False)


def test_a_size_seen_again_after_the_window_does_not() -> None:
    rule = policy(repeat_window_s=10.0)
    rule.placed(256 * MiB, 0.0, warm_held_bytes=0, has_warm=False)
    assert not rule.placed(256 * MiB, 10.5, warm_held_bytes=0, has_warm=False)


def test_another_size_is_not_a_repeat() -> None:
    """Sizes further apart than the warm arenas' 1/8 tolerance do not share an arena."""
    rule = policy()
    rule.placed(256 * MiB, 0.0, warm_held_bytes=0, has_warm=False)
    assert not rule.placed(300 * MiB, 1.0, warm_held_bytes=0, has_warm=False)


def test_no_spare_above_the_size_bound() -> None:
    """1.5 GiB payloads repeating (issue 37): the spare would map 1.5 GiB beside the transfer."""
    rule = policy()
    rule.placed(1536 * MiB, 0.0, warm_held_bytes=0, has_warm=False)
    assert not rule.placed(1536 * MiB, 1.0, warm_held_bytes=0, has_warm=False)


def test_no_spare_when_a_warm_arena_of_the_size_is_there() -> None:
    rule = policy()
    rule.placed(64 * MiB, 0.0, warm_held_bytes=0, has_warm=False)
    assert not rule.placed(64 * MiB, 1.0, warm_held_bytes=64 * MiB, has_warm=True)


def test_no_spare_past_the_warm_limit() -> None:
    rule = policy(warm_limit_bytes=512 * MiB)
    rule.placed(256 * MiB, 0.0, warm_held_bytes=0, has_warm=False)
    assert not rule.placed(256 * MiB, 1.0, warm_held_bytes=300 * MiB, has_warm=False)


def test_a_zero_window_turns_spares_off() -> None:
    rule = policy(repeat_window_s=0.0)
    asked = [rule.placed(64 * MiB, 0.0, warm_held_bytes=0, has_warm=False) for _ in range(3)]
    assert asked == [False, False, False]


placements = st.lists(
    st.tuples(
        st.integers(1, 2 * GiB),  # bytes
        st.floats(0.0, 20.0),  # seconds since the previous placement
        st.integers(0, 8 * GiB),  # warm bytes held
        st.booleans(),  # a warm arena of the size is there
    ),
    max_size=60,
)


@given(placements)
def test_a_spare_is_asked_for_only_where_every_rule_allows(
    steps: list[tuple[int, float, int, bool]],
) -> None:
    """Whatever the sequence of placements: a spare is asked for only for a size within the
    bound, fitting beside the warm arenas, with none of its size warm, seen within the
    window before; and the table of sizes never holds more than the window's placements."""
    rule = policy(repeat_window_s=30.0, max_bytes=768 * MiB, warm_limit_bytes=4 * GiB)
    now, history = 0.0, []
    for nbytes, gap, warm_held, has_warm in steps:
        now += gap
        asked = rule.placed(nbytes, now, warm_held_bytes=warm_held, has_warm=has_warm)
        size = -(-nbytes // 4096) * 4096
        if asked:
            assert size <= 768 * MiB and not has_warm and warm_held + size <= 4 * GiB
            assert any(
                now - when <= 30.0 and max(s, size) <= min(s, size) * 9 // 8 for s, when in history
            )
        history.append((size, now))
        recent = [h for h in history if now - h[1] <= 30.0]
        assert rule.sizes_tracked <= len(recent)
