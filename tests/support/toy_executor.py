"""A torch-free executor for scheduler and memory tests. Like the real one it keeps KV in pages:
each page holds, per position, the token and the adapter whose weights computed it. Every chunk
must find its earlier positions filled in its block table's pages, by its own adapter, so a stale,
shared-across-adapters or missing block is caught; the sampled token depends on the whole sequence,
so any scheduling mistake (lost tokens, wrong positions, wrong prefix) changes the output.
Background copies (adapter loads, KV swap-ins) finish one step after they were issued."""

from __future__ import annotations

from loraplex.engine.messages import NO_ADAPTER_SLOT, ExecutorResult, SchedulerOutput
from loraplex.engine.request import SampledToken

Entry = tuple[str, int]  # (adapter name or '' for the base model, token id)


class ToyExecutor:
    def __init__(self, block_size: int, vocab: int = 1000, eos: int | None = None) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.eos = eos
        self.pages: dict[int, list[Entry | None]] = {}
        self.host: dict[int, list[Entry | None]] = {}
        self.slots: dict[int, str] = {}  # handle -> adapter name, once its weights are on the device
        self.adapter_pages: dict[int, list[int]] = {}
        self._in_flight: list[tuple[int, object]] = []
        self.steps: list[SchedulerOutput] = []

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        self.steps.append(output)
        done = self._finish_copies()
        for copy in output.kv_swap_out:
            self.host[copy.host_page] = list(self.pages.get(copy.device_page, []))
        for slot in output.adapter_evictions:
            self.slots.pop(slot, None)
            self.adapter_pages.pop(slot, None)
        for load in output.adapter_loads:
            if load.asynchronous:
                self._in_flight.append((load.job, load))
            else:
                self._land(load)
        for swap in output.kv_swap_in:
            self._in_flight.append((swap.job, swap))
        sampled = {chunk.request_id: token for chunk in output.chunks if (token := self._run(chunk)) is not None}
        return ExecutorResult(sampled=sampled, copies_done=done)

    def _finish_copies(self) -> list[int]:
        done = []
        for job, work in self._in_flight:
            if hasattr(work, "copies"):
                for copy in work.copies:
                    self.pages[copy.device_page] = list(self.host[copy.host_page])
            else:
                self._land(work)
            done.append(job)
        self._in_flight = []
        return done

    def _land(self, load) -> None:
        self.adapter_pages.pop(load.slot, None)  # a load into an occupied slot replaces its adapter
        taken = {p for pages in self.adapter_pages.values() for p in pages}
        assert not taken & set(load.pages), "adapter pages given twice"
        self.slots[load.slot] = load.adapter.name
        self.adapter_pages[load.slot] = list(load.pages)
        for page in load.pages:
            self.pages[page] = [("weights", 0)] * self.block_size  # KV written here later must overwrite

    def _run(self, chunk) -> SampledToken | None:
        bs = self.block_size
        adapter = ""
        if chunk.adapter_slot != NO_ADAPTER_SLOT:
            assert chunk.adapter_slot in self.slots, "adapter used before its weights were loaded"
            adapter = self.slots[chunk.adapter_slot]
        weights = {p for pages in self.adapter_pages.values() for p in pages}
        assert not weights & set(chunk.block_ids), "a KV block sits in an adapter's pages"
        end = chunk.start_position + chunk.num_tokens
        assert len(chunk.block_ids) * bs >= end, "block table too small"
        seq = []
        for position in range(chunk.start_position):
            entry = self.pages.get(chunk.block_ids[position // bs], [None] * bs)[position % bs]
            assert entry is not None and entry[0] == adapter, f"position {position}: KV {entry} is not {adapter}'s"
            seq.append(entry[1])
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.start_position + offset
            page = self.pages.setdefault(chunk.block_ids[position // bs], [None] * bs)
            page[position % bs] = (adapter, token)
            seq.append(token)
        if not chunk.sample:
            return None
        salt = hash(adapter) if adapter else 0
        return SampledToken((sum(seq) * 31 + len(seq) + salt) % self.vocab)
