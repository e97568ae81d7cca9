"""How many torch threads a CPU worker gives each call or step: chosen per shape, by measurement.

A worker's intra-op pool pays off on large tensors; on small ones it can cost more than it
gives. The workers run SCHED_IDLE beside the control plane, so any wake-up of a proxy, DB or
scheduler preempts one of the pool's threads, and every parallel region then waits at its
barrier for that thread. In `bench e2e`'s deployment the tiny text encoder took 10 ms at 2
threads and 5 ms at 1 (4.5 ms either way alone in one process), while its VAE decode at 256×256
needs both cores (1.09 s against 1.47 s at 1 thread). No fixed setting fits every shape, so the
worker tries each candidate on a key a few times, keeps the fastest median (all cores, as
without a choice, unless another candidate is faster by more than ``TIE``: a VAE decode at
64×64 ran about as fast on 1 thread as on 2 there, and a coin flip between them is no gain), and
tries again after ``keep_for`` uses, since the load beside it changes. A choice other than all
cores is tried again sooner once, after ``confirm_s`` seconds of the key's calls, and holds only
if it wins again: this VM has moments that slow two-thread work alone, and a choice made in one
held after it passed (a 256x256x17 VAE decode at 1 thread, 1.39 s a call against 1.04 s at 2,
for a whole `bench e2e` run). Counted in the key's own seconds, the second look comes soon for
a long call, where a wrong choice costs most; a short call gets none before ``keep_for``. A
key's first call is not a sample: it is slower at any setting (allocations, cold caches).

Pure (no torch, no clock): the worker passes the seconds it measured.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Hashable
from dataclasses import dataclass, field

TRIALS = 5  # samples per candidate before choosing: a median of 5 outvotes two preempted calls
KEEP_FOR = 500  # uses of a choice before trying the candidates again (the slower tries: 1% of calls)
TIE = 1.05  # all cores unless another candidate is more than 5% faster
CONFIRM_S = 10.0  # seconds of a key's calls at a choice other than all cores before trying it once more
MAX_KEYS = 256


@dataclass
class _Key:
    samples: dict[int, list[float]] = field(default_factory=dict)
    chosen: int | None = None
    uses: int = 0
    spent: float = 0.0  # seconds of calls at ``chosen``
    provisional: bool = False  # a choice other than all cores, made once: tried again after confirm_s
    warm: bool = False  # its first call, slower (allocations, caches), was not a sample


class ThreadChoice:
    """Per key, 1 or ``most`` threads: ``pick`` before a call, ``observe`` after it."""

    def __init__(self, most: int, trials: int = TRIALS, keep_for: int = KEEP_FOR, max_keys: int = MAX_KEYS,
                 confirm_s: float = CONFIRM_S) -> None:
        # the default first: a key's first call runs as it would without a choice
        self.candidates = (most, 1) if most > 1 else (1,)
        self.trials, self.keep_for, self.max_keys, self.confirm_s = trials, keep_for, max_keys, confirm_s
        self._keys: collections.OrderedDict[Hashable, _Key] = collections.OrderedDict()

    def pick(self, key: Hashable) -> int:
        k = self._keys.pop(key, None) or _Key()
        self._keys[key] = k  # most recently used last
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        if k.chosen is not None:
            if k.uses < self.keep_for and not (k.provisional and k.spent >= self.confirm_s):
                k.uses += 1
                return k.chosen
            k.samples, k.chosen, k.uses, k.spent = {}, None, 0, 0.0
        return min(self.candidates, key=lambda n: len(k.samples.get(n, ())))

    def observe(self, key: Hashable, threads: int, seconds: float) -> int | None:
        """A call of ``key`` at ``threads`` took ``seconds``; the choice, when this sample made it."""
        k = self._keys.get(key)
        if k is not None and k.chosen is not None:
            if threads == k.chosen:
                k.spent += seconds
            return None
        if k is None or threads not in self.candidates:
            return None
        if not k.warm:
            k.warm = True
            return None
        got = k.samples.setdefault(threads, [])
        if len(got) < self.trials:
            got.append(seconds)
        if any(len(k.samples.get(n, ())) < self.trials for n in self.candidates):
            return None
        medians = {n: statistics.median(k.samples[n]) for n in self.candidates}
        best = min(self.candidates, key=medians.__getitem__)
        default = self.candidates[0]
        k.chosen = default if medians[default] <= TIE * medians[best] else best
        # the default needs no second look; another choice gets one, unless this was it
        k.provisional = k.chosen != default and not k.provisional
        return k.chosen

    def medians(self, key: Hashable) -> dict[int, float]:
        """Per candidate, the median seconds of the samples ``key``'s choice was made on."""
        k = self._keys.get(key)
        return {n: statistics.median(v) for n, v in k.samples.items() if v} if k is not None else {}

    def choices(self) -> dict[Hashable, int]:
        """The keys decided now and their thread counts."""
        return {key: k.chosen for key, k in self._keys.items() if k.chosen is not None}
