"""The agreement fingerprint (cpindex.fingerprint): it sees every entry a call reads and
nothing else."""

from __future__ import annotations

import torch

from cpindex import fingerprint, testing


def _fp(table: torch.Tensor, lens: torch.Tensor, init: int = 0, local: int = 1) -> int:
    out = torch.zeros(1, dtype=torch.int64)
    return int(fingerprint.plan_fingerprint(table, lens, init, local, out)[0])


def _problem():
    p = testing.make_problem(5, 2000, "fp8", seed=11)
    return p.block_table, p.seq_lens


def _read(lens: torch.Tensor, width: int, init: int = 0, local: int = 1) -> torch.Tensor:
    n = (lens.long() + 127) // 128
    j = torch.arange(width)
    return (j >= init) & (j < (n - local).unsqueeze(1))


def test_every_read_entry_and_length_counts():
    table, lens = _problem()
    base = _fp(table, lens)
    read = _read(lens, table.shape[1])
    for r, c in read.nonzero().tolist():
        t = table.clone()
        t[r, c] += 1
        assert _fp(t, lens) != base, (r, c)
    for r in range(lens.shape[0]):
        other = lens.clone()
        other[r] += 1
        assert _fp(table, other) != base, r


def test_swapped_rows_or_entries_differ():
    table, lens = _problem()
    base = _fp(table, lens)
    r0 = int(lens.argmax())
    t = table.clone()
    t[r0, 0], t[r0, 1] = table[r0, 1].item(), table[r0, 0].item()
    assert _fp(t, lens) != base
    perm = torch.tensor([1, 0, 2, 3, 4])
    assert _fp(table[perm], lens[perm]) != base


def test_unread_entries_and_padding_width_do_not_count():
    table, lens = _problem()
    base = _fp(table, lens)
    read = _read(lens, table.shape[1])
    garbage = torch.where(read, table, torch.randint(-(2**31), 2**31 - 1, table.shape).int())
    assert _fp(garbage, lens) == base
    wider = torch.full((table.shape[0], table.shape[1] + 7), 12345, dtype=torch.int32)
    wider[:, : table.shape[1]] = table
    assert _fp(wider, lens) == base
    # forced columns are not read either: with init_blocks=2, columns 0 and 1 do not count
    t = table.clone()
    t[:, :2] = -5
    assert _fp(t, lens, init=2) == _fp(table, lens, init=2) != base


def test_the_slot_keeps_its_address_and_equal_inputs_agree():
    table, lens = _problem()
    out = torch.zeros(1, dtype=torch.int64)
    ptr = out.data_ptr()
    a = int(fingerprint.plan_fingerprint(table, lens, 0, 1, out)[0])
    assert out.data_ptr() == ptr
    b = int(fingerprint.plan_fingerprint(table.clone(), lens.clone(), 0, 1, out)[0])
    assert a == b != 0


def test_query_hash_sees_every_byte():
    q = torch.randn(4, 2, 128).to(torch.float8_e4m3fn)
    base = int(fingerprint.query_hash(q))
    for i in (0, 1, 511, 1023):
        other = q.view(torch.uint8).clone().view(-1)
        other[i] ^= 1
        assert int(fingerprint.query_hash(other.view(q.shape).view(torch.float8_e4m3fn))) != base
    bf = torch.randn(3, 1, 128).to(torch.bfloat16)
    assert int(fingerprint.query_hash(bf)) == int(fingerprint.query_hash(bf.clone()))
