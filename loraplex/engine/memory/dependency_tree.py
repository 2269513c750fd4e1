"""FastLibra's dependency tree: adapters and the KV blocks computed with them, as one trie.

A virtual root has one child per adapter (and one for the base model, key None); below each adapter
node hangs a trie of full KV blocks, keyed by their token ids. A block's KV depends on its adapter
and on every block before it, so a node is only usable on the device when its whole path is: the
operations keep the device-resident part of the tree a connected subtree holding the root (I1),
let only leaves of that subtree leave the device (I2) and only children of it enter (I3).

An activated LoRA computes the base model's KV before the position its delta starts from: those
blocks hang below the base model's node, shared. Its blocks from the one holding that `start` on
hang below its own adapter node, so they depend on the adapter as every adapter's KV does; the
first of them is keyed by `start` and every token up to its end, since its KV also depends on the
base prefix before it and on where the delta began.

This is bookkeeping over page ids only. Which pages to allocate, what to evict first and when to
copy belong to the memory manager; the tree answers what is legal and keeps the candidate sets.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from loraplex.engine.memory.page_pool import PageKind
from loraplex.spec.adapter import AdapterId
from loraplex.util.clock import Clock


class NodeKind(enum.Enum):
    ROOT = "root"
    ADAPTER = "adapter"
    BLOCK = "block"


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    LOADING = "loading"  # a host -> device copy is in flight: the node holds pages on both sides


_HOLDS_DEVICE = (Tier.DEVICE, Tier.LOADING)

NodeKey = AdapterId | tuple[int, ...] | None


@dataclass(eq=False, slots=True)  # slots: a server's prefix cache holds tens of thousands
class TreeNode:
    """One node. Identity is the object: two nodes with equal fields are still different nodes."""

    kind: NodeKind
    key: NodeKey
    parent: TreeNode | None = field(repr=False)
    tier: Tier
    size: int  # device pages the node needs: 1 for a block, the weights' pages for an adapter
    pinned: bool = False  # adapters only: never evictable
    children: dict[NodeKey, TreeNode] = field(default_factory=dict, repr=False)
    device_pages: list[int] = field(default_factory=list)
    host_page: int | None = None  # blocks only: adapter weights always live on the host anyway
    lock_ref: int = 0  # locks on this node and on every node below it
    own_locks: int = 0  # locks taken on this node itself
    visits: int = 0
    last_access: float = 0.0
    resident_children: int = 0  # children on DEVICE or LOADING, kept so the leaf test is O(1)
    attached: bool = True  # False once dropped: a stale handle must not change the tree

    @property
    def is_base(self) -> bool:
        return self.kind is NodeKind.ADAPTER and self.key is None


@dataclass(frozen=True)
class Match:
    """The longest chain of existing blocks for a prompt under one adapter, any tier."""

    adapter: TreeNode
    blocks: list[TreeNode]  # top-down
    block_size: int

    @property
    def last(self) -> TreeNode:
        """The deepest matched node (the adapter node when no block matched): the one to lock."""
        return self.blocks[-1] if self.blocks else self.adapter

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def missing(self) -> list[TreeNode]:
        """Nodes of the chain, adapter included, not yet usable on the device; top-down."""
        return [node for node in (self.adapter, *self.blocks) if node.tier is not Tier.DEVICE]


@dataclass(frozen=True)
class Inserted:
    last: TreeNode  # the deepest node of the request's chain now in the tree: lock it
    unadopted: list[int]  # given pages the tree does not hold: they stay the caller's


@dataclass(frozen=True)
class Released:
    """Pages a removal gave up; the caller frees them in its pools."""

    device_pages: list[int]
    host_pages: list[int]


class DependencyTree:
    def __init__(self, block_size: int, clock: Clock) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._clock = clock
        self.root = TreeNode(NodeKind.ROOT, None, None, Tier.DEVICE, 0)
        # the base model has no weights and never leaves the device; pinned keeps it off the evict list
        self.base = TreeNode(NodeKind.ADAPTER, None, self.root, Tier.DEVICE, 0, pinned=True)
        self.root.children[None] = self.base
        self.root.resident_children = 1
        self._device_owner: dict[int, TreeNode] = {}
        self._host_owner: dict[int, TreeNode] = {}
        self._device_counts = {kind: 0 for kind in PageKind}
        self._device_adapters = 0
        self._evictable: dict[NodeKind, set[TreeNode]] = {kind: set() for kind in NodeKind}
        self._swap_in: set[TreeNode] = set()

    # ---- adapters -------------------------------------------------------------------------------

    def add_adapter(self, adapter: AdapterId, num_pages: int, *, pinned: bool = False) -> TreeNode:
        """A newly loaded adapter: on HOST (its weights are in host memory), no KV yet."""
        if adapter is None or adapter in self.root.children:
            raise ValueError(f"adapter {adapter} is already in the tree")
        if num_pages < 0:
            raise ValueError("an adapter cannot need a negative number of pages")
        node = TreeNode(NodeKind.ADAPTER, adapter, self.root, Tier.HOST, num_pages, pinned=pinned)
        self.root.children[adapter] = node
        self._refresh(node)
        return node

    def adapter_node(self, adapter: AdapterId | None) -> TreeNode | None:
        return self.root.children.get(adapter)

    def adapter_nodes(self) -> list[TreeNode]:
        """Every adapter node, the base model's included."""
        return list(self.root.children.values())

    def remove_adapter(self, adapter: AdapterId) -> Released:
        """The adapter is unloaded: forget it and all its KV; refused while anything in it is locked."""
        node = self._require_adapter(adapter)
        if node.is_base:
            raise ValueError("the base model's node cannot be removed; drop its blocks instead")
        return self._drop_subtree(node)

    def set_pinned(self, node: TreeNode, pinned: bool) -> None:
        self._require(node, NodeKind.ADAPTER)
        if node.is_base:
            raise ValueError("the base model's node is always pinned")
        node.pinned = pinned
        self._refresh(node)

    def begin_load(self, node: TreeNode, pages: Sequence[int]) -> None:
        """HOST -> LOADING: the adapter's weights are being copied into `pages`."""
        self._require(node, NodeKind.ADAPTER, Tier.HOST)
        if len(pages) != node.size:
            raise ValueError(f"adapter {node.key} needs {node.size} pages, got {len(pages)}")
        self._claim_device(node, pages)
        self._set_tier(node, Tier.LOADING)

    def finish_load(self, node: TreeNode) -> None:
        self._require(node, NodeKind.ADAPTER, Tier.LOADING)
        self._set_tier(node, Tier.DEVICE)

    def evict_adapter(self, node: TreeNode) -> list[int]:
        """DEVICE -> HOST once no KV of it is on the device (I2); returns its device pages."""
        self._require(node, NodeKind.ADAPTER, Tier.DEVICE)
        self._require_evictable(node)
        pages = self._release_device(node)
        self._set_tier(node, Tier.HOST)
        return pages

    # ---- KV blocks ------------------------------------------------------------------------------

    def match(self, adapter: AdapterId | None, token_ids: Sequence[int], start: int = 0) -> Match:
        """The longest chain of blocks of `token_ids` under `adapter` from the block holding `start`
        on (an activated LoRA's delta start; 0: from the first block); counts a visit on the path."""
        node = self._require_adapter(adapter)
        blocks = self._walk(node, token_ids, start)
        now = self._clock.now()
        for visited in (node, *blocks):
            visited.visits += 1
            visited.last_access = now
        return Match(node, blocks, self.block_size)

    def cached_blocks(self, adapter: AdapterId | None, token_ids: Sequence[int]) -> int:
        """How many leading full blocks of `token_ids` the tree holds under `adapter` (any tier),
        without counting a visit: what a router told of every insert and eviction would know."""
        node = self.root.children.get(adapter)
        return len(self._walk(node, token_ids)) if node is not None else 0

    def insert(self, adapter: AdapterId | None, token_ids: Sequence[int], pages: Sequence[int],
               start: int = 0) -> Inserted:
        """Adopt `pages[i]` (the device page of full block i, counted from the block holding `start`)
        for each block not yet in the tree.

        Pages past the full blocks are ignored. Blocks below a node that is not on the device are
        not adopted: their KV would be unusable there (I1). The tree never takes a page it holds
        for another node.
        """
        node = self._require_adapter(adapter)
        first = start // self.block_size
        num_blocks = max(0, len(token_ids) // self.block_size - first)
        if len(pages) < num_blocks:
            raise ValueError(f"{num_blocks} full blocks but only {len(pages)} pages")
        pages = list(pages[:num_blocks])
        chain = self._walk(node, token_ids, start)
        self._check_insert_pages(chain, pages)
        matched = zip(chain, pages[:len(chain)], strict=True)
        unadopted = [page for block, page in matched if page not in block.device_pages]
        last = chain[-1] if chain else node
        rest = pages[len(chain):]
        if rest and last.tier is not Tier.DEVICE:  # by I1 a DEVICE node's whole path is on the device
            return Inserted(last, unadopted + rest)
        if rest:
            last = self._add_chain(last, token_ids, first + len(chain), start, rest)
        return Inserted(last, unadopted)

    def lock(self, node: TreeNode) -> None:
        """A request uses `node` and its path: none of them may leave the device or be dropped."""
        self._require_attached(node)
        if node.kind is NodeKind.ROOT:
            raise ValueError("the root cannot be locked")
        node.own_locks += 1
        self._add_lock_ref(node, 1)

    def unlock(self, node: TreeNode) -> None:
        self._require_attached(node)
        if node.own_locks == 0:
            raise ValueError("unlocking a node that is not locked")
        node.own_locks -= 1
        self._add_lock_ref(node, -1)

    def swap_out(self, node: TreeNode, host_page: int) -> int:
        """DEVICE -> HOST for an evictable block (I2); returns the device page it gave up."""
        self._require(node, NodeKind.BLOCK, Tier.DEVICE)
        self._require_evictable(node)
        self._claim_host(node, host_page)
        (page,) = self._release_device(node)
        self._set_tier(node, Tier.HOST)
        return page

    def begin_swap_in(self, node: TreeNode, device_page: int) -> None:
        """HOST -> LOADING into `device_page`. The parent may itself still be loading: copies on one
        stream land in order, so a whole matched chain can be issued at once (I3, relaxed)."""
        self._require(node, NodeKind.BLOCK, Tier.HOST)
        if node.parent is None or node.parent.tier not in _HOLDS_DEVICE:
            raise ValueError("a block can only be swapped in below a node on the device")
        self._claim_device(node, [device_page])
        self._set_tier(node, Tier.LOADING)

    def finish_swap_in(self, node: TreeNode) -> int:
        """LOADING -> DEVICE once the parent is on the device; returns the host page to free."""
        self._require(node, NodeKind.BLOCK, Tier.LOADING)
        if node.parent is None or node.parent.tier is not Tier.DEVICE:
            raise ValueError("finish the parent's load first: a block is usable only below device nodes")
        page = self._release_host(node)
        self._set_tier(node, Tier.DEVICE)
        return page

    def drop(self, node: TreeNode) -> Released:
        """Forget a block and everything below it, any tier; refused while any of it is locked."""
        self._require(node, NodeKind.BLOCK)
        return self._drop_subtree(node)

    # ---- queries --------------------------------------------------------------------------------

    def evictable_device_leaves(self, kind: NodeKind | None = None) -> list[TreeNode]:
        """Unlocked, unpinned DEVICE nodes with nothing below them on the device (I2); of one kind
        when `kind` is given (a policy that evicts blocks only need not walk every adapter)."""
        if kind is not None:
            return list(self._evictable[kind])
        return [*self._evictable[NodeKind.ADAPTER], *self._evictable[NodeKind.BLOCK]]

    def is_evictable(self, node: TreeNode) -> bool:
        """`node` is one of `evictable_device_leaves()` now (O(1))."""
        return node.attached and node in self._evictable[node.kind]

    def subtree(self, node: TreeNode) -> list[TreeNode]:
        """`node` and everything below it."""
        return self._subtree(node)

    def swap_in_candidates(self) -> list[TreeNode]:
        """HOST nodes whose parent is on the device: the roots of the host-side subtrees (I3)."""
        return list(self._swap_in)

    def device_pages_by_kind(self) -> dict[PageKind, int]:
        """Device pages the tree holds (LOADING targets included), by kind."""
        return dict(self._device_counts)

    @property
    def num_host_pages(self) -> int:
        return len(self._host_owner)

    @property
    def num_device_adapters(self) -> int:
        """Adapters (the base model not counted) fully on the device."""
        return self._device_adapters

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Full walk; raises AssertionError on the first broken rule. For tests and debug runs."""
        nodes = [self.root, *self.nodes()]
        for node in nodes:
            self._check_structure(node)
            self._check_node_pages(node)
        self._check_page_index(nodes)
        self._check_candidate_sets(nodes)

    # ---- internals: walking ---------------------------------------------------------------------

    def _key(self, token_ids: Sequence[int], index: int, start: int = 0) -> tuple[int, ...]:
        """Block `index`'s tokens; the first block of a chain that starts at `start` > 0 is keyed by
        `start` and every token up to its end."""
        end = (index + 1) * self.block_size
        if start and index == start // self.block_size:
            return (start, *token_ids[:end])
        return tuple(token_ids[end - self.block_size:end])

    def _walk(self, node: TreeNode, token_ids: Sequence[int], start: int = 0) -> list[TreeNode]:
        chain: list[TreeNode] = []
        for index in range(start // self.block_size, len(token_ids) // self.block_size):
            child = node.children.get(self._key(token_ids, index, start))
            if child is None:
                break
            chain.append(child)
            node = child
        return chain

    def _subtree(self, node: TreeNode) -> list[TreeNode]:
        found: list[TreeNode] = []
        stack = [node]
        while stack:
            current = stack.pop()
            found.append(current)
            stack.extend(current.children.values())
        return found

    # ---- internals: changing nodes --------------------------------------------------------------

    def _add_chain(self, parent: TreeNode, token_ids: Sequence[int], index: int, start: int,
                   pages: Sequence[int]) -> TreeNode:
        """New DEVICE blocks `index`, `index + 1`, ... of `token_ids` below `parent`, one per page
        (pages `_check_insert_pages` cleared); returns the deepest. Every block but the deepest has a
        device child, so only the deepest and `parent` change candidate sets: one pass, no per-block
        refresh (a request leaving the batch inserts its whole prompt's chain)."""
        now, owner, key = self._clock.now(), self._device_owner, self._key
        node = parent
        for i, page in enumerate(pages, start=index):
            child = TreeNode(NodeKind.BLOCK, key(token_ids, i, start), node, Tier.DEVICE, 1, device_pages=[page],
                             visits=1, last_access=now)
            node.children[child.key] = child
            node.resident_children += 1
            owner[page] = child
            node = child
        self._device_counts[PageKind.KV] += len(pages)
        self._refresh(node)
        self._refresh(parent)
        return node

    def _add_lock_ref(self, node: TreeNode, delta: int) -> None:
        current: TreeNode | None = node
        while current is not None:
            current.lock_ref += delta
            self._refresh(current)  # evictability changes when the count crosses zero
            current = current.parent

    def _set_tier(self, node: TreeNode, tier: Tier) -> None:
        old, node.tier = node.tier, tier
        parent = node.parent
        assert parent is not None
        if (old in _HOLDS_DEVICE) != (tier in _HOLDS_DEVICE):
            parent.resident_children += 1 if tier in _HOLDS_DEVICE else -1
        if node.kind is NodeKind.ADAPTER and (old is Tier.DEVICE) != (tier is Tier.DEVICE):
            self._device_adapters += 1 if tier is Tier.DEVICE else -1
        self._refresh(node)
        self._refresh(parent)
        if (old is Tier.DEVICE) != (tier is Tier.DEVICE):  # the children's swap-in eligibility flips
            for child in node.children.values():
                self._refresh(child)

    def _drop_subtree(self, node: TreeNode) -> Released:
        self._require_attached(node)
        if node.lock_ref:
            raise ValueError("cannot drop a subtree a request has locked")
        device: list[int] = []
        host: list[int] = []
        for gone in self._subtree(node) if node.children else (node,):
            device.extend(self._release_device(gone))
            if gone.host_page is not None:
                host.append(self._release_host(gone))
            self._evictable[gone.kind].discard(gone)
            self._swap_in.discard(gone)
            gone.attached = False
            if gone is not node:  # no parent-child cycle is left behind: a twin runs with the gc paused
                gone.parent = None
        self._detach(node)
        return Released(device, host)

    def _detach(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if node.tier in _HOLDS_DEVICE:
            parent.resident_children -= 1
        if node.kind is NodeKind.ADAPTER and node.tier is Tier.DEVICE:
            self._device_adapters -= 1
        node.parent = None
        self._refresh(parent)

    def _refresh(self, node: TreeNode) -> None:
        """Re-derive `node`'s membership in the two maintained candidate sets."""
        if self._is_evictable(node):
            self._evictable[node.kind].add(node)
        else:
            self._evictable[node.kind].discard(node)
        if self._is_swap_in_candidate(node):
            self._swap_in.add(node)
        else:
            self._swap_in.discard(node)

    @staticmethod
    def _is_evictable(node: TreeNode) -> bool:
        return (node.kind is not NodeKind.ROOT and node.tier is Tier.DEVICE and node.lock_ref == 0
                and not node.pinned and node.resident_children == 0)

    @staticmethod
    def _is_swap_in_candidate(node: TreeNode) -> bool:
        return node.tier is Tier.HOST and node.parent is not None and node.parent.tier is Tier.DEVICE

    # ---- internals: pages -----------------------------------------------------------------------

    def _claim_device(self, node: TreeNode, pages: Sequence[int]) -> None:
        if len(set(pages)) != len(pages) or any(page in self._device_owner for page in pages):
            raise ValueError(f"device pages {list(pages)} are repeated or already held by the tree")
        for page in pages:
            self._device_owner[page] = node
        node.device_pages = list(pages)
        self._device_counts[self._page_kind(node)] += len(pages)

    def _release_device(self, node: TreeNode) -> list[int]:
        pages, node.device_pages = node.device_pages, []
        for page in pages:
            del self._device_owner[page]
        self._device_counts[self._page_kind(node)] -= len(pages)
        return pages

    def _claim_host(self, node: TreeNode, page: int) -> None:
        if page in self._host_owner:
            raise ValueError(f"host page {page} is already held by the tree")
        self._host_owner[page] = node
        node.host_page = page

    def _release_host(self, node: TreeNode) -> int:
        page, node.host_page = node.host_page, None
        assert page is not None
        del self._host_owner[page]
        return page

    @staticmethod
    def _page_kind(node: TreeNode) -> PageKind:
        return PageKind.ADAPTER if node.kind is NodeKind.ADAPTER else PageKind.KV

    def _check_insert_pages(self, chain: list[TreeNode], pages: list[int]) -> None:
        """Validate before changing anything, so a refused insert leaves the tree as it was."""
        if len(set(pages)) != len(pages):
            raise ValueError("insert was given the same page for two blocks")
        for index, page in enumerate(pages):
            owner = self._device_owner.get(page)
            if owner is not None and (index >= len(chain) or owner is not chain[index]):
                raise ValueError(f"page {page} of block {index} is held by another node")

    # ---- internals: preconditions ---------------------------------------------------------------

    def _require_adapter(self, adapter: AdapterId | None) -> TreeNode:
        node = self.root.children.get(adapter)
        if node is None:
            raise KeyError(f"adapter {adapter} is not in the tree")
        return node

    @staticmethod
    def _require_attached(node: TreeNode) -> None:
        if not node.attached:
            raise ValueError("the node was dropped from the tree")

    def _require(self, node: TreeNode, kind: NodeKind, tier: Tier | None = None) -> None:
        self._require_attached(node)
        if node.kind is not kind:
            raise ValueError(f"expected a {kind.value} node, got a {node.kind.value} node")
        if tier is not None and node.tier is not tier:
            raise ValueError(f"expected a node on {tier.value}, this one is on {node.tier.value}")

    def _require_evictable(self, node: TreeNode) -> None:
        if node not in self._evictable[node.kind]:
            raise ValueError("the node is locked, pinned or has children on the device (I2)")

    # ---- internals: invariant checks ------------------------------------------------------------

    def _check_structure(self, node: TreeNode) -> None:
        _expect(node.attached, "a reachable node is marked dropped")
        _expect(node.lock_ref == node.own_locks + sum(c.lock_ref for c in node.children.values()),
                "lock_ref is not the locks on the node plus those below it")
        _expect(node.resident_children == sum(c.tier in _HOLDS_DEVICE for c in node.children.values()),
                "resident_children is stale")
        parent = node.parent
        if parent is None:
            _expect(node is self.root and node.tier is Tier.DEVICE, "only the root has no parent")
            return
        _expect(parent.children.get(node.key) is node, "a node is not filed under its key")
        if node.tier is Tier.DEVICE:
            _expect(parent.tier is Tier.DEVICE, "I1: a DEVICE node's parent is not on the device")
        if node.tier is Tier.LOADING:
            _expect(parent.tier in _HOLDS_DEVICE, "I1: a LOADING node's parent is on the host")
        if node.kind is NodeKind.ADAPTER:
            _expect(parent is self.root, "an adapter node is not a child of the root")
        else:
            _expect(node.kind is NodeKind.BLOCK and parent.kind is not NodeKind.ROOT,
                    "a block hangs from the root")
            first_of_a_start = parent.kind is NodeKind.ADAPTER and len(node.key) > self.block_size
            _expect(isinstance(node.key, tuple) and (len(node.key) == self.block_size or first_of_a_start),
                    "a block key is not one block")

    def _check_node_pages(self, node: TreeNode) -> None:
        expected = node.size if node.tier in _HOLDS_DEVICE else 0
        _expect(len(node.device_pages) == expected, "device pages do not match the node's size and tier")
        if node.kind is NodeKind.BLOCK:
            _expect(node.size == 1, "a block takes one page")
            _expect((node.host_page is not None) == (node.tier is not Tier.DEVICE),
                    "a block off the device (or loading) must hold exactly its host page")
        else:
            _expect(node.host_page is None, "only blocks hold host pages")
        if node.is_base:
            _expect(node.tier is Tier.DEVICE and node.pinned and node.size == 0, "the base node moved")

    def _check_page_index(self, nodes: list[TreeNode]) -> None:
        device = [(page, node) for node in nodes for page in node.device_pages]
        host = [(node.host_page, node) for node in nodes if node.host_page is not None]
        _expect(len({page for page, _ in device}) == len(device), "a device page is held twice")
        _expect(len({page for page, _ in host}) == len(host), "a host page is held twice")
        _expect(dict(device) == self._device_owner, "the device page index is stale")
        _expect(dict(host) == self._host_owner, "the host page index is stale")
        counts = {kind: 0 for kind in PageKind}
        for node in nodes:
            counts[self._page_kind(node)] += len(node.device_pages)
        _expect(counts == self._device_counts, "device page counts are stale")
        adapters = sum(n.kind is NodeKind.ADAPTER and n.tier is Tier.DEVICE and not n.is_base for n in nodes)
        _expect(adapters == self._device_adapters, "the device adapter count is stale")

    def _check_candidate_sets(self, nodes: list[TreeNode]) -> None:
        for kind, evictable in self._evictable.items():
            _expect(evictable == {n for n in nodes if n.kind is kind and self._is_evictable(n)},
                    "the evictable set is stale")
        _expect(self._swap_in == {n for n in nodes if self._is_swap_in_candidate(n)},
                "the swap-in set is stale")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
