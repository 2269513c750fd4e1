import pytest

from loraplex.routing import AdapterRecord, PoolKeys, RecordError, ServerLoad, ServerRecord
from loraplex.routing.demand import DemandWindows, bucket_of, complete_buckets


def test_server_record_round_trip():
    record = ServerRecord("pool-0", "http://10.0.0.1:8000", 64, "tiny", ("cpu-assist",), ServerLoad(2, 3, 0.5),
                          ("a",), ("a", "b"), 1700000000.0)
    assert ServerRecord.from_json(record.to_json()) == record


def test_server_record_block_size_round_trips_and_defaults_to_unknown():
    record = ServerRecord("s", "http://x", 8, block_size=32)
    assert ServerRecord.from_json(record.to_json()).block_size == 32
    older = record.to_json().replace(',"block_size":32', "")  # an agent from before block sizes
    assert "block_size" not in older and ServerRecord.from_json(older).block_size == 0


@pytest.mark.parametrize("record", [
    ServerRecord("bad id", "http://x", 8),
    ServerRecord("s", "ftp://x", 8),
    ServerRecord("s", "http://x", 0),
    ServerRecord("s", "http://x", 8, block_size=-1),
])
def test_server_record_validation(record):
    with pytest.raises(RecordError):
        record.validate()


def test_adapter_record_round_trip_keeps_locations_apart():
    record = AdapterRecord("sql", "sha256:ab", 16, 1024, "file:///a", ("q_proj",), "tiny", 50.0, frozenset({"s1"}))
    assert "locations" not in record.to_json()
    assert AdapterRecord.from_json(record.to_json(), frozenset({"s1"})) == record


@pytest.mark.parametrize("text", ["[]", '{"name": "x"}', '{"name": "a b", "digest": "sha256:x", "rank": 8, '
                                  '"size_bytes": 1, "source": "file:///x"}'])
def test_adapter_record_rejects_malformed(text):
    with pytest.raises(RecordError):
        AdapterRecord.from_json(text)


def test_adapter_record_rules():
    with pytest.raises(RecordError, match="digest"):
        AdapterRecord("a", "md5:x", 8, 1, "file:///a").validate()
    with pytest.raises(RecordError, match="source"):
        AdapterRecord("a", "sha256:x", 8, 1, "").validate()


def test_keys_share_a_hash_tag():
    keys = PoolKeys("llama")
    assert keys.snapshot == "loraplex:{llama}:table:snapshot"
    assert keys.current_version.startswith("loraplex:{llama}:")
    assert keys.demand(7) == "loraplex:{llama}:demand:7"
    with pytest.raises(ValueError, match="pool name"):
        PoolKeys("Bad_Pool")


def test_demand_buckets_and_rates():
    assert bucket_of(25.0, 10.0) == 2
    assert complete_buckets(25.0, 10.0, 3) == [-1, 0, 1]
    windows = DemandWindows.from_counts(10.0, [{"a": 100}, {}, {"a": 50, "b": 10}])
    assert windows.rates == {"a": (10.0, 0.0, 5.0), "b": (0.0, 0.0, 1.0)}
    assert windows.mean_tps("a") == pytest.approx(5.0)
    assert windows.mean_tps("zzz") == 0.0
