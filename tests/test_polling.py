"""core.polling: the schedule of a loop's looks while it waits for another process."""

from core.polling import FAST_FOR_S, FAST_S, FIRST_S, poll_delay


def test_a_wait_is_looked_at_often_first_then_at_the_callers_slow_pace():
    waited, looks = 0.0, []
    while waited < 5.0:
        looks.append(waited)
        waited += poll_delay(waited, slow_s=1.0)
    assert looks[:3] == [0.0, FIRST_S, 2 * FIRST_S]
    fast = [b - a for a, b in zip(looks, looks[1:]) if b <= FAST_FOR_S]
    assert max(fast) <= FAST_S + 1e-9 and len(fast) >= FAST_FOR_S / FAST_S - 2
    assert [round(b - a, 6) for a, b in zip(looks, looks[1:]) if a >= FAST_FOR_S] == [1.0, 1.0]


def test_a_slow_pace_below_the_fast_one_wins():
    assert poll_delay(0.5, slow_s=0.01) == 0.01
