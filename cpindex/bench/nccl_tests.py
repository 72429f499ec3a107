"""Run nccl-tests / rccl-tests binaries and parse the tables they print.

The binaries (``alltoall_perf``, ``all_gather_perf``, ...) print ``#`` comment lines, then one
data line per message size with the columns::

    size (B)  count (elements)  type  redop  root  \
        out-of-place: time (us)  algbw (GB/s)  busbw (GB/s)  #wrong  \
        in-place:     time (us)  algbw (GB/s)  busbw (GB/s)  #wrong

and a trailing ``# Avg bus bandwidth    : X`` line. ``#wrong`` shows ``N/A`` where no check was
made (in-place alltoall, or any column when run with ``-c 0``). Every other line (warnings,
``NCCL INFO`` lines) is ignored.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

__all__ = [
    "NcclTestRow",
    "find_binary",
    "parse_avg_busbw",
    "parse_output",
    "run_binary",
]

_N_COLUMNS = 13
_AVG_BUSBW_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_STDERR_TAIL_CHARS = 4000


@dataclass(frozen=True)
class NcclTestRow:
    """One data line of an nccl-tests / rccl-tests table (oop = out-of-place, ip = in-place)."""

    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int
    oop_time_us: float
    oop_algbw: float
    oop_busbw: float
    oop_wrong: int | None
    ip_time_us: float
    ip_algbw: float
    ip_busbw: float
    ip_wrong: int | None


def _parse_wrong(token: str) -> int | None:
    if token.upper() == "N/A":
        return None
    return int(token)


def _parse_line(line: str) -> NcclTestRow | None:
    tokens = line.split()
    if len(tokens) != _N_COLUMNS:
        return None
    try:
        return NcclTestRow(
            size_bytes=int(tokens[0]),
            count=int(tokens[1]),
            dtype=tokens[2],
            redop=tokens[3],
            root=int(tokens[4]),
            oop_time_us=float(tokens[5]),
            oop_algbw=float(tokens[6]),
            oop_busbw=float(tokens[7]),
            oop_wrong=_parse_wrong(tokens[8]),
            ip_time_us=float(tokens[9]),
            ip_algbw=float(tokens[10]),
            ip_busbw=float(tokens[11]),
            ip_wrong=_parse_wrong(tokens[12]),
        )
    except ValueError:
        return None


def parse_output(text: str) -> list[NcclTestRow]:
    """Return the data rows of an nccl-tests / rccl-tests table, in printed order.

    Comment lines (``#``), blank lines and any line that does not have the 13 columns with the
    expected types (warnings, ``NCCL INFO`` lines, truncated lines) are skipped.
    """
    rows: list[NcclTestRow] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        row = _parse_line(line)
        if row is not None:
            rows.append(row)
    return rows


def parse_avg_busbw(text: str) -> float | None:
    """Return the value of the ``# Avg bus bandwidth : X`` line (the last one), or None."""
    value: float | None = None
    for raw in text.splitlines():
        match = _AVG_BUSBW_RE.match(raw.strip())
        if match is None:
            continue
        try:
            value = float(match.group(1))
        except ValueError:
            continue
    return value


def find_binary(name: str, explicit: str | None) -> str | None:
    """Locate a test binary: ``explicit`` (a path or a name) if given, else ``name`` on PATH.

    An explicit location that is not an executable file gives None: it is never silently replaced
    by whatever ``name`` finds on PATH.
    """
    if explicit:
        return shutil.which(os.path.expanduser(explicit))
    return shutil.which(name)


def _tail(text: str, limit: int = _STDERR_TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def run_binary(
    path: str,
    *,
    min_bytes: int,
    max_bytes: int,
    ngpus: int,
    iters: int = 100,
    warmup: int = 20,
    timeout_s: float = 300,
) -> list[NcclTestRow]:
    """Run ``path -b MIN -e MAX -f 2 -g NGPUS -n ITERS -w WARMUP -c 0`` and parse its table.

    Raises RuntimeError (with the tail of the tool's stderr, or stdout when stderr is empty) when
    the binary cannot be started, times out, exits non-zero, or prints no data row.
    """
    argv = [
        path,
        "-b",
        str(min_bytes),
        "-e",
        str(max_bytes),
        "-f",
        "2",
        "-g",
        str(ngpus),
        "-n",
        str(iters),
        "-w",
        str(warmup),
        "-c",
        "0",
    ]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or b""
        err_text = err.decode(errors="replace") if isinstance(err, bytes) else err
        raise RuntimeError(
            f"{path} timed out after {timeout_s} s; stderr tail:\n{_tail(err_text)}"
        ) from exc
    except OSError as exc:
        raise RuntimeError(f"cannot run {path}: {exc}") from exc

    if proc.returncode != 0:
        tail = _tail(proc.stderr) or _tail(proc.stdout)
        raise RuntimeError(f"{path} exited with status {proc.returncode}; output tail:\n{tail}")
    rows = parse_output(proc.stdout)
    if not rows:
        tail = _tail(proc.stderr) or _tail(proc.stdout)
        raise RuntimeError(f"{path} printed no data rows; output tail:\n{tail}")
    return rows
