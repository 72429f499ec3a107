"""Tests for cpindex.partition: the block split over ranks and the head ownership
(docs/contract.md §5)."""

from __future__ import annotations

import pytest
import torch

from cpindex import partition as P

WORLDS = range(1, 9)
SIZES = [*range(0, 40), 63, 64, 65, 127, 128, 129, 255, 256, 1000, 1023, 4096, 4097]

OWNED_COLUMNS_BUG = (
    "partition.owned_columns(rank, world, width) calls torch.arange(rank, width, world), which "
    "raises 'upper bound and lower bound inconsistent' when rank > width (e.g. W=4, width=1, "
    "rank 2); it should return an empty tensor"
)


def _sizes(world: int, small: bool) -> list[int]:
    """Widths with (small) or without (not small) ranks beyond the last column."""
    return [n for n in SIZES if (n < world - 1) == small]


def _check_owned_columns(world: int, sizes: list[int]) -> None:
    for n in sizes:
        shares = [P.owned_columns(r, world, n) for r in range(world)]
        for cols in shares:
            assert cols.dtype == torch.int64
            assert cols.dim() == 1
            # each share is increasing and inside [0, n)
            if cols.numel():
                assert bool((cols[1:] > cols[:-1]).all())
                assert int(cols.min()) >= 0 and int(cols.max()) < n
        allcols = torch.cat(shares)
        # disjoint and complete: the union is exactly range(n), each column once
        assert allcols.numel() == n
        assert torch.equal(allcols.sort().values, torch.arange(n))
        # balanced: every rank within one block of n / W
        for cols in shares:
            assert abs(cols.numel() - n / world) < 1
        assert max(c.numel() for c in shares) == P.shard_width(n, world)


@pytest.mark.parametrize("world", WORLDS)
def test_owned_columns_partition_every_width(world):
    _check_owned_columns(world, _sizes(world, small=False))


@pytest.mark.parametrize("world", [3, 4, 8])
def test_owned_columns_width_below_world(world):
    _check_owned_columns(world, _sizes(world, small=True))


@pytest.mark.parametrize("world", WORLDS)
def test_blocks_owned_matches_owned_columns(world):
    for n in SIZES:
        counts = [P.blocks_owned(n, r, world) for r in range(world)]
        assert sum(counts) == n
        assert max(counts) - min(counts) <= 1
        for r in range(world):
            if r <= n:  # r > n: see test_owned_columns_width_below_world
                assert counts[r] == P.owned_columns(r, world, n).numel()
            assert n // world <= counts[r] <= -(-n // world)


@pytest.mark.parametrize("world", WORLDS)
def test_shares_need_no_communication(world):
    """Any rank can compute any other's share from (r, W): the prefix of a row's n blocks that
    rank r owns inside a wider table is owned_columns restricted to j < n."""
    width = 50
    for r in range(world):
        cols = P.owned_columns(r, world, width)
        for n in range(r, width + 1):  # n < r: see test_owned_columns_width_below_world
            mine = cols[cols < n]
            assert torch.equal(mine, P.owned_columns(r, world, n))
            assert mine.numel() == P.blocks_owned(n, r, world)


def test_shard_width():
    for world in WORLDS:
        for n in SIZES:
            assert P.shard_width(n, world) == -(-n // world)
            assert P.shard_width(n, world) * world >= n


# --------------------------------------------------------------------------- heads


@pytest.mark.parametrize(
    ("heads", "world"),
    [(1, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (4, 8), (2, 4), (1, 4), (2, 8)],
)
def test_head_owners_and_heads_of_rank_agree(heads, world):
    owners = P.head_owners(heads, world)
    assert len(owners) == heads
    per_rank = [P.heads_of_rank(r, heads, world) for r in range(world)]
    hpr = max(1, heads // world)
    for r in range(world):
        assert len(per_rank[r]) == hpr
        # heads_of_rank is exactly the heads whose owner list names r, in increasing order
        assert per_rank[r] == [h for h in range(heads) if r in owners[h]]
    # every head has the same number of owners, and every rank receives something
    copies = max(1, world // heads)
    assert all(len(o) == copies for o in owners)
    # each rank appears in exactly hpr owner lists
    flat = [r for o in owners for r in o]
    assert all(flat.count(r) == hpr for r in range(world))


def test_head_owners_seed_deployment():
    # H = 4, W = 4: rank r holds head r
    assert P.head_owners(4, 4) == [[0], [1], [2], [3]]
    assert [P.heads_of_rank(r, 4, 4) for r in range(4)] == [[0], [1], [2], [3]]


def test_head_owners_more_heads_than_ranks():
    assert P.head_owners(8, 2) == [[0]] * 4 + [[1]] * 4
    assert P.heads_of_rank(0, 8, 2) == [0, 1, 2, 3]
    assert P.heads_of_rank(1, 8, 2) == [4, 5, 6, 7]
    assert P.heads_of_rank(3, 8, 4) == [6, 7]


def test_head_owners_replicated():
    # W > H: head h lives on ranks h, h + H, ...; ranks r and r + H get the same head
    assert P.head_owners(2, 4) == [[0, 2], [1, 3]]
    assert P.head_owners(4, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert P.head_owners(1, 3) == [[0, 1, 2]]
    assert [P.heads_of_rank(r, 2, 4) for r in range(4)] == [[0], [1], [0], [1]]
    assert [P.heads_of_rank(r, 4, 8) for r in range(8)] == [[r % 4] for r in range(8)]


# --------------------------------------------------------------------------- scanned blocks


def _scanned_brute(lens: list[int], rank: int, world: int, init: int, local: int) -> int:
    total = 0
    for length in lens:
        n = -(-length // 128)
        for j in range(n):
            forced = j >= n - local or j < init
            if j % world == rank and not forced:
                total += 1
    return total


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("init", "local"), [(0, 1), (1, 1), (2, 3), (0, 0), (5, 0), (0, 7)])
def test_scanned_blocks_brute_force(world, init, local):
    g = torch.Generator().manual_seed(world * 100 + init * 10 + local)
    lens = torch.randint(1, 3000, (40,), generator=g, dtype=torch.int32)
    lens[:8] = torch.tensor([1, 127, 128, 129, 256, 257, 1, 128 * 9], dtype=torch.int32)
    for r in range(world):
        want = _scanned_brute(lens.tolist(), r, world, init, local)
        assert P.scanned_blocks(lens, r, world, init, local) == want
    # every scanned block is scanned by exactly one rank
    total = sum(P.scanned_blocks(lens, r, world, init, local) for r in range(world))
    assert total == _scanned_brute(lens.tolist(), 0, 1, init, local)


def test_scanned_blocks_balanced_per_row():
    for world in range(1, 9):
        for length in range(1, 128 * 40, 61):
            t = torch.tensor([length], dtype=torch.int32)
            counts = [P.scanned_blocks(t, r, world, 0, 1) for r in range(world)]
            assert max(counts) - min(counts) <= 1, (world, length, counts)
