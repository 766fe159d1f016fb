"""Static draft trees (docs/methods.md#12-static-tree-drafting) compiled into index tensors.

Node 0 is the root: the last emitted token, whose target distribution verifies depth 1.
Nodes 1..n are the tree paths ordered by (depth, path). ``children[i, r]`` is the node holding
the r-th sample drawn at node i (-1 if absent); sibling order is sampling order, which is the
order recursive rejection visits them (docs/methods.md#13-verification-at-one-tree-depth-d).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from coolsd.engine.decoding.tree_choices import NAMED_TREES

TREE_NAMES = ("chain", *NAMED_TREES)


@dataclass(frozen=True)
class Tree:
    name: str
    paths: tuple[tuple[int, ...], ...]
    parent: torch.Tensor  # (n+1,) long, parent[0] = -1
    depth: torch.Tensor  # (n+1,) long, depth[0] = 0
    rank: torch.Tensor  # (n+1,) long, sample index at the parent
    children: torch.Tensor  # (n+1, max_children) long, -1 padded, rank order
    ancestors: torch.Tensor  # (n+1, n+1) bool, [i, j]: j is i or an ancestor of i
    # verification's index tables (``verify_tree``). Its rows are the nodes with children, most
    # children first (ties in node order): the E "walk nodes". Rank r's children are then those of
    # the first ``walk_rank_counts[r]`` walk nodes, and every drafted node is the child of exactly
    # one walk node at one rank: the n "walk children", rank by rank (rank-major).
    walk_nodes: torch.Tensor  # (E,) long
    walk_row: torch.Tensor  # (n+1,) long: each node's row among the walk nodes (-1: a leaf)
    walk_children: torch.Tensor  # (n,) long: the drafted nodes, rank-major
    walk_child_depth: torch.Tensor  # (n,) long: their depths
    walk_child_row: torch.Tensor  # (n,) long: their parents' rows
    walk_child_rank: torch.Tensor  # (n,) long: their ranks
    walk_rank_children: torch.Tensor  # (R + 1, E) long: [r, e] the rank-r child of row e (-1: none; row R: -1)

    @property
    def n_nodes(self) -> int:
        """Number of drafted nodes (the root excluded)."""
        return len(self.paths)

    @functools.cached_property
    def max_depth(self) -> int:
        return int(self.depth.max())  # a host int, read once (the tree is static)

    @property
    def max_children(self) -> int:
        return self.children.shape[1]

    def level(self, d: int) -> torch.Tensor:
        """Node indices at depth d, in node order."""
        return torch.nonzero(self.depth == d).flatten()

    def n_children(self) -> torch.Tensor:
        return (self.children >= 0).sum(1)

    # host-side views for drafting loops, computed once per tree (a frozen tree never changes)
    @functools.cached_property
    def n_children_list(self) -> list[int]:
        return self.n_children().tolist()

    def on(self, device) -> "Tree":
        """This tree with its index tensors on ``device`` (made once per device)."""
        device = torch.device(device)
        if self.parent.device == device:
            return self
        copies = self.__dict__.setdefault("_on_device", {})
        if device not in copies:
            moved = dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                                 for f in dataclasses.fields(self)
                                                 if isinstance(getattr(self, f.name), torch.Tensor)})
            moved.__dict__.update({v: self.__dict__[v] for v in HOST_VIEWS})  # host views: the same on any device
            copies[device] = moved
        return copies[device]

    @functools.cached_property
    def parent_list(self) -> list[int]:
        return self.parent.tolist()

    @functools.cached_property
    def children_list(self) -> list[list[int]]:
        """children_list[i]: node i's children in rank (sampling) order."""
        return [[c for c in row if c >= 0] for row in self.children.tolist()]

    @functools.cached_property
    def expanded_nodes(self) -> list[int]:
        """Nodes with children (drawn at during drafting), in node order."""
        return [i for i, k in enumerate(self.n_children_list) if k > 0]

    def forwarded_levels(self, depth: int) -> list[int]:
        """Levels d in 1..depth-1 a drafter must run a forward on when it drafts ``depth`` levels:
        those holding a node with children."""
        return [d for d in range(1, depth) if any(self.n_children_list[c] > 0 for c in self.levels[d])]

    @functools.cached_property
    def level_slices(self) -> list[slice]:
        """level_slices[d]: the nodes at depth d as a slice (nodes are ordered by depth, so each
        level is a contiguous range): indexing with it makes no index tensor."""
        out = []
        for nodes in self.levels:
            start = nodes[0] if nodes else 0
            if nodes != list(range(start, start + len(nodes))):
                raise ValueError(f"tree {self.name!r}: level {nodes} is not a contiguous node range")
            out.append(slice(start, start + len(nodes)))
        return out

    def drafting_mask(self, d: int, levels: tuple[int, ...]) -> torch.Tensor:
        """(len(level d), n_cols) bool: which of the nodes of ``levels`` (a drafter's pending
        entries, in cache order) each node at depth d attends to (itself and its ancestors)."""
        cols = torch.tensor([c for level in levels for c in self.levels[level]], dtype=torch.long,
                            device=self.ancestors.device)
        return self.ancestors[self.level_slices[d]][:, cols]

    def drafting_masks(self, depth: int) -> tuple[torch.Tensor, ...]:
        """The ``drafting_mask`` of every level a drafter forwards when it drafts ``depth`` levels
        (``forwarded_levels``), in order, each over the levels forwarded before it and itself: made
        once per (tree, device, depth), in eager code, and handed to the expansion as inputs (a
        compiled expansion never touches this cache: Dynamo does not trace every dict method)."""
        sets = self.__dict__.setdefault("_drafting_masks", {})
        if depth not in sets:
            fwd = tuple(self.forwarded_levels(depth))
            sets[depth] = tuple(self.drafting_mask(level, fwd[: i + 1]) for i, level in enumerate(fwd))
        return sets[depth]

    @functools.cached_property
    def drafting_plan(self) -> list["LevelDraw"]:
        """drafting_plan[d]: how a drafter draws level d + 1 from level d in one batched call, for d =
        0 .. max_depth - 1 (docs/methods.md#12-static-tree-drafting). Nodes are ordered by (depth,
        path) and sibling ranks are 0..m-1, so level d + 1 is the children of level d's expanded
        nodes, parent by parent in node order, each parent's in rank order: its draws, concatenated,
        are level d + 1 in node order, and no index tensor is needed."""
        plan = []
        col = 0  # the uniforms' column of the level's first expanded node (``expanded_nodes`` order)
        for d in range(self.max_depth):
            nodes = self.levels[d]
            expanded = [(j, self.n_children_list[i]) for j, i in enumerate(nodes) if self.n_children_list[i] > 0]
            locs, counts = tuple(j for j, _ in expanded), tuple(m for _, m in expanded)
            plan.append(LevelDraw(locs, counts, col, max(counts, default=0), self.level_slices[d + 1]))
            col += len(locs)
        return plan

    @functools.cached_property
    def level_max_children(self) -> list[int]:
        """level_max_children[d]: the most children a node at depth d has, d = 0 .. max_depth."""
        return [max((self.n_children_list[i] for i in self.levels[d]), default=0) for d in range(self.max_depth + 1)]

    @functools.cached_property
    def walk_rank_counts(self) -> tuple[int, ...]:
        """How many walk nodes have a child at rank r, r = 0 .. max_children - 1 (non-increasing:
        rank r's rows are the first that many), host ints."""
        kids = [self.n_children_list[i] for i in self.walk_nodes.tolist()]  # built on the host
        return tuple(sum(k > r for k in kids) for r in range(self.max_children)) if kids else ()

    @functools.cached_property
    def walk_depths(self) -> tuple[int, ...]:
        """The depth of each walk node's children, host ints: what a rule reading its depth is
        told per row (``Rule.accepted_rows``)."""
        return tuple(len(self.paths[i - 1]) + 1 if i else 1 for i in self.walk_nodes.tolist())

    @functools.cached_property
    def levels(self) -> list[list[int]]:
        """levels[d]: node indices at depth d, in node order (d = 0 .. max_depth + 1)."""
        return [self.level(d).tolist() for d in range(self.max_depth + 2)]


@dataclass(frozen=True)
class LevelDraw:
    """One level's batched draw (``Tree.drafting_plan``): the positions within level d of its
    expanded nodes (``locs``), how many children each draws (``counts``), the uniforms' column of
    the first of them (``u_col``: the rest follow), the most children any of them draws (``k``), and
    level d + 1 as a node slice (``children``)."""

    locs: tuple[int, ...]
    counts: tuple[int, ...]
    u_col: int
    k: int
    children: slice

    @property
    def contiguous(self) -> bool:
        """Whether the expanded nodes are a run of the level (a slice selects them)."""
        return self.locs == tuple(range(self.locs[0], self.locs[0] + len(self.locs))) if self.locs else True

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, n_d, ...) over level d's nodes -> (B, e, ...) over its expanded nodes."""
        if self.contiguous:
            return x[:, self.locs[0] : self.locs[0] + len(self.locs)] if self.locs else x[:, :0]
        return torch.stack([x[:, j] for j in self.locs], 1)

    def children_of(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, e, k, ...) per expanded node and draw -> (B, n_{d+1}, ...): each node's first
        ``counts`` draws, in node order (level d + 1's order)."""
        if all(m == self.k for m in self.counts):
            return x.flatten(1, 2)
        return torch.cat([x[:, e, :m] for e, m in enumerate(self.counts)], 1)

    def parents_of(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, e, ...) per expanded node -> (B, n_{d+1}, ...): each level d + 1 node's parent's."""
        if all(m == self.k for m in self.counts):
            return x.repeat_interleave(self.k, dim=1)
        return torch.cat([x[:, e : e + 1].expand(-1, m, *x.shape[2:]) for e, m in enumerate(self.counts)], 1)


def chain_paths(length: int) -> list[list[int]]:
    return [[0] * d for d in range(1, length + 1)]


def build_tree(paths: Sequence[Sequence[int]], name: str = "custom") -> Tree:
    """Compile a list of paths, checking it is a well-formed sampling tree."""
    ps = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if len(ps) != len(paths):
        raise ValueError(f"tree {name!r}: duplicate paths")
    if not ps:
        return _compile(name, ())
    index = {p: i + 1 for i, p in enumerate(ps)}
    for p in ps:
        if len(p) == 0 or min(p) < 0:
            raise ValueError(f"tree {name!r}: path {list(p)} must be non-empty with ranks >= 0")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree {name!r}: path {list(p)} has no parent {list(p[:-1])}")
        # Recursive rejection is lossless only if the children verified at a node are the first
        # samples drawn there: ranks must be 0..m-1 (a skipped rank would condition later
        # siblings on an unverified draw).
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
            raise ValueError(
                f"tree {name!r}: path {list(p)} skips rank {p[-1] - 1}; sibling ranks must be 0..m-1"
            )
    return _compile(name, tuple(ps))


def _compile(name: str, ps: tuple[tuple[int, ...], ...]) -> Tree:
    """The tree's index tensors, built on the host (``Tree.on`` moves them to a device). ``ps``
    ordered by (depth, path), as ``build_tree`` sorts them: nodes are numbered by depth, which
    drafting's levels and verification's path (its last node is its largest) rest on."""
    if any(len(a) > len(b) for a, b in zip(ps, ps[1:])):
        raise ValueError(f"tree {name!r}: paths must be ordered by depth (build_tree orders them)")
    n = len(ps)
    index = {(): 0, **{p: i + 1 for i, p in enumerate(ps)}}
    host = torch.device("cpu")
    parent = torch.full((n + 1,), -1, dtype=torch.long, device=host)
    depth = torch.zeros(n + 1, dtype=torch.long, device=host)
    rank = torch.zeros(n + 1, dtype=torch.long, device=host)
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for p, i in index.items():
        if not p:
            continue
        parent[i] = index[p[:-1]]
        depth[i] = len(p)
        rank[i] = p[-1]
        kids[index[p[:-1]]].append((p[-1], i))
    width = max([len(k) for k in kids] + [1])
    children = torch.full((n + 1, width), -1, dtype=torch.long, device=host)
    for i, k in enumerate(kids):
        for r, (_, c) in enumerate(sorted(k)):
            children[i, r] = c
    ancestors = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=host)
    for i in range(n + 1):
        j = i
        while j >= 0:
            ancestors[i, j] = True
            j = int(parent[j])
    # the walk nodes, most children first, and their children rank by rank (the Tree fields' comments)
    walk = sorted((i for i, k in enumerate(kids) if k), key=lambda i: -len(kids[i]))
    ranked = [[c for _, c in sorted(kids[i])] for i in walk]
    row = torch.full((n + 1,), -1, dtype=torch.long, device=host)
    row[walk] = torch.arange(len(walk), device=host)
    flat = [(e, r, k[r]) for r in range(width) for e, k in enumerate(ranked) if r < len(k)]
    rank_children = torch.full((width + 1, len(walk)), -1, dtype=torch.long, device=host)
    for e, r, c in flat:
        rank_children[r, e] = c
    child = torch.tensor([c for _, _, c in flat], dtype=torch.long, device=host)
    long = functools.partial(torch.tensor, dtype=torch.long, device=host)
    return _with_views(Tree(name, ps, parent, depth, rank, children, ancestors, long(walk), row, child,
                            depth[child], long([e for e, _, _ in flat]), long([r for _, r, _ in flat]),
                            rank_children))


def _with_views(tree: Tree) -> Tree:
    for view in HOST_VIEWS:  # computed now, on the host: never inside a compiled round (coolsd.engine.compiled)
        getattr(tree, view)
    return tree


HOST_VIEWS = ("max_depth", "n_children_list", "parent_list", "children_list", "levels", "expanded_nodes",
              "walk_rank_counts", "walk_depths", "level_max_children", "level_slices", "drafting_plan")


def pac_tree(window: int, width: int, depth: int) -> Tree:
    """SJD-PAC's static tree (arXiv 2603.18599, "proactive drafting"; KangJialiang/SJD-PAC
    ``generate_tree_mask_and_retrieve``): a full ``width``-ary tree over the first ``depth - 1``
    depths below the root (``depth`` counts the root's level, as upstream's ``tree_depth``), then the
    rank-0 chain on to depth ``window - 1``. ``depth = 1`` or ``width = 1``: SJD's chain."""
    n = window - 1
    if not 1 <= depth <= window or width < 1:
        raise ValueError(f"sjd_pac needs width >= 1 and 1 <= tree_depth <= window, got width={width}, "
                         f"tree_depth={depth}, window={window}")
    paths = [p for d in range(1, depth) for p in itertools.product(range(width), repeat=d)]
    paths += [(0,) * d for d in range(max(depth, 1), n + 1)]
    return build_tree(paths, name=f"pac{window}w{width}d{depth}")


def make_tree(tree: str | Sequence[Sequence[int]], draft_length: int | None = None) -> Tree:
    """A tree by name ("chain" needs ``draft_length``) or from explicit paths."""
    if not isinstance(tree, str):
        return build_tree(tree)
    if tree == "chain":
        if draft_length is None or int(draft_length) < 1:
            raise ValueError(f"tree 'chain' needs draft_length >= 1, got {draft_length!r}")
        return build_tree(chain_paths(int(draft_length)), name=f"chain{int(draft_length)}")
    if tree not in NAMED_TREES:
        raise ValueError(f"unknown tree {tree!r}; valid names: {', '.join(TREE_NAMES)}")
    return build_tree(NAMED_TREES[tree], name=tree)


EMPTY_TREE = _compile("none", ())
