"""The placement controller publishes the pool's routing choice with its routes: a changed choice is
a new version at once, one the routers would refuse is never published; a controller without a
routing source publishes tables that name none."""

from __future__ import annotations

from dataclasses import replace

from loraplex.placement import DEFAULT_CPU, PlacementController, make_policy
from loraplex.routing import AdapterRecord, InMemoryRoutingStore, ServerRecord
from loraplex.routing.choice import RoutingChoice
from loraplex.util.clock import ManualClock

RANK_AWARE = RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"})


def _store(clock: ManualClock) -> InMemoryRoutingStore:
    store = InMemoryRoutingStore("pool", clock)
    for i in range(2):
        store.register_server(ServerRecord(f"s{i}", f"http://127.0.0.1:{9000 + i}", 64), 60)
    store.put_adapter(AdapterRecord("a", "sha256:a", 8, 1000, "file:///a"))
    return store


def _controller(store: InMemoryRoutingStore, clock: ManualClock, routing=None) -> PlacementController:
    return PlacementController(store, make_policy("loraserve"), clock, interval_s=60, operating_points=DEFAULT_CPU,
                               routing=routing)


def test_the_routing_choice_is_published_and_a_change_is_placed_at_once() -> None:
    clock = ManualClock(1_000.0)
    store = _store(clock)
    choice: list[RoutingChoice | None] = [RANK_AWARE]
    controller = _controller(store, clock, lambda: choice[0])
    assert controller.step().outcome == "published"
    first = store.read_table()
    assert first.routing == RANK_AWARE
    assert controller.step() is None  # nothing changed, the interval is not over
    choice[0] = None  # the AdapterPool's spec.routing was removed
    report = controller.step()
    assert report.outcome == "published" and store.read_table().routing is None
    assert store.read_table().same_routes(first)  # only the choice changed


def test_without_a_routing_source_a_table_names_no_choice() -> None:
    clock = ManualClock(1_000.0)
    store = _store(clock)
    controller = _controller(store, clock)
    controller.run_once()
    store.publish_table(replace(store.read_table(), version=2, routing=RANK_AWARE))  # another writer's
    store.put_adapter(AdapterRecord("b", "sha256:b", 8, 1000, "file:///b"))
    assert controller.run_once().outcome == "published"
    table = store.read_table()
    assert "b" in table.entries and table.routing is None


def test_a_choice_the_routers_would_refuse_is_not_published() -> None:
    clock = ManualClock(1_000.0)
    store = _store(clock)
    choice: list[RoutingChoice | None] = [RANK_AWARE]
    controller = _controller(store, clock, lambda: choice[0])
    controller.run_once()
    choice[0] = RoutingChoice("rank-aware", {"slo_tpot_s": "fast"})  # the pool turns Failed/InvalidRouting
    store.put_adapter(AdapterRecord("b", "sha256:b", 8, 1000, "file:///b"))
    assert controller.run_once().outcome == "published"
    table = store.read_table()
    assert "b" in table.entries and table.routing == RANK_AWARE
