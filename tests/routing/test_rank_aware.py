"""Rank-aware routing (Toppings' Algorithm 1, `loraplex.routing.rank_aware`): the extra latency a
request adds to a server, SLO exclusion and its fallbacks, the profile's degradation to φ routing
without live batches, the batch a heartbeat carries, and what the router's snapshot offers."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from loraplex_agent.cluster.engine_view import open_batch
from loraplex_router.snapshot import Snapshot

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request, RequestStatus
from loraplex.latency.features import FEATURES
from loraplex.routing import RecordError, ServerRecord
from loraplex.routing.pipeline import PROFILES, Candidate, RouteRequest, make_profile
from loraplex.routing.rank_aware import (
    DECODE_TERMS,
    PREFILL_TERMS,
    BatchShape,
    LatencyModel,
    RankAwareConfig,
    RankAwareScorer,
    SloFilter,
    parse_options,
)
from loraplex.routing.records import RankLoad, ServerBatch
from loraplex.spec.adapter import AdapterId

MS = 1e-3


def batch_of(*groups: tuple[int, int], adapters: tuple[str, ...] | None = None, prefill: int = 0) -> ServerBatch:
    """(rank, requests) groups; one adapter per rank unless given."""
    names = adapters if adapters is not None else tuple(f"r{rank}" for rank, _ in groups if rank)
    return ServerBatch(tuple(RankLoad(rank, n, prefill) for rank, n in groups), names)


def pick_many(profile, request, candidates, n=400) -> Counter:
    return Counter(profile.pick(request, candidates).server_id for _ in range(n))


# ---- the latency model and Algorithm 1's terms ------------------------------------------------


def test_the_router_evaluates_the_twins_latency_terms():
    assert set(DECODE_TERMS) | set(PREFILL_TERMS) <= set(FEATURES)
    with pytest.raises(ValueError, match="unknown latency terms"):
        LatencyModel({"warp_speed": 1.0})
    model = LatencyModel.from_coefficients({"intercept": 0.01, "loads": 0.5, "load_rank_sum": 0.1})
    assert dict(model.coefficients) == {"intercept": 0.01}  # adapter loads are not a routing cost


def test_extra_latency_is_prefill_spread_over_the_output_plus_the_decode_step_delta():
    coefficients = {"intercept": 10 * MS, "batch": 0.1 * MS, "adapters": 0.2 * MS, "batch_x_adapters": 0.01 * MS,
                    "rank_sum": 0.002 * MS, "batch_x_max_rank": 0.004 * MS, "prefill_tokens": 0.02 * MS,
                    "prefill_rank_tokens": 0.0001 * MS, "context_tokens": 1e-6 * MS, "padded_context": 2e-6 * MS}
    model = LatencyModel(coefficients)
    config = RankAwareConfig(model, slo_tpot_s=1.0, avg_output_tokens=100)
    batch = ServerBatch((RankLoad(8, 3, 50), RankLoad(64, 1, 0)), ("a", "b"), context_tokens=4000, max_context=2000)
    request = RouteRequest("c", 32, prompt_tokens=300)
    before = BatchShape(4, 2, 3 * 8 + 64, 64, 4000, 2000, 50, 50 * 8)
    after = BatchShape(5, 3, 3 * 8 + 64 + 32, 64, 4300, 2000, 350, 50 * 8 + 300 * 32)
    assert BatchShape.of(batch) == before and before.plus(32, True, 300) == after

    def step(n, a, rank_sum, max_rank, context, longest):
        c = coefficients
        return (c["intercept"] + c["batch"] * n + c["adapters"] * a + c["batch_x_adapters"] * n * a
                + c["rank_sum"] * rank_sum + c["batch_x_max_rank"] * n * max_rank + c["context_tokens"] * context
                + c["padded_context"] * n * longest)

    prefill = coefficients["prefill_tokens"] * 300 + coefficients["prefill_rank_tokens"] * 300 * 32
    estimate = config.estimate(request, batch)
    decode_after = step(5, 3, 120, 64, 4300, 2000)
    assert estimate.decode_s == pytest.approx(decode_after)
    assert estimate.cost_s == pytest.approx(prefill / 100 + decode_after - step(4, 2, 88, 64, 4000, 2000))
    assert estimate.total_s == pytest.approx(estimate.cost_s * 4)
    # the request's adapter already in the batch adds no distinct adapter
    same = config.estimate(RouteRequest("a", 32, prompt_tokens=300), batch)
    assert estimate.decode_s - same.decode_s == pytest.approx(coefficients["adapters"] + 5 * coefficients["batch_x_adapters"])
    # unknown prompt length: the configured assumption
    assumed = RouteRequest("c", 32, prompt_tokens=config.prompt_tokens)
    assert config.estimate(RouteRequest("c", 32), batch) == config.estimate(assumed, batch) != estimate


def test_an_idle_server_costs_nobody_anything():
    estimate = RankAwareConfig().estimate(RouteRequest("a", 128), ServerBatch())
    assert estimate.requests == 0 and estimate.total_s == 0.0 and estimate.decode_s > 0


# ---- the paper's Fig. 6 example (notes §6.1) ----------------------------------------------------

# Inst1 runs 24 requests of rank 32, Inst2 16 of rank 64; a rank-64 request arrives.
INST1, INST2 = batch_of((32, 24), adapters=("a32",)), batch_of((64, 16), adapters=("a64",))
FIG6 = [Candidate("inst1", phi=0.5, batch=INST1), Candidate("inst2", phi=0.5, batch=INST2)]


@pytest.mark.parametrize("model, slo_s, expected", [
    (LatencyModel({"intercept": 33.5 * MS, "rank_sum": 0.00234375 * MS}), 36.0 * MS, "inst1"),  # MBGMV
    (LatencyModel({"intercept": 31.8 * MS, "batch_x_max_rank": MS / 256}), 36.1 * MS, "inst2"),  # BGMV
])
def test_fig6_routes_by_the_kernel_the_model_describes(model, slo_s, expected):
    config = RankAwareConfig(model, slo_tpot_s=slo_s, prompt_tokens=0)
    profile = make_profile("rank-aware", random.Random(0), rank_aware=config)
    assert set(pick_many(profile, RouteRequest("new", 64), FIG6, 50)) == {expected}
    # the other instance breaks the SLO: the filter alone already decides
    kept = SloFilter(config).filter(RouteRequest("new", 64), FIG6)
    assert [c.server_id for c in kept] == [expected]


def test_the_lowest_total_extra_latency_wins_and_idle_servers_tie_at_random():
    config = RankAwareConfig(LatencyModel({"intercept": 20 * MS, "batch": 0.1 * MS, "batch_x_max_rank": MS / 256}),
                             slo_tpot_s=1.0)
    profile = make_profile("rank-aware", random.Random(1), rank_aware=config)
    low = Candidate("low-ranks", phi=0.2, batch=batch_of((8, 10)))
    high = Candidate("high-ranks", phi=0.8, batch=batch_of((128, 10)))
    # a rank-128 request next to rank-8 ones would pad all ten of them to 128
    assert set(pick_many(profile, RouteRequest("x", 128), [low, high], 50)) == {"high-ranks"}
    assert set(pick_many(profile, RouteRequest("y", 8), [low, high], 50)) == {"low-ranks"}
    idle = [Candidate(f"idle{i}", phi=0.1, batch=ServerBatch()) for i in range(2)]
    counts = pick_many(profile, RouteRequest("x", 128), [low, high, *idle])
    assert set(counts) == {"idle0", "idle1"} and min(counts.values()) > 120


def test_servers_that_would_break_the_slo_are_excluded_even_when_cheapest():
    # A small step (1 ms) and the default SLO, 1.5x the batch's step without LoRA. A rank-8 request next
    # to a lone rank-128 one costs the fewest people (total 0.6 ms) but pads the step to 2.2 ms > 1.8 ms;
    # ten rank-8 requests elsewhere pay 1.3 ms together and their step stays within its SLO.
    config = RankAwareConfig(LatencyModel({"intercept": 1 * MS, "batch": 0.1 * MS, "batch_x_max_rank": MS / 256}))
    lone = Candidate("lone-rank-128", phi=0.5, batch=batch_of((128, 1)))
    busy = Candidate("ten-rank-8", phi=0.5, batch=batch_of((8, 10)))
    request = RouteRequest("x", 8, prompt_tokens=0)
    estimates = [config.estimate(request, c.batch) for c in (lone, busy)]
    assert [e.total_s / MS for e in estimates] == pytest.approx([0.6, 1.3125])
    assert [e.violates for e in estimates] == [True, False]
    assert RankAwareScorer(config).score(request, [lone, busy]) == [1.0, 0.0]
    profile = make_profile("rank-aware", random.Random(2), rank_aware=config)
    assert set(pick_many(profile, request, [lone, busy], 50)) == {"ten-rank-8"}


def test_when_every_server_would_break_the_slo_the_request_goes_where_it_hurts_least():
    config = RankAwareConfig(LatencyModel({"intercept": 20 * MS, "batch": 0.1 * MS, "batch_x_max_rank": MS / 256}),
                             slo_tpot_s=5 * MS)  # below even an idle server's step
    candidates = [Candidate("mixed", phi=0.5, batch=batch_of((8, 30))),
                  Candidate("same-rank", phi=0.5, batch=batch_of((128, 30))),
                  Candidate("idle", phi=0.0, batch=ServerBatch())]
    request = RouteRequest("x", 128, prompt_tokens=0)
    assert all(config.estimate(request, c.batch).violates for c in candidates)
    assert SloFilter(config).filter(request, candidates) == candidates  # nothing dropped, no NaN
    profile = make_profile("rank-aware", random.Random(3), rank_aware=config)
    assert set(pick_many(profile, request, candidates[:2], 30)) == {"same-rank"}
    assert profile.pick(request, candidates).server_id in {"same-rank", "mixed"}  # φ = 0: not assigned


def test_the_default_slo_is_relative_to_the_same_batch_without_lora():
    model = LatencyModel({"intercept": 20 * MS, "batch": 0.1 * MS, "rank_sum": 0.01 * MS})
    config = RankAwareConfig(model)  # 1.5 x the no-LoRA step of the batch with the request
    estimate = config.estimate(RouteRequest("x", 64, 0), batch_of((64, 9)))
    assert estimate.slo_s == pytest.approx(1.5 * (20 + 0.1 * 10) * MS)
    assert estimate.decode_s == pytest.approx((20 + 1 + 0.01 * 640) * MS)


# ---- degrading to φ routing ---------------------------------------------------------------------


def test_without_live_batches_rank_aware_routes_by_phi():
    profile = make_profile("rank-aware", random.Random(4))
    fresh = Candidate("fresh", phi=0.2, batch=ServerBatch())  # idle: rank-aware alone would always pick it
    stale = Candidate("stale", phi=0.8, batch=None)
    counts = pick_many(profile, RouteRequest("x", 8), [fresh, stale], 2000)
    assert counts["stale"] / 2000 == pytest.approx(0.8, abs=0.04)
    # a candidate the filters drop anyway does not force the fallback
    unhealthy = Candidate("down", healthy=False, phi=0.8, batch=None)
    assert set(pick_many(profile, RouteRequest("x", 8), [fresh, unhealthy], 50)) == {"fresh"}
    assert profile.reads_load and profile.reads_batch and not make_profile("loraserve").reads_batch


def test_without_a_fallback_a_server_without_batch_is_kept_and_ranked_last():
    config = RankAwareConfig()
    unknown, known = Candidate("unknown"), Candidate("known", batch=batch_of((8, 3)))
    assert SloFilter(config).filter(RouteRequest("x", 8), [unknown, known]) == [unknown, known]
    assert RankAwareScorer(config).score(RouteRequest("x", 8), [unknown, known]) == [0.0, 1.0]
    assert RankAwareScorer(config).score(RouteRequest("x", 8), [unknown]) == [1.0]


# ---- configuration ----------------------------------------------------------------------------


def test_options_configure_the_model_and_the_slo(tmp_path):
    config = RankAwareConfig.from_options(parse_options(["latency_profile=cpu-tiny", "slo_tpot_s=0.05",
                                                         "avg_output_tokens=200", "prompt_tokens=64"]))
    assert config.model.name == "cpu-tiny" and "loads" not in config.model.coefficients
    assert (config.slo_tpot_s, config.avg_output_tokens, config.prompt_tokens) == (0.05, 200.0, 64)
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps({"name": "mine", "coefficients": {"intercept": 0.02, "rank_sum": 1e-6}}))
    assert LatencyModel.load(str(path)) == LatencyModel({"intercept": 0.02, "rank_sum": 1e-6}, "mine")
    for bad, match in ((["speed=1"], "unknown rank-aware options"), (["slo_tpot_s=fast"], "not a number"),
                       (["latency_profile=nowhere"], "not found"), (["slo_tpot_s=-1"], "positive")):
        with pytest.raises(ValueError, match=match):
            RankAwareConfig.from_options(parse_options(bad))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options(["no-equals"])
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a latency profile"):
        LatencyModel.load(str(path))


# ---- the batch a heartbeat carries -------------------------------------------------------------


def test_a_batch_aggregates_requests_by_rank_and_round_trips_in_the_heartbeat():
    batch = ServerBatch.from_requests([(16, "b", 0, 300), (8, "a", 100, 100), (16, "c", 0, 500), (0, None, 5, 5)])
    assert batch.ranks == (RankLoad(0, 1, 5), RankLoad(8, 1, 100), RankLoad(16, 2, 0))
    assert (batch.adapters, batch.context_tokens, batch.max_context, batch.requests) == (("a", "b", "c"), 905, 500, 4)
    record = ServerRecord("s0", "http://s0", 64, heartbeat_at=10.0, batch=batch)
    doc = json.loads(record.to_json())
    assert doc["batch"]["ranks"] == [[0, 1, 5], [8, 1, 100], [16, 2, 0]]
    assert ServerRecord.from_json(record.to_json()) == record
    old = json.loads(ServerRecord("s1", "http://s1", 64).to_json())
    del old["batch"]
    assert ServerRecord.from_json(json.dumps(old)).batch is None  # agents that do not report one
    doc["batch"]["ranks"] = [[8, -1, 0]]
    with pytest.raises(RecordError, match="non-negative"):
        ServerRecord.from_json(json.dumps(doc))


def test_requests_a_router_sent_since_the_heartbeat_join_the_batch_at_its_mean_rank():
    batch = ServerBatch((RankLoad(8, 2, 0), RankLoad(64, 2, 0)), ("a", "b"), 400, 150)
    assert batch.with_open_requests(3) is batch  # nothing newer than the heartbeat
    grown = batch.with_open_requests(6)
    assert grown.ranks == (RankLoad(8, 2, 0), RankLoad(36, 2, 0), RankLoad(64, 2, 0))
    assert grown.context_tokens == 600 and grown.requests == 6
    assert ServerBatch().with_open_requests(2).ranks == (RankLoad(0, 2, 0),)


def test_the_snapshot_offers_fresh_batches_only_with_the_routers_own_requests_added():
    fresh = ServerRecord("fresh", "http://fresh", 64, heartbeat_at=98.0, batch=batch_of((8, 1)))
    stale = ServerRecord("stale", "http://stale", 64, heartbeat_at=90.0, batch=batch_of((8, 1)))
    old_agent = ServerRecord("old", "http://old", 64, heartbeat_at=99.0)
    snapshot = Snapshot(None, {s.id: s for s in (fresh, stale, old_agent)}, {}, taken_at=100.0, batch_max_age_s=5.0)
    by_id = {c.server_id: c for c in snapshot.candidates("a", set(), {"fresh": 3, "stale": 3})}
    assert by_id["fresh"].batch.requests == 3 and by_id["fresh"].queue_depth == 3
    assert by_id["stale"].batch is None and by_id["old"].batch is None
    assert snapshot.route_request("a", prompt_tokens=77) == RouteRequest("a", None, 77)


def test_the_agent_reports_its_open_requests_by_rank():
    def request(rid, adapter, status, prompt, computed, outputs=0):
        r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=8),
                    adapter=AdapterId(adapter, "sha256:x") if adapter else None, status=status,
                    num_computed_tokens=computed)
        r.output_token_ids.extend([1] * outputs)
        return r

    requests = [request("1", "sql", RequestStatus.RUNNING, 100, 103, 4),
                request("2", "sql", RequestStatus.WAITING, 50, 0),
                request("3", "chat", RequestStatus.RUNNING, 20, 10),
                request("4", None, RequestStatus.RUNNING, 10, 10, 1),
                request("5", "chat", RequestStatus.FINISHED, 10, 10, 8)]
    batch = open_batch(requests, {"sql": 16, "chat": 64})
    assert batch.ranks == (RankLoad(0, 1, 0), RankLoad(16, 2, 50), RankLoad(64, 1, 10))
    assert batch.adapters == ("chat", "sql") and batch.context_tokens == 104 + 50 + 20 + 11


def test_every_routing_profile_can_be_chosen_in_the_helm_chart():
    schema = json.loads((Path(__file__).parents[2] / "helm/loraplex/values.schema.json").read_text())
    assert set(schema["properties"]["router"]["properties"]["profile"]["enum"]) == set(PROFILES)
