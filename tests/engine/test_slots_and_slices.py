"""Adapter slot numbering and request token slices."""

from __future__ import annotations

import random

from loraplex.engine.memory.adapter_residency import LruResidency
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.spec.adapter import AdapterId


def ids(*names: str) -> list[AdapterId]:
    return [AdapterId(n, f"sha256:{n}") for n in names]


def test_a_retired_slot_is_reused_lowest_first():
    a, b, c, d, e = ids("a", "b", "c", "d", "e")
    slots = LruResidency(3)
    assert [slots.acquire(x).slot for x in (a, b, c)] == [0, 1, 2]
    for x in (a, b):
        slots.release(x)
    assert slots.retire(b) == 1 and slots.retire(a) == 0
    assert slots.acquire(d).slot == 0 and slots.acquire(e).slot == 1
    assert slots.acquire(b) is None  # every slot pinned


def test_an_eviction_takes_the_least_recently_used_unpinned_slot():
    a, b, c = ids("a", "b", "c")
    slots = LruResidency(2)
    slots.acquire(a)
    slots.acquire(b)
    slots.release(a)
    grant = slots.acquire(c)
    assert (grant.slot, grant.loaded, grant.evicted) == (0, True, a)


def test_whether_a_slot_can_be_had_follows_the_pins_of_resident_adapters():
    adapters = ids(*"abcdef")
    slots, rng, pins = LruResidency(3), random.Random(0), {a: 0 for a in adapters}
    for _ in range(2000):  # against the definition: a free slot, or a resident adapter with no pin
        a = rng.choice(adapters)
        if pins[a] and rng.random() < 0.5:
            slots.release(a)
            pins[a] -= 1
        elif rng.random() < 0.1:
            if slots.retire(a) is not None:
                assert pins[a] == 0
        else:
            resident = slots.resident()
            expect = a in resident or len(resident) < 3 or any(not pins[r] for r in resident)
            assert slots.can_acquire(a) == expect
            assert (slots.acquire(a) is not None) == expect
            pins[a] += expect


def test_token_slices_match_the_whole_sequence():
    request = Request("r", [10, 11, 12, 13], SamplingParams())
    request.output_token_ids.extend([20, 21])
    whole = request.all_token_ids
    for start in range(len(whole)):
        for count in range(1, len(whole) - start + 1):
            assert request.token_slice(start, count) == whole[start:start + count]
