"""The dependency tree: each operation on its own, then random operation streams that must keep
I1-I5, exact page accounting, and KV that never crosses adapters, digests or prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from loraplex.engine.memory.dependency_tree import DependencyTree, NodeKind, Released, Tier, TreeNode
from loraplex.engine.memory.page_pool import PageKind
from loraplex.spec.adapter import AdapterId
from loraplex.util.clock import ManualClock

A1 = AdapterId("a", "sha256:1111")
A2 = AdapterId("a", "sha256:2222")  # the same name uploaded again with other weights
B = AdapterId("b", "sha256:3333")


def make_tree(block_size: int = 2) -> tuple[DependencyTree, ManualClock]:
    clock = ManualClock()
    return DependencyTree(block_size, clock), clock


def loaded(tree: DependencyTree, adapter: AdapterId, pages: Sequence[int]) -> TreeNode:
    node = tree.add_adapter(adapter, len(pages))
    tree.begin_load(node, pages)
    tree.finish_load(node)
    return node


# ---- adapters -----------------------------------------------------------------------------------


def test_base_node_exists_on_device_and_is_never_evictable():
    tree, _ = make_tree()
    assert tree.adapter_node(None) is tree.base
    assert tree.base.tier is Tier.DEVICE
    assert tree.evictable_device_leaves() == [] and tree.swap_in_candidates() == []
    with pytest.raises(ValueError):
        tree.set_pinned(tree.base, False)
    with pytest.raises(ValueError):
        tree.remove_adapter(None)  # type: ignore[arg-type]
    tree.check_invariants()


def test_adapter_lifecycle_host_loading_device_host():
    tree, _ = make_tree()
    node = tree.add_adapter(A1, 2)
    assert node.tier is Tier.HOST and tree.swap_in_candidates() == [node]
    with pytest.raises(ValueError):
        tree.begin_load(node, [1])  # wrong size
    tree.begin_load(node, [1, 2])
    assert node.tier is Tier.LOADING and tree.swap_in_candidates() == []
    assert tree.device_pages_by_kind() == {PageKind.ADAPTER: 2, PageKind.KV: 0}
    assert tree.num_device_adapters == 0  # not usable until the copy lands
    tree.finish_load(node)
    assert tree.num_device_adapters == 1 and tree.evictable_device_leaves() == [node]
    assert tree.evict_adapter(node) == [1, 2]
    assert node.tier is Tier.HOST and tree.num_device_adapters == 0
    tree.check_invariants()


def test_adding_an_adapter_twice_is_refused_but_two_digests_are_two_nodes():
    tree, _ = make_tree()
    first = tree.add_adapter(A1, 1)
    with pytest.raises(ValueError):
        tree.add_adapter(A1, 1)
    second = tree.add_adapter(A2, 1)
    assert first is not second and len(tree.adapter_nodes()) == 3


def test_pinned_adapter_is_not_evictable():
    tree, _ = make_tree()
    node = loaded(tree, A1, [1])
    tree.set_pinned(node, True)
    assert tree.evictable_device_leaves() == []
    with pytest.raises(ValueError):
        tree.evict_adapter(node)
    tree.set_pinned(node, False)
    assert tree.evictable_device_leaves() == [node]


def test_adapter_leaves_device_only_after_its_device_kv():
    tree, _ = make_tree()
    node = loaded(tree, A1, [1])
    tree.insert(A1, [1, 2], [10])
    block = tree.match(A1, [1, 2]).last
    assert tree.evictable_device_leaves() == [block]
    with pytest.raises(ValueError):
        tree.evict_adapter(node)
    tree.swap_out(block, 100)
    assert tree.evictable_device_leaves() == [node]
    assert tree.evict_adapter(node) == [1]
    assert tree.swap_in_candidates() == [node]  # the host block's parent is no longer on the device
    tree.check_invariants()


def test_remove_adapter_returns_every_page_and_refuses_while_locked():
    tree, _ = make_tree()
    loaded(tree, A1, [1, 2])
    tree.insert(A1, [1, 2, 3, 4], [10, 11])
    tree.swap_out(tree.match(A1, [1, 2, 3, 4]).last, 100)
    match = tree.match(A1, [1, 2])
    tree.lock(match.last)
    with pytest.raises(ValueError):
        tree.remove_adapter(A1)
    tree.unlock(match.last)
    released = tree.remove_adapter(A1)
    assert sorted(released.device_pages) == [1, 2, 10] and released.host_pages == [100]
    assert tree.adapter_node(A1) is None and not match.last.attached
    with pytest.raises(ValueError):
        tree.lock(match.last)  # a stale handle changes nothing
    tree.check_invariants()


def test_readded_adapter_never_matches_old_kv():
    tree, _ = make_tree()
    loaded(tree, A1, [1])
    tree.insert(A1, [1, 2, 3, 4], [10, 11])
    tree.remove_adapter(A1)
    loaded(tree, A2, [1])
    assert tree.match(A2, [1, 2, 3, 4]).blocks == []
    loaded(tree, A1, [2])  # even the very same id starts empty once removed
    assert tree.match(A1, [1, 2, 3, 4]).blocks == []


# ---- match and insert ---------------------------------------------------------------------------


def test_match_walks_full_blocks_and_counts_visits():
    tree, clock = make_tree(block_size=2)
    tree.insert(None, [1, 2, 3, 4, 5], [10, 11, 12])  # the page of the partial block is ignored
    clock.advance(3.0)
    match = tree.match(None, [1, 2, 3, 4, 9])
    assert [b.key for b in match.blocks] == [(1, 2), (3, 4)] and match.num_tokens == 4
    assert [b.visits for b in match.blocks] == [2, 2] and tree.base.visits == 1
    assert all(n.last_access == 3.0 for n in (tree.base, *match.blocks))
    assert tree.match(None, [1, 3]).blocks == [] and tree.match(None, [1]).last is tree.base


def test_kv_is_never_shared_across_adapters_or_digests():
    tree, _ = make_tree()
    for adapter, page in ((A1, 1), (A2, 2), (B, 3)):
        loaded(tree, adapter, [page])
    tree.insert(A1, [7, 7], [10])
    assert tree.match(A2, [7, 7]).blocks == [] and tree.match(B, [7, 7]).blocks == []
    assert tree.match(None, [7, 7]).blocks == []
    assert tree.insert(A2, [7, 7], [20]).unadopted == []  # its own copy, not a duplicate
    assert tree.match(A1, [7, 7]).last is not tree.match(A2, [7, 7]).last


def test_an_activated_loras_blocks_from_its_start_depend_on_it_and_on_where_it_started():
    """From the block holding `start` on, an aLoRA's KV hangs below its adapter (I1: it leaves the
    device before the adapter does); its first block is keyed by `start` and the whole prefix."""
    tree, _ = make_tree(block_size=2)
    node = loaded(tree, A1, [1])
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    tree.insert(None, tokens[:2], [10])  # block 0: before the start, the base model's
    assert tree.insert(A1, tokens, [11, 12, 13], start=3).unadopted == []  # blocks 1-3
    assert [b.key for b in tree.match(A1, tokens, start=3).blocks] == [(3, 1, 2, 3, 4), (5, 6), (7, 8)]
    assert tree.match(A1, tokens, start=2).blocks == []  # the delta started elsewhere in block 1
    assert tree.match(A1, [9, 2, 3, 4, 5, 6], start=3).blocks == []  # another prefix before it
    loaded(tree, A2, [2])  # the same name with other weights
    assert tree.match(A2, tokens, start=3).blocks == [] and tree.match(None, tokens).num_tokens == 2
    assert tree.match(A1, tokens[:2], start=3).blocks == []  # nothing from block 1 on in these tokens
    with pytest.raises(ValueError):
        tree.evict_adapter(node)
    tree.check_invariants()
    released = tree.remove_adapter(A1)  # an unload (or a new digest) takes its blocks, not the base's
    assert sorted(released.device_pages) == [1, 11, 12, 13] and tree.match(None, tokens).num_tokens == 2
    tree.check_invariants()


def test_insert_returns_duplicate_pages_and_keeps_its_own():
    tree, _ = make_tree()
    tree.insert(None, [1, 2, 3, 4], [10, 11])
    # a second request computed block 0 again (page 20) but shares block 1's page and adds block 2
    inserted = tree.insert(None, [1, 2, 3, 4, 5, 6], [20, 11, 12])
    assert inserted.unadopted == [20]
    assert inserted.last.key == (5, 6) and inserted.last.device_pages == [12]
    assert tree.device_pages_by_kind()[PageKind.KV] == 3
    tree.check_invariants()


def test_insert_refuses_pages_the_tree_holds_elsewhere_and_changes_nothing():
    tree, _ = make_tree()
    tree.insert(None, [1, 2], [10])
    with pytest.raises(ValueError):
        tree.insert(None, [5, 6, 7, 8], [30, 10])
    with pytest.raises(ValueError):
        tree.insert(None, [5, 6, 7, 8], [30, 30])
    with pytest.raises(ValueError):
        tree.insert(None, [5, 6, 7, 8], [30])  # too few pages
    assert tree.match(None, [5, 6]).blocks == []
    tree.check_invariants()


def test_insert_never_adopts_below_a_node_off_the_device():
    tree, _ = make_tree()
    tree.add_adapter(A1, 1)  # on the host
    inserted = tree.insert(A1, [1, 2], [10])
    assert inserted.unadopted == [10] and inserted.last is tree.adapter_node(A1)
    tree.insert(None, [1, 2], [11])
    tree.swap_out(tree.match(None, [1, 2]).last, 100)
    inserted = tree.insert(None, [1, 2, 3, 4], [12, 13])
    assert inserted.unadopted == [12, 13] and inserted.last.tier is Tier.HOST
    tree.check_invariants()


def test_insert_keeps_pages_of_a_loading_chain_it_already_holds():
    tree, _ = make_tree()
    tree.insert(None, [1, 2], [10])
    block = tree.match(None, [1, 2]).last
    tree.swap_out(block, 100)
    tree.begin_swap_in(block, 11)
    inserted = tree.insert(None, [1, 2, 3, 4], [11, 12])  # page 11 is the tree's: not to be freed
    assert inserted.unadopted == [12]
    tree.check_invariants()


# ---- locks --------------------------------------------------------------------------------------


def test_lock_counts_on_the_whole_path_and_blocks_eviction():
    tree, _ = make_tree()
    tree.insert(None, [1, 2, 3, 4], [10, 11])
    top, leaf = tree.match(None, [1, 2, 3, 4]).blocks
    tree.lock(leaf)
    tree.lock(leaf)
    assert (leaf.lock_ref, top.lock_ref, tree.base.lock_ref, tree.root.lock_ref) == (2, 2, 2, 2)
    assert tree.evictable_device_leaves() == []
    for operation in (lambda: tree.swap_out(leaf, 100), lambda: tree.drop(top)):
        with pytest.raises(ValueError):
            operation()
    tree.unlock(leaf)
    tree.unlock(leaf)
    assert tree.evictable_device_leaves() == [leaf]
    with pytest.raises(ValueError):
        tree.unlock(leaf)
    tree.check_invariants()


# ---- tiers --------------------------------------------------------------------------------------


def test_swap_out_only_from_device_leaves():
    tree, _ = make_tree()
    tree.insert(None, [1, 2, 3, 4], [10, 11])
    top, leaf = tree.match(None, [1, 2, 3, 4]).blocks
    with pytest.raises(ValueError):
        tree.swap_out(top, 100)  # I2: its child is still on the device
    assert tree.swap_out(leaf, 100) == 11
    assert tree.evictable_device_leaves() == [top] and tree.swap_in_candidates() == [leaf]
    with pytest.raises(ValueError):
        tree.swap_out(top, 100)  # host page already held
    assert tree.swap_out(top, 101) == 10
    assert tree.swap_in_candidates() == [top] and tree.num_host_pages == 2
    tree.check_invariants()


def test_swap_in_goes_top_down_and_may_chain_behind_a_loading_parent():
    tree, _ = make_tree()
    tree.insert(None, [1, 2, 3, 4], [10, 11])
    top, leaf = tree.match(None, [1, 2, 3, 4]).blocks
    tree.swap_out(leaf, 100)
    tree.swap_out(top, 101)
    with pytest.raises(ValueError):
        tree.begin_swap_in(leaf, 20)  # I3: its parent is on the host
    tree.begin_swap_in(top, 20)
    tree.begin_swap_in(leaf, 21)  # issued behind its parent's copy
    with pytest.raises(ValueError):
        tree.finish_swap_in(leaf)  # usable only once the parent is
    assert tree.finish_swap_in(top) == 101
    assert tree.finish_swap_in(leaf) == 100
    assert tree.match(None, [1, 2, 3, 4]).missing() == []
    assert tree.num_host_pages == 0 and tree.device_pages_by_kind()[PageKind.KV] == 2
    tree.check_invariants()


def test_match_reports_what_is_missing_top_down():
    tree, _ = make_tree()
    node = loaded(tree, A1, [1])
    tree.insert(A1, [1, 2, 3, 4], [10, 11])
    top, leaf = tree.match(A1, [1, 2, 3, 4]).blocks
    tree.swap_out(leaf, 100)
    tree.swap_out(top, 101)
    tree.evict_adapter(node)
    assert tree.match(A1, [1, 2, 3, 4]).missing() == [node, top, leaf]


def test_drop_returns_pages_of_every_tier_in_the_subtree():
    tree, _ = make_tree()
    tree.insert(None, [1, 2, 3, 4], [10, 11])
    tree.insert(None, [1, 2, 5, 6], [10, 12])
    top = tree.match(None, [1, 2]).last
    side = tree.match(None, [1, 2, 5, 6]).last
    tree.swap_out(side, 100)
    tree.begin_swap_in(side, 13)
    released = tree.drop(top)
    assert sorted(released.device_pages) == [10, 11, 13] and released.host_pages == [100]
    assert tree.base.children == {} and tree.device_pages_by_kind()[PageKind.KV] == 0
    with pytest.raises(ValueError):
        tree.drop(tree.base)  # adapters go through remove_adapter
    tree.check_invariants()


# ---- random operation streams -------------------------------------------------------------------

T = TypeVar("T")
ADAPTERS = [A1, A2, B, AdapterId("c", "sha256:4444")]
TOKENS = st.lists(st.integers(0, 1), max_size=8)  # two token values: prefixes collide often
PICK = st.integers(0, 10_000)


def pick(items: Sequence[T], index: int) -> T | None:
    return items[index % len(items)] if items else None


class TreeMachine(RuleBasedStateMachine):
    """Drives the tree like a memory manager would, with fresh page ids from two counters."""

    def __init__(self) -> None:
        super().__init__()
        self.tree, self.clock = make_tree(block_size=2)
        self.next_device, self.next_host = 0, 0
        self.device_given: set[int] = set()
        self.host_given: set[int] = set()
        self.device_back: list[int] = []
        self.host_back: list[int] = []
        self.locks: list[TreeNode] = []
        # page -> the (adapter, prefix) whose KV it holds
        self.device_kv: dict[int, tuple[AdapterId | None, tuple[int, ...]]] = {}
        self.host_kv: dict[int, tuple[AdapterId | None, tuple[int, ...]]] = {}

    @initialize(tokens=st.lists(TOKENS, max_size=3))
    def warm_start(self, tokens: list[list[int]]) -> None:
        """Some history KV from the start, so that swaps happen within a short run."""
        for prompt in tokens:
            self.insert(0, prompt)  # index 0: the base model's node

    def device_page(self) -> int:
        self.next_device += 1
        self.device_given.add(self.next_device)
        return self.next_device

    def host_page(self) -> int:
        self.next_host += 1
        self.host_given.add(self.next_host)
        return self.next_host

    def blocks(self, tier: Tier | None = None) -> list[TreeNode]:
        return [n for n in self.tree.nodes() if n.kind is NodeKind.BLOCK and tier in (None, n.tier)]

    def present(self, index: int) -> AdapterId | None:
        return pick([n.key for n in self.tree.adapter_nodes()], index)

    @rule(index=PICK, size=st.integers(0, 3), pinned=st.booleans(), load=st.booleans())
    def add_adapter(self, index: int, size: int, pinned: bool, load: bool) -> None:
        adapter = pick(ADAPTERS, index)
        if self.tree.adapter_node(adapter) is not None:
            return
        node = self.tree.add_adapter(adapter, size, pinned=pinned)
        assert self.tree.match(adapter, [0, 0, 1, 1]).blocks == []  # fresh, even if re-added
        if load:
            self.tree.begin_load(node, [self.device_page() for _ in range(size)])
            self.tree.finish_load(node)

    @rule(index=PICK, tokens=TOKENS)
    def swap_in_matched_chain(self, index: int, tokens: list[int]) -> None:
        """The on-demand path: start every missing copy of a matched chain at once, top-down."""
        for node in self.tree.match(self.present(index), tokens).missing():
            if node.tier is not Tier.HOST:
                continue
            if node.kind is NodeKind.ADAPTER:
                self.tree.begin_load(node, [self.device_page() for _ in range(node.size)])
            else:
                self.begin_block_swap_in(node)

    @rule(index=PICK)
    def finish_a_copy(self, index: int) -> None:
        node = pick([n for n in self.tree.nodes() if n.tier is Tier.LOADING], index)
        if node is None:
            return
        if node.kind is NodeKind.ADAPTER:
            self.tree.finish_load(node)
        elif node.parent.tier is not Tier.DEVICE:
            with pytest.raises(ValueError):
                self.tree.finish_swap_in(node)
        else:
            self.host_back.append(self.tree.finish_swap_in(node))

    @rule(index=PICK)
    def remove_adapter(self, index: int) -> None:
        node = self.tree.adapter_node(self.present(index))
        if node.is_base:
            return
        if node.lock_ref:
            with pytest.raises(ValueError):
                self.tree.remove_adapter(node.key)
            return
        self.give_back(self.tree.remove_adapter(node.key))

    @rule(index=PICK, tokens=TOKENS, keep=st.booleans())
    def match_and_lock(self, index: int, tokens: list[int], keep: bool) -> None:
        adapter = self.present(index)
        match = self.tree.match(adapter, tokens)
        assert match.adapter.key == adapter and all(self.adapter_of(b) is match.adapter for b in match.blocks)
        self.tree.lock(match.last)
        self.locks.append(match.last)
        if not keep:  # a short request: it finishes before the next step
            self.tree.unlock(self.locks.pop())

    @rule(index=PICK, tokens=TOKENS)
    def insert(self, index: int, tokens: list[int]) -> None:
        """Like a finished prefill: matched device blocks keep their page, the rest got fresh ones."""
        adapter = self.present(index)
        match = self.tree.match(adapter, tokens)
        pages = [b.device_pages[0] for b in match.blocks if b.tier is Tier.DEVICE]
        pages += [self.device_page() for _ in range(len(tokens) // 2 - len(pages))]
        for i, page in enumerate(pages):
            self.device_kv.setdefault(page, (adapter, tuple(tokens[:2 * (i + 1)])))
        inserted = self.tree.insert(adapter, tokens, pages)
        self.device_back += inserted.unadopted
        assert not set(inserted.unadopted) & set(self.tree._device_owner)

    @rule(index=PICK)
    def unlock(self, index: int) -> None:
        if self.locks:
            self.tree.unlock(self.locks.pop(index % len(self.locks)))

    @rule(index=PICK)
    def evict_one(self, index: int) -> None:
        node = pick(self.tree.evictable_device_leaves(), index)
        if node is None:
            return
        if node.kind is NodeKind.ADAPTER:
            self.device_back += self.tree.evict_adapter(node)
            return
        host = self.host_page()
        self.host_kv[host] = self.device_kv[node.device_pages[0]]
        self.device_back.append(self.tree.swap_out(node, host))

    @rule(index=PICK)
    def illegal_swap_out_is_refused(self, index: int) -> None:
        evictable = set(self.tree.evictable_device_leaves())
        node = pick([b for b in self.blocks() if b not in evictable], index)
        if node is not None:
            with pytest.raises(ValueError):
                self.tree.swap_out(node, self.next_host + 1_000_000)

    @rule(index=PICK)
    def begin_swap_in(self, index: int) -> None:
        node = pick(self.blocks(Tier.HOST), index)
        if node is None:
            return
        if node.parent.tier is Tier.HOST:
            with pytest.raises(ValueError):
                self.tree.begin_swap_in(node, self.next_device + 1_000_000)
            return
        self.begin_block_swap_in(node)

    def begin_block_swap_in(self, node: TreeNode) -> None:
        page = self.device_page()
        self.device_kv[page] = self.host_kv[node.host_page]
        self.tree.begin_swap_in(node, page)

    @rule(index=PICK)
    def drop(self, index: int) -> None:
        node = pick(self.blocks(), index)
        if node is None:
            return
        if node.lock_ref:
            with pytest.raises(ValueError):
                self.tree.drop(node)
            return
        self.give_back(self.tree.drop(node))

    def give_back(self, released: Released) -> None:
        self.device_back += released.device_pages
        self.host_back += released.host_pages

    def adapter_of(self, node: TreeNode) -> TreeNode:
        while node.kind is NodeKind.BLOCK:
            node = node.parent
        return node

    def prefix_of(self, node: TreeNode) -> tuple[int, ...]:
        keys: list[tuple[int, ...]] = []
        while node.kind is NodeKind.BLOCK:
            keys.append(node.key)
            node = node.parent
        return tuple(token for key in reversed(keys) for token in key)

    @invariant()
    def tree_invariants_hold(self) -> None:
        self.tree.check_invariants()

    @invariant()
    def locked_nodes_are_never_evictable(self) -> None:
        evictable = set(self.tree.evictable_device_leaves())
        for node in self.locks:
            while node is not None:
                assert node not in evictable
                node = node.parent

    @invariant()
    def pages_are_accounted_exactly(self) -> None:
        nodes = list(self.tree.nodes())
        held_device = [p for n in nodes for p in n.device_pages]
        held_host = [n.host_page for n in nodes if n.host_page is not None]
        assert sorted(held_device + self.device_back) == sorted(self.device_given)
        assert sorted(held_host + self.host_back) == sorted(self.host_given)

    @invariant()
    def every_block_holds_kv_of_its_own_adapter_and_prefix(self) -> None:
        for node in self.blocks():
            expected = (self.adapter_of(node).key, self.prefix_of(node))
            if node.device_pages:
                assert self.device_kv[node.device_pages[0]] == expected
            if node.host_page is not None:
                assert self.host_kv[node.host_page] == expected


TreeMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_random_operation_streams = TreeMachine.TestCase
