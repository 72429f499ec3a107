"""What the command line's modules share (``cli``, ``demo``, ``bench``, ``build``): the option
values, the usage error and the checks made before anything runs. No torch import at module
level: ``--help`` and argument errors stay fast."""

from __future__ import annotations

import os
from pathlib import Path

BENCH_EXTRA = "pip install cpindex[bench]"
GPU_TRANSPORTS = ("ipc", "mori")  # the transports that need GPUs
TRANSPORTS = ["auto", "ipc", "mori", "collective"]
FORMATS = ["bf16", "fp8", "nvfp4"]
# cpindex.testing.NVFP4_FORMS but page_major (plain nvfp4), spelled out: no torch import here
NVFP4_FORMS = [f"nvfp4-{f}" for f in ("page_major_3d", "pool", "pair", "interleaved")]
GIB = 1 << 30


class UsageError(ValueError):
    """Something the user asked for that this run cannot do, found before it starts: printed as
    one line, exit status 2."""


def first_error(e: BaseException) -> str:
    """The first message of ``e`` on one line. A pydantic ValidationError gives its first
    error, naming the field and the value it got (``max_rows=100000: Input should be ...``)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        err = errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err.get("loc", ()))
        return f"{loc}={err.get('input')!r}: {msg}" if loc else msg
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def check_writable(path: str, option: str) -> None:
    """Refuse ``option``'s output ``path`` unless a file can be written there: its folder
    exists and is writable, and it is not a folder or a read-only file (checked before a run,
    so a long run never ends in an error about its output)."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: directory {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


#: What a rank holds besides its problem and buffers: the interpreter and torch and the
#: reference's chunks (kept to a few hundred MB) on the host; the context and the kernel module
#: on a GPU.
HOST_OVERHEAD = 512 << 20
DEVICE_OVERHEAD = 1 << 30
#: Peak host bytes of building a random problem (``testing.make_problem``) per byte of its
#: float32 keys: the keys, their normalization and the quantizer's temporaries (measured 3 to
#: 5.4 over formats and sizes).
KEYS_PEAK = 6


def problem_bytes(requests: int, context: int, bytes_per_token: int) -> tuple[int, int]:
    """``(host peak, cache)`` bytes of one random problem of ``requests`` requests up to
    ``context`` tokens (``testing.make_problem``: float32 keys quantized on the host)."""
    pages = requests * -(-context // 128) + 3
    return KEYS_PEAK * pages * 128 * 128 * 4, pages * 128 * bytes_per_token


def check_world_memory(what: str, world: int, gpus: int, host: int, device: int, fix: str) -> None:
    """Refuse ``world`` ranks that each need ``host`` bytes of host memory and ``device`` bytes
    on their GPU (``gpus`` of them; fewer than ``world``: every rank on GPU 0, the one-process
    world) where this machine has less free."""
    check_memory(what, world * host, host_available_bytes(), "host memory", fix)
    if gpus:
        shared = gpus < world
        free = min(device_free_bytes(i) for i in range(1 if shared else world))
        check_memory(what, device * (world if shared else 1), free, "memory per GPU", fix)


def host_available_bytes() -> int | None:
    """Memory this machine can still hand out (Linux ``MemAvailable``; else free pages), or
    None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_free_bytes(index: int) -> int:
    """Free memory of GPU ``index`` (what ``cudaMemGetInfo`` reports)."""
    import torch

    return torch.cuda.mem_get_info(index)[0]


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def check_memory(what: str, need: int, have: int | None, where: str, fix: str) -> None:
    """Refuse a run that needs ``need`` bytes of memory where only ``have`` are free (one line
    naming the options to ``fix``); nothing is checked where ``have`` is unknown."""
    if have is not None and need > have:
        raise UsageError(f"{what} needs about {gib(need)} of {where}, {gib(have)} free; {fix}")
