"""The fused key writer (``mod.write_keys``) alone, against a torch implementation of the same
math, on every cache form it writes.

Runs on a GPU only. Caches start as random bytes, so a byte the kernel should not write (a
skipped slot, another token, another page) or should have written is caught; the whole cache is
compared bytewise with the expected one.
"""

from __future__ import annotations

import ctypes as C

import pytest
import torch
from _gpu import in_child, needs_gpu

from cpindex.kernels import load, structs

pytestmark = [needs_gpu, pytest.mark.gpu]

PAGE = 128
BF16, FP8, NVFP4 = 0, 1, 2
KEY_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# nvfp4 caches: page-major 2-D [pages, 9216] and 3-D [pages, 128, 72] (the same bytes), and a
# token-interleaved [pages, 128, 72] passed as its pair of views
NVFP4_FORMS = ["product", "page3d", "interleaved"]


# ---- the math, in torch -------------------------------------------------------------------------
def e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes of fp32 ``x``: clamp to +-448, then round to nearest even (torch's cast)."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def nvfp4_ref(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n, 64], scale bytes uint8 [n, 8]) of fp32 math on ``keys`` [n, 128]."""
    n = keys.shape[0]
    x = keys.float().reshape(n, 8, 16)
    amax = x.abs().amax(-1)
    sb = e4m3_bytes(amax.clamp_min(1e-12) / 6.0)
    sb = torch.maximum(sb, torch.ones_like(sb))  # max(scale, 2**-9): byte 1
    scale = sb.view(torch.float8_e4m3fn).float()
    q = x / scale[..., None]
    a = q.abs()
    code = sum(
        (a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0),
        torch.zeros_like(a, dtype=torch.int32),
    )
    code = torch.where((code != 0) & (q < 0), code | 8, code)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8).reshape(n, 64)
    return packed, sb


def row_ref(keys: torch.Tensor, fmt: int):
    """What a token's row holds after the write: bf16/fp8 bytes [n, 128 * size], or nvfp4's
    (codes, scales)."""
    k = keys.cpu()
    if fmt == BF16:
        return k.float().to(torch.bfloat16).view(torch.uint8)
    if fmt == FP8:
        return e4m3_bytes(k)
    return nvfp4_ref(k)


# ---- caches and their views ---------------------------------------------------------------------
def make_cache(fmt: int, pages: int, form: str, device) -> torch.Tensor:
    """A cache of random bytes: nvfp4 in ``form``; bf16/fp8 [pages, 128, 128], or with "offset"
    [pages, 128, 132] whose view starts one element in (rows not 16-byte aligned)."""
    gen = torch.Generator().manual_seed(pages * 7 + fmt)
    if fmt == NVFP4:
        n = pages * PAGE * 72
        shape = (pages, 9216) if form == "product" else (pages, PAGE, 72)
    else:
        n = pages * PAGE * 128 * (2 if fmt == BF16 else 1)
        shape = None
    if fmt != NVFP4 and form == "offset":
        n += 4 * (2 if fmt == BF16 else 1) * PAGE * pages
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if fmt == NVFP4:
        return raw.reshape(shape).to(device)
    dtype = torch.bfloat16 if fmt == BF16 else torch.float8_e4m3fn
    width = 132 if form == "offset" else 128
    return raw.view(dtype).reshape(pages, PAGE, width).to(device)


def views(cache: torch.Tensor, fmt: int, form: str):
    """(kv, ks) as the binding takes them."""
    if fmt != NVFP4:
        return (cache[..., 1:129] if form == "offset" else cache), None
    pages = cache.shape[0]
    if form == "interleaved":
        return cache[..., :64], cache[..., 64:]
    flat = cache.reshape(pages, 9216)
    return flat[:, :8192].view(pages, PAGE, 64), flat[:, 8192:].view(pages, PAGE, 8)


def expected(cache: torch.Tensor, fmt: int, form: str, keys, slots) -> torch.Tensor:
    """The cache (on the CPU) after writing keys[i] at every valid slot."""
    exp = cache.cpu().clone()
    kv, ks = views(exp, fmt, form)
    ref = row_ref(keys, fmt)
    limit = kv.shape[0] * PAGE
    for i, s in enumerate(slots.tolist()):
        if s < 0 or s >= limit:
            continue
        p, t = divmod(s, PAGE)
        if fmt == NVFP4:
            kv[p, t] = ref[0][i]
            ks[p, t] = ref[1][i]
        else:
            kv[p, t].view(torch.uint8).copy_(ref[i])
    return exp


class Word:
    """An ErrorWord in device memory and its host-mapped mirror, as the library's monitor
    holds them."""

    def __init__(self, mod, device):
        size = C.sizeof(structs.ErrorWord)
        self.dev = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        self.dev_ptr = self.dev.data_ptr()
        self.host_ptr = mod.host_device_pointer(self.host.data_ptr())

    def read(self) -> tuple[structs.ErrorWord, structs.ErrorWord]:
        torch.cuda.synchronize()
        dev = structs.ErrorWord.from_buffer_copy(bytes(self.dev.cpu().tolist()))
        host = structs.ErrorWord.from_buffer_copy(bytes(self.host.tolist()))
        return dev, host


@pytest.fixture(scope="module")
def mod():
    return load(torch.device("cuda", 0))


def write(mod, keys, slots, cache, fmt, form, word=None):
    word = word or Word(mod, keys.device)
    kv, ks = views(cache, fmt, form)
    mod.write_keys(keys, slots, kv, ks, fmt, word.dev_ptr, word.host_ptr)
    return word


def check(mod, keys, slots, fmt, form, pages):
    cache = make_cache(fmt, pages, form, "cuda")
    want = expected(cache, fmt, form, keys, slots)
    word = write(mod, keys, slots, cache, fmt, form)
    dev, host = word.read()
    assert dev.code == 0 and host.code == 0, (dev.code, host.code)
    got = cache.cpu().view(torch.uint8)
    want = want.view(torch.uint8)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


def random_slots(n: int, pages: int, gen: torch.Generator, skip: int = 0) -> torch.Tensor:
    slots = torch.randperm(pages * PAGE, generator=gen)[:n]
    if skip:
        slots[torch.randperm(n, generator=gen)[:skip]] = -1
    return slots.to("cuda")


# ---- crafted keys -------------------------------------------------------------------------------
def nvfp4_crafted() -> torch.Tensor:
    """fp32 [8, 128]: groups whose quotients hit every e2m1 boundary exactly (and just off it),
    zero, tiny, subnormal-scale, rounded-down-scale and huge groups."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    groups = []
    for s in (1.0, 0.375, 2.0**-6, 3 * 2.0**-9, 448.0 / 8):  # e4m3 values: the scale is exact
        g = [6 * s] + [v * s for v in ties] + [-v * s for v in ties] + [-0.0]
        groups.append(g)
        up = torch.nextafter(torch.tensor(ties) * s, torch.tensor(1e9)).tolist()
        dn = torch.nextafter(torch.tensor(ties) * s, torch.tensor(-1e9)).tolist()
        groups.append([6 * s] + up + [-v for v in dn] + [0.0])
    groups += [
        [0.0] * 16,
        [-0.0] * 16,
        [1e-8, -1e-8, 2e-12, 0.0] * 4,  # amax / 6 below e4m3: scale 2**-9, codes 0
        [6.375, -6.375, 0.5, 6.3, -6.2] + [1.0625 * v for v in range(-5, 6)],  # |q| > 6
        [1e6, -1e6, 3e5, 1.0] * 4,  # scale saturates at 448
        [5.0 * 2.0**-9, -2.5 * 2.0**-9, 2.0**-10, 0.3] * 4,
        [3.4e38, -1e38, 1e-38, 1e-45] * 4,
    ]
    rows = torch.tensor(groups, dtype=torch.float32)  # [G, 16]
    pad = (-rows.shape[0]) % 8
    rows = torch.cat([rows, rows[:pad].flip(-1)])
    return rows.reshape(-1, 128)


def e4m3_crafted() -> torch.Tensor:
    """fp32 [n, 128]: every e4m3 value, the midpoints between neighbours and their float
    neighbours, both signs, out of range, subnormal ties, zeros."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)].unique()
    mid = (v[1:] + v[:-1]) / 2
    extra = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e6, 3e38, 2.0**-10, 3 * 2.0**-10, 1e-45])
    x = torch.cat(
        [v, mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), extra, -extra]
    )
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0])])
    x = torch.cat([x, torch.zeros((-x.numel()) % 128)])
    return x.reshape(-1, 128)


def bf16_crafted() -> torch.Tensor:
    """fp32 [n, 128]: halfway cases of the bf16 rounding (both parities), and neighbours."""
    base = torch.randn(64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    bits = base.view(torch.int32)
    half = (bits + 0x8000).view(torch.float32)  # exactly halfway to the next bf16
    x = torch.cat([base, half, torch.nextafter(half, half * 2), torch.nextafter(half, half * 0)])
    x = torch.cat([x, -x, torch.tensor([3.4e38, 1e-40, 0.0, -0.0])])
    x = torch.cat([x, torch.zeros((-x.numel()) % 128)])
    return x.reshape(-1, 128)


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", NVFP4_FORMS)
def test_nvfp4_crafted_groups(mod, form):
    keys = nvfp4_crafted().cuda()
    gen = torch.Generator().manual_seed(1)
    check(mod, keys, random_slots(keys.shape[0], 3, gen), NVFP4, form, pages=3)


def test_nvfp4_reference_hits_every_code():
    # the crafted groups give every code but -0 (8, never written), the smallest and the
    # largest scale
    codes, scales = nvfp4_ref(nvfp4_crafted())
    nibbles = torch.cat([codes & 15, codes >> 4]).unique()
    assert nibbles.tolist() == [c for c in range(16) if c != 8]
    assert 1 in scales.flatten().tolist() and 126 in scales.flatten().tolist()


@pytest.mark.parametrize("fmt", [BF16, FP8])
def test_bf16_fp8_crafted(mod, fmt):
    keys = (bf16_crafted() if fmt == BF16 else e4m3_crafted()).cuda()
    gen = torch.Generator().manual_seed(2)
    pages = 2
    check(mod, keys, random_slots(keys.shape[0], pages, gen), fmt, "plain", pages)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=str)
@pytest.mark.parametrize(
    "fmt, form",
    [(BF16, "plain"), (BF16, "offset"), (FP8, "plain"), (FP8, "offset")]
    + [(NVFP4, f) for f in NVFP4_FORMS],
)
def test_random_keys(mod, key_dtype, fmt, form):
    gen = torch.Generator().manual_seed(3 + fmt)
    pages, n = 5, 300
    scale = torch.logspace(-6, 3, n).unsqueeze(1)  # rows of very different magnitudes
    keys = (torch.randn(n, 128, generator=gen) * scale).to(key_dtype).cuda()
    check(mod, keys, random_slots(n, pages, gen, skip=40), fmt, form, pages)


@pytest.mark.parametrize("fmt", [BF16, FP8, NVFP4])
def test_strided_key_rows_and_decode_sizes(mod, fmt):
    # rows 129 floats apart (no 16-byte alignment), and the decode step's few tokens
    gen = torch.Generator().manual_seed(4)
    form = "interleaved" if fmt == NVFP4 else "plain"
    for n in (1, 3, 8):
        wide = torch.randn(n, 129, generator=gen).cuda()
        keys = wide[:, 1:]
        assert keys.stride(0) == 129 and keys.data_ptr() % 16 != 0
        check(mod, keys, random_slots(n, 2, gen), fmt, form, pages=2)


@pytest.mark.parametrize("fmt", [BF16, FP8, NVFP4])
def test_out_of_range_slot_is_reported_and_skipped(mod, fmt):
    pages, n = 2, 10
    gen = torch.Generator().manual_seed(6)
    keys = torch.randn(n, 128, generator=gen).cuda()
    slots = random_slots(n, pages, gen, skip=2)
    bad_token, bad_slot = 7, pages * PAGE + 5
    slots[bad_token] = bad_slot
    form = "product" if fmt == NVFP4 else "plain"
    cache = make_cache(fmt, pages, form, "cuda")
    want = expected(cache, fmt, form, keys, slots)  # skips the bad slot like -1
    dev, host = write(mod, keys, slots, cache, fmt, form).read()
    for w in (dev, host):
        assert (w.code, w.peer, w.detail) == (structs.ERR_SLOT, bad_token, bad_slot)
    assert torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8))


def test_no_tokens_is_a_no_op(mod):
    cache = make_cache(FP8, 1, "plain", "cuda")
    before = cache.clone()
    keys = torch.empty(0, 128, device="cuda")
    slots = torch.empty(0, dtype=torch.int64, device="cuda")
    assert write(mod, keys, slots, cache, FP8, "plain").read()[0].code == 0
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_graph_capture_replays_the_write(mod):
    pages, n = 3, 4
    gen = torch.Generator().manual_seed(8)
    keys = torch.randn(n, 128, generator=gen).cuda()
    slots = random_slots(n, pages, gen)
    cache = make_cache(NVFP4, pages, "product", "cuda")
    kv, ks = views(cache, NVFP4, "product")
    word = Word(mod, keys.device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.write_keys(keys, slots, kv, ks, NVFP4, word.dev_ptr, word.host_ptr)
    torch.cuda.synchronize()
    for _ in range(2):  # new keys and slots in the captured buffers, then replay
        keys.copy_(torch.randn(n, 128, generator=gen))
        slots.copy_(random_slots(n, pages, gen))
        want = expected(cache, NVFP4, "product", keys, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.cpu(), want)
    assert word.read()[0].code == 0


def test_bad_arguments_are_refused():
    """The raw binding raises, naming the argument, and writes nothing. Its messages are built
    without streaming numbers, which crashed the process on torch 2.11 (binding.cpp); the
    calls run in a child process so that a crash fails this test alone."""
    out = in_child(
        """
        import torch
        from test_write_kernel_gpu import BF16, FP8, NVFP4, Word, load, make_cache, views

        mod = load(torch.device("cuda", 0))
        word = Word(mod, torch.device("cuda", 0))
        keys = torch.randn(2, 128, device="cuda")
        slots = torch.zeros(2, dtype=torch.int64, device="cuda")
        cache = make_cache(NVFP4, 1, "product", "cuda")
        kv, ks = views(cache, NVFP4, "product")
        fp8 = make_cache(FP8, 1, "plain", "cuda")
        calls = [
            (keys.double(), slots, kv, ks, NVFP4),  # key dtype
            (keys[:, :64], slots, kv, ks, NVFP4),  # key width
            (keys, slots.int(), kv, ks, NVFP4),  # slot dtype
            (keys, slots[:1], kv, ks, NVFP4),  # slot count
            (keys, slots, kv, None, NVFP4),  # nvfp4 without scales
            (keys, slots, fp8, None, BF16),  # cache dtype for the format
            (keys, slots, fp8, None, 3),  # format
        ]
        for args in calls:
            try:
                mod.write_keys(*args, word.dev_ptr, word.host_ptr)
                print("accepted")
            except RuntimeError as e:
                print(str(e).splitlines()[0])
        torch.cuda.synchronize()
        print("unchanged", torch.equal(cache, make_cache(NVFP4, 1, "product", "cuda")))
        """
    ).splitlines()
    want = [
        "keys must be float32, bfloat16 or float16, got Double",
        "keys must be a [tokens, 128] GPU tensor with contiguous rows, got [2, 64] with strides "
        "[128, 1] on cuda:0",
        "slots must be a contiguous int64 [2] tensor on cuda:0, got Int [2] on cuda:0",
        "slots must be a contiguous int64 [2] tensor on cuda:0, got Long [1] on cuda:0",
        "nvfp4 needs ks, the scales view uint8 or float8_e4m3fn [1, 128, 8] on cuda:0",
        "kv must be a bfloat16 [pages, 128, 128] cache on cuda:0",
        "format must be 0 (bf16), 1 (fp8) or 2 (nvfp4), got 3",
    ]
    assert len(out) == len(want) + 1, out
    for got, w in zip(out[:-1], want, strict=True):
        assert got.startswith("write_keys: " + w), (got, w)
    assert out[-1] == "unchanged True"
