"""A restarted operator's readiness wait: every object's worker waits until every listed object is
indexed; with the waits shared, that costs O(N) wake-ups instead of O(N²)."""

from __future__ import annotations

import asyncio

from kopf._cogs.aiokits.aiotoggles import ToggleSet
from loraplex_operator.kopf_startup import share_toggle_waits


def _checks_until_all_on(objects: int) -> tuple[int, list[bool]]:
    """kopf's use at start-up: a toggle per listed object, each object's worker turns its own on
    and waits for all; returns how often the set's state was evaluated, and who got through."""
    checks = 0

    def every(toggles: object) -> bool:
        nonlocal checks
        checks += 1
        return all(toggles)  # type: ignore[call-overload]

    async def main() -> list[bool]:
        indexed = ToggleSet(every)
        toggles = [await indexed.make_toggle(name=str(i)) for i in range(objects)]

        async def worker(i: int) -> bool:
            await toggles[i].turn_to(True)  # indexed its object
            await indexed.wait_for(True)
            return all(t.is_on() for t in toggles[:: max(1, objects // 10)])  # a sample: no O(N) per worker

        workers = []
        for i in range(objects):  # the watcher starts them one by one as the listing is fed
            workers.append(asyncio.ensure_future(worker(i)))
            await asyncio.sleep(0)
        return list(await asyncio.gather(*workers))

    through = asyncio.run(main())
    return checks, through


def test_every_worker_gets_through_once_all_are_indexed_with_linear_checks() -> None:
    share_toggle_waits()
    checks, through = _checks_until_all_on(400)
    assert through == [True] * 400
    assert checks < 10 * 400  # kopf's own wait: about 400²/2 = 80,000


def test_waiting_for_off_still_works() -> None:
    share_toggle_waits()

    async def main() -> None:
        indexed = ToggleSet(all)
        toggle = await indexed.make_toggle(True)
        waiting = asyncio.ensure_future(indexed.wait_for(False))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await toggle.turn_to(False)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(main())
