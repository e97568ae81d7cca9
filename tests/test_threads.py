"""The worker's choice of torch threads per shape (stage/threads.py): the pure core, driven
with the seconds a worker would measure."""

from __future__ import annotations

from onepiece.stage.threads import ThreadChoice


def feed(tc: ThreadChoice, key: str, seconds: dict[int, float], calls: int) -> list[int]:
    """``calls`` calls of ``key``, each taking what ``seconds`` says for its thread count."""
    used = []
    for _ in range(calls):
        n = tc.pick(key)
        used.append(n)
        tc.observe(key, n, seconds[n])
    return used


def test_it_tries_both_and_keeps_the_faster_per_key():
    tc = ThreadChoice(2, trials=3)
    # the first call is a warm-up at all cores, then the two alternate until 3 samples each
    small = feed(tc, "small", {1: 0.004, 2: 0.010}, 7)
    assert small == [2, 2, 1, 2, 1, 2, 1]
    large = feed(tc, "large", {1: 1.4, 2: 1.0}, 7)
    assert tc.choices() == {"small": 1, "large": 2}
    assert feed(tc, "small", {1: 0.004, 2: 0.010}, 5) == [1] * 5
    assert feed(tc, "large", {1: 1.4, 2: 1.0}, 5) == [2] * 5
    assert large[0] == 2 and tc.medians("small") == {2: 0.010, 1: 0.004}


def test_the_first_call_is_not_a_sample():
    """A cold first call at all cores (slower at any setting) must not decide for one thread."""
    tc = ThreadChoice(2, trials=3)
    times = iter([0.5] + [0.010, 0.012] * 3)  # warm-up, then 2 threads 10 ms and 1 thread 12 ms
    for _ in range(7):
        n = tc.pick("k")
        tc.observe("k", n, next(times))
    assert tc.choices() == {"k": 2}


def test_all_cores_unless_one_thread_is_clearly_faster_and_a_median_outvotes_a_slow_call():
    for one, chosen in ((1.04, 2), (0.94, 1)):
        tc = ThreadChoice(2, trials=3)
        tc.observe("k", tc.pick("k"), 1.0)  # warm-up
        samples = {2: iter([1.00, 1.00, 5.0]), 1: iter([one] * 3)}
        for _ in range(6):
            n = tc.pick("k")
            tc.observe("k", n, next(samples[n]))
        assert tc.choices() == {"k": chosen}, one


def test_it_tries_again_after_keep_for_uses():
    tc = ThreadChoice(2, trials=1, keep_for=4)
    assert feed(tc, "k", {1: 1.0, 2: 2.0}, 3) == [2, 2, 1]
    assert tc.choices() == {"k": 1}
    # the load changed: after 4 uses both are tried again (no second warm-up), and 2 now wins
    assert feed(tc, "k", {1: 3.0, 2: 2.0}, 6) == [1, 1, 1, 1, 2, 1]
    assert tc.choices() == {"k": 2}


def test_a_choice_other_than_all_cores_holds_only_if_it_wins_again_after_confirm_s():
    """A moment that slowed two-thread work alone decided a long call for 1 thread; tried again
    once its calls have taken ``confirm_s`` seconds, the moment over, all cores win and hold."""
    tc = ThreadChoice(2, trials=3, keep_for=100, confirm_s=10.0)
    assert feed(tc, "k", {1: 1.4, 2: 1.9}, 7) == [2, 2, 1, 2, 1, 2, 1]  # the slow moment
    assert tc.choices() == {"k": 1}
    assert feed(tc, "k", {1: 1.4, 2: 1.0}, 8) == [1] * 8  # the moment passed: 8 calls, 11.2 s
    assert feed(tc, "k", {1: 1.4, 2: 1.0}, 6) == [2, 1] * 3  # tried again
    assert tc.choices() == {"k": 2}
    assert feed(tc, "k", {1: 1.4, 2: 1.0}, 100) == [2] * 100  # the default holds for keep_for
    # where 1 thread really is faster it wins again and then holds for keep_for
    tc = ThreadChoice(2, trials=3, keep_for=100, confirm_s=10.0)
    used = feed(tc, "k", {1: 1.4, 2: 1.9}, 7 + 8 + 6 + 100)
    assert tc.choices() == {"k": 1} and used[7 + 8 + 6:] == [1] * 100
    # a short call's choice takes its confirm_s only after keep_for uses: no second look sooner
    tc = ThreadChoice(2, trials=3, keep_for=100, confirm_s=10.0)
    assert feed(tc, "short", {1: 0.004, 2: 0.010}, 7 + 100)[7:] == [1] * 100


def test_one_core_leaves_nothing_to_choose_and_keys_are_bounded():
    one = ThreadChoice(1)
    assert feed(one, "k", {1: 1.0}, 5) == [1] * 5
    tc = ThreadChoice(4, trials=1, max_keys=3)
    for i in range(10):
        feed(tc, f"k{i}", {1: 1.0, 4: 0.5}, 3)
    assert tc.choices() == {"k7": 4, "k8": 4, "k9": 4}
    assert tc.observe("k0", 4, 1.0) is None  # forgotten: an observation alone decides nothing
    assert tc.observe("k9", 3, 1.0) is None  # not a candidate
