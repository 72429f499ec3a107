"""Tests for cpindex.bench.nccl_tests: table parsing and running a (fake) test binary."""

# ruff: noqa: E501  (the sample tables keep the tools' real line widths)

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from cpindex.bench.nccl_tests import (
    NcclTestRow,
    find_binary,
    parse_avg_busbw,
    parse_output,
    run_binary,
)

# alltoall_perf on 8 GPUs, data check on: in-place #wrong is N/A. Includes a warning line, NCCL
# INFO lines (one of them with 13 tokens) and a truncated data line, all to be ignored.
ALLTOALL_OUT = """\
# nThread 1 nGpus 8 minBytes 32 maxBytes 1024 step: 2(factor) warmup iters: 20 iters: 100 \
agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41217 on   gpu-node-07 device  0 [0x18] NVIDIA H200
#  Rank  1 Group  0 Pid  41217 on   gpu-node-07 device  1 [0x2a] NVIDIA H200
#  Rank  2 Group  0 Pid  41217 on   gpu-node-07 device  2 [0x3a] NVIDIA H200
#  Rank  3 Group  0 Pid  41217 on   gpu-node-07 device  3 [0x5d] NVIDIA H200
#  Rank  4 Group  0 Pid  41217 on   gpu-node-07 device  4 [0x9a] NVIDIA H200
#  Rank  5 Group  0 Pid  41217 on   gpu-node-07 device  5 [0xab] NVIDIA H200
#  Rank  6 Group  0 Pid  41217 on   gpu-node-07 device  6 [0xba] NVIDIA H200
#  Rank  7 Group  0 Pid  41217 on   gpu-node-07 device  7 [0xdb] NVIDIA H200
gpu-node-07:41217:41217 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.7<0>
gpu-node-07:41217:41217 [0] NCCL INFO NCCL version 2.27.3+cuda12.9
gpu-node-07:41217:41230 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read x
NCCL WARN Could not find real path of /sys/class/net/eth1
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
          32             8     float    none      -1    11.05    0.00    0.00      0    10.87    0.00    0.00    N/A
          64            16     float    none      -1    10.98    0.01    0.01      0    10.91    0.01    0.01    N/A
         128            32     float    none      -1    11.12    0.01    0.01      0    11.02    0.01    0.01    N/A
         256            64     float    none      -1    11.31    0.02    0.02      0    11.20    0.02    0.02    N/A
         512           128     float    none      -1    11.47    0.04    0.04      0    11.39    0.04    0.04    N/A
        1024           256     float    none      -1    11.96    0.09    0.08      0    11.80    0.09    0.08    N/A
        2048           512     float    none      -1    12.4
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.0275
#
"""

ALLTOALL_ROWS = [
    NcclTestRow(32, 8, "float", "none", -1, 11.05, 0.00, 0.00, 0, 10.87, 0.00, 0.00, None),
    NcclTestRow(64, 16, "float", "none", -1, 10.98, 0.01, 0.01, 0, 10.91, 0.01, 0.01, None),
    NcclTestRow(128, 32, "float", "none", -1, 11.12, 0.01, 0.01, 0, 11.02, 0.01, 0.01, None),
    NcclTestRow(256, 64, "float", "none", -1, 11.31, 0.02, 0.02, 0, 11.20, 0.02, 0.02, None),
    NcclTestRow(512, 128, "float", "none", -1, 11.47, 0.04, 0.04, 0, 11.39, 0.04, 0.04, None),
    NcclTestRow(1024, 256, "float", "none", -1, 11.96, 0.09, 0.08, 0, 11.80, 0.09, 0.08, None),
]

# all_gather_perf (rccl-tests style) on 2 GPUs: count is per rank, in-place #wrong is checked.
ALL_GATHER_OUT = """\
# nThread 1 nGpus 2 minBytes 8 maxBytes 128 step: 2(factor) warmup iters: 20 iters: 100 \
agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   9021 on  mi355-03 device  0 [0000:05:00] AMD Instinct MI355X
#  Rank  1 Group  0 Pid   9021 on  mi355-03 device  1 [0000:15:00] AMD Instinct MI355X
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             1     float    none      -1    14.62    0.00    0.00      0    14.10    0.00    0.00      0
          16             2     float    none      -1    14.48    0.00    0.00      0    14.05    0.00    0.00      0
          32             4     float    none      -1    14.71    0.00    0.00      0    14.33    0.00    0.00      0
          64             8     float    none      -1    14.90    0.00    0.00      0    14.52    0.00    0.00      2
         128            16     float    none      -1    15.03    0.01    0.00      0    14.66    0.01    0.00      0
# Errors with asterisks indicate errors that have exceeded the maximum threshold.
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.00123
#
"""

ALL_GATHER_ROWS = [
    NcclTestRow(8, 1, "float", "none", -1, 14.62, 0.00, 0.00, 0, 14.10, 0.00, 0.00, 0),
    NcclTestRow(16, 2, "float", "none", -1, 14.48, 0.00, 0.00, 0, 14.05, 0.00, 0.00, 0),
    NcclTestRow(32, 4, "float", "none", -1, 14.71, 0.00, 0.00, 0, 14.33, 0.00, 0.00, 0),
    NcclTestRow(64, 8, "float", "none", -1, 14.90, 0.00, 0.00, 0, 14.52, 0.00, 0.00, 2),
    NcclTestRow(128, 16, "float", "none", -1, 15.03, 0.01, 0.00, 0, 14.66, 0.01, 0.00, 0),
]


def _assert_rows(got: list[NcclTestRow], want: list[NcclTestRow]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for field in dataclasses.fields(NcclTestRow):
            gv, wv = getattr(g, field.name), getattr(w, field.name)
            assert type(gv) is type(wv), (field.name, gv, wv)
            assert gv == wv, (field.name, gv, wv)


def test_parse_alltoall_every_field() -> None:
    _assert_rows(parse_output(ALLTOALL_OUT), ALLTOALL_ROWS)
    assert parse_avg_busbw(ALLTOALL_OUT) == pytest.approx(0.0275)


def test_parse_all_gather_every_field() -> None:
    rows = parse_output(ALL_GATHER_OUT)
    _assert_rows(rows, ALL_GATHER_ROWS)
    assert [r.size_bytes for r in rows] == [8, 16, 32, 64, 128]
    assert parse_avg_busbw(ALL_GATHER_OUT) == pytest.approx(0.00123)


def test_row_is_frozen() -> None:
    row = parse_output(ALLTOALL_OUT)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.size_bytes = 1  # type: ignore[misc]


def test_malformed_lines_are_skipped() -> None:
    good = "          32             8     float    none      -1    11.05    0.00    0.00      0    10.87    0.00    0.00    N/A"
    text = "\n".join(
        [
            good,
            # 13 tokens but a non-numeric time
            "          64            16     float    none      -1    abc    0.01    0.01      0    10.91    0.01    0.01    N/A",
            # 13 tokens but a bad #wrong value
            "         128            32     float    none      -1    11.12    0.01    0.01      x    11.02    0.01    0.01    N/A",
            # too few / too many columns
            "         256            64     float    none      -1    11.31    0.02",
            good + " extra",
            "",
            "   ",
        ]
    )
    rows = parse_output(text)
    assert rows == [
        NcclTestRow(32, 8, "float", "none", -1, 11.05, 0.0, 0.0, 0, 10.87, 0.0, 0.0, None)
    ]


def test_check_disabled_gives_none_for_both_wrong_columns() -> None:
    line = "        1024           256     float    none      -1    11.96    0.09    0.08    N/A    11.80    0.09    0.08    N/A"
    (row,) = parse_output(line)
    assert row.oop_wrong is None
    assert row.ip_wrong is None


def test_parse_empty_and_missing_avg() -> None:
    assert parse_output("") == []
    assert parse_avg_busbw("") is None
    assert parse_avg_busbw("# Avg bus bandwidth    : garbage\n") is None
    assert parse_avg_busbw("#  Avg bus bandwidth : 12.5 \n# Avg bus bandwidth : 13.5\n") == 13.5


def _make_exe(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_find_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = _make_exe(tmp_path / "alltoall_perf", "print('hi')\n")
    not_exe = tmp_path / "all_gather_perf"
    not_exe.write_text("")
    assert find_binary("alltoall_perf", str(exe)) == str(exe)
    assert find_binary("alltoall_perf", str(tmp_path / "missing")) is None
    assert find_binary("all_gather_perf", str(not_exe)) is None

    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_binary("alltoall_perf", None) == str(exe)
    assert find_binary("all_gather_perf", None) is None
    assert find_binary("no_such_perf", None) is None


def test_run_binary_with_fake_executable(tmp_path: Path) -> None:
    table = tmp_path / "table.txt"
    table.write_text(ALLTOALL_OUT)
    argv_file = tmp_path / "argv.txt"
    exe = _make_exe(
        tmp_path / "alltoall_perf",
        f"""\
        import sys
        open({str(argv_file)!r}, "w").write("\\n".join(sys.argv[1:]))
        sys.stderr.write("some warning on stderr\\n")
        sys.stdout.write(open({str(table)!r}).read())
        """,
    )
    rows = run_binary(str(exe), min_bytes=32, max_bytes=1024, ngpus=8, iters=50, warmup=5)
    _assert_rows(rows, ALLTOALL_ROWS)
    assert argv_file.read_text().split("\n") == [
        "-b", "32", "-e", "1024", "-f", "2", "-g", "8", "-n", "50", "-w", "5", "-c", "0",
    ]  # fmt: skip


def test_run_binary_defaults(tmp_path: Path) -> None:
    argv_file = tmp_path / "argv.txt"
    table = tmp_path / "table.txt"
    table.write_text(ALL_GATHER_OUT)
    exe = _make_exe(
        tmp_path / "all_gather_perf",
        f"""\
        import sys
        open({str(argv_file)!r}, "w").write(" ".join(sys.argv[1:]))
        sys.stdout.write(open({str(table)!r}).read())
        """,
    )
    rows = run_binary(str(exe), min_bytes=8, max_bytes=128, ngpus=2)
    _assert_rows(rows, ALL_GATHER_ROWS)
    assert argv_file.read_text() == "-b 8 -e 128 -f 2 -g 2 -n 100 -w 20 -c 0"


def test_run_binary_failure_reports_stderr_tail(tmp_path: Path) -> None:
    exe = _make_exe(
        tmp_path / "alltoall_perf",
        """\
        import sys
        print("# nThread 1 nGpus 8")
        sys.stderr.write("noise\\n" * 2000)
        sys.stderr.write("gpu-node-07: Test NCCL failure common.cu:1005 'unhandled cuda error'\\n")
        sys.exit(3)
        """,
    )
    with pytest.raises(RuntimeError, match="unhandled cuda error") as excinfo:
        run_binary(str(exe), min_bytes=8, max_bytes=1024, ngpus=8)
    assert "status 3" in str(excinfo.value)
    assert len(str(excinfo.value)) < 5000  # a tail, not the whole stream


def test_run_binary_no_rows_is_an_error(tmp_path: Path) -> None:
    exe = _make_exe(tmp_path / "alltoall_perf", "print('# nothing to see')\n")
    with pytest.raises(RuntimeError, match="no data rows"):
        run_binary(str(exe), min_bytes=8, max_bytes=1024, ngpus=8)


def test_run_binary_timeout(tmp_path: Path) -> None:
    exe = _make_exe(tmp_path / "alltoall_perf", "import time\ntime.sleep(30)\n")
    with pytest.raises(RuntimeError, match="timed out"):
        run_binary(str(exe), min_bytes=8, max_bytes=1024, ngpus=8, timeout_s=0.5)


def test_run_binary_missing_executable(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot run"):
        run_binary(os.fspath(tmp_path / "nope"), min_bytes=8, max_bytes=1024, ngpus=8)
