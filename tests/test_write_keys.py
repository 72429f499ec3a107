"""formats.write_keys on the CPU, against an element-by-element pure-Python writer; on a GPU
(tests marked ``gpu``, below), the fused writer kernel against the CPU writer.

The oracle below uses Python floats and integers only: fp32 rounding through ``struct``, e4m3
and e2m1 rounding by searching every value of the format for the nearest (ties to the even
code), bf16 by rounding the fp32 bit pattern. It places bytes by offsets spelled out in
``_write_cases`` (never through ``cpindex.formats``), so every byte of every buffer, pool bytes
and skipped slots included, is predicted.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from _write_cases import KEY_DTYPES, KINDS, make_keys, make_slots, make_target

from cpindex import BadBlockTableError, formats
from cpindex.errors import BadSlotError, CPIndexError

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_value(byte: int) -> Fraction:
    exp, man = (byte >> 3) & 0xF, byte & 7
    mag = (
        Fraction(man, 8) * Fraction(1, 64)
        if exp == 0
        else (1 + Fraction(man, 8)) * Fraction(2) ** (exp - 7)
    )
    return -mag if byte & 0x80 else mag


E4M3 = [_e4m3_value(b) for b in range(0x7F)]  # the finite non-negative values, bytes 0..0x7E


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3_byte(v: float) -> int:
    """The e4m3 byte nearest ``v`` (ties to the even byte, i.e. even mantissa), saturating at
    448; the sign is kept, so negatives that round to zero give -0 (0x80)."""
    a = Fraction(abs(v))
    b = 0x7E if a >= 448 else min(range(0x7F), key=lambda b: (abs(E4M3[b] - a), b & 1))
    return b | (0x80 if math.copysign(1.0, v) < 0 else 0)


def e2m1_code(r: float) -> int:
    """The nearest e2m1 code (ties to the even code), |r| > 6 -> 6, never -0."""
    c = min(range(8), key=lambda c: (abs(Fraction(E2M1[c]) - Fraction(abs(r))), c & 1))
    return c | (8 if r < 0 and c else 0)


def nvfp4_token(x: list[float]) -> list[bytes]:
    """MiniMax's writer, one token: (64 code bytes, 8 scale bytes)."""
    codes, scales = [], []
    for g in range(8):
        grp = x[16 * g : 16 * g + 16]
        q = f32(max(max(abs(v) for v in grp), f32(1e-12)) / 6)  # fp32 division
        s_byte = e4m3_byte(q)
        if E4M3[s_byte] < Fraction(2) ** -9:
            s_byte = 0x01  # at least 2**-9
        s = float(E4M3[s_byte])
        scales.append(s_byte)
        codes += [e2m1_code(f32(v / s)) for v in grp]
    packed = bytes(codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(64))
    return [packed, bytes(scales)]


def fp8_token(x: list[float]) -> list[bytes]:
    return [bytes(e4m3_byte(max(-448.0, min(448.0, v))) for v in x)]  # clamp, then round


def bf16_token(x: list[float]) -> list[bytes]:
    out = bytearray()
    for v in x:
        b = struct.unpack("<I", struct.pack("<f", v))[0]
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        out += bytes((b & 0xFF, b >> 8))
    return [bytes(out)]


ORACLE = {"bf16": bf16_token, "fp8": fp8_token, "nvfp4": nvfp4_token}


def oracle_write(target, keys: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
    """The target's buffers as they must be after the write (from a snapshot of them now)."""
    want = target.snapshot()
    for x, s in zip(keys.float().tolist(), slots.tolist(), strict=True):
        if s < 0:
            continue
        for (buf, off), data in zip(
            target.spans(s // 128, s % 128), ORACLE[target.fmt](x), strict=True
        ):
            want[buf][off : off + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return want


def assert_buffers(target, want: list[torch.Tensor]) -> None:
    for got, exp in zip(target.snapshot(), want, strict=True):
        diff = (got != exp).nonzero().flatten()
        assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at byte {diff[:8].tolist()}"


# --------------------------------------------------------------------------- the oracle itself


def test_oracle_e2m1_ties() -> None:
    """The ties of the e2m1 grid go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (and their negatives), saturating at 6, never -0."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert [E2M1[e2m1_code(v)] for v in ties] == want
    assert [e2m1_code(-v) for v in ties] == [0] + [c | 8 for c in (2, 2, 4, 4, 6, 6)]
    assert [e2m1_code(v) for v in (6.0, 6.5, 1e9, -7.0, -0.0, -0.2, 0.2)] == [7, 7, 7, 15, 0, 0, 0]


def test_oracle_matches_formats_helpers() -> None:
    """The oracle's e4m3 rounding agrees with torch's (checked bit-level elsewhere)."""
    xs = [0.0, -0.0, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 447.9, 465.0, 480.0, 1e6, -3.3, 0.17]
    for v in xs:
        t = formats.e4m3_rn_satfinite(torch.tensor([v])).to(torch.float8_e4m3fn).view(torch.uint8)
        assert e4m3_byte(v) == int(t), v


# --------------------------------------------------------------------------- writes


@pytest.mark.parametrize("dtype", KEY_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_write_matches_oracle(kind: str, dtype: torch.dtype) -> None:
    """Every byte after a write: the written tokens hold the oracle's bytes, every other byte
    (skipped slots, other tokens, pool bytes around the cache) is what it was."""
    target = make_target(kind, pages=3, seed=KINDS.index(kind))
    keys = make_keys(24, dtype, seed=1)
    slots = make_slots(24, 3 * 128, seed=2)
    assert bool((slots < 0).any()) and int(slots.max()) == 3 * 128 - 1
    want = oracle_write(target, keys, slots)
    for slot_dtype in (torch.int64, torch.int32):
        formats.write_keys(target.cache, keys, slots.to(slot_dtype))
        assert_buffers(target, want)  # the int32 rewrite of the same slots changes nothing


@pytest.mark.parametrize("kind", ["bf16", "fp8-pool", "nvfp4-pool", "nvfp4-interleaved"])
def test_strided_keys_and_slots(kind: str) -> None:
    """Keys with a row stride (a slice of a wider tensor) and a strided slot_mapping."""
    target = make_target(kind, pages=2, seed=5)
    wide = torch.zeros(16, 3, 128)
    wide[:, 1] = make_keys(16, torch.float32, seed=6)
    slots = torch.stack([make_slots(16, 256, seed=7), torch.zeros(16, dtype=torch.int64)], 1)
    want = oracle_write(target, wide[:, 1], slots[:, 0])
    formats.write_keys(target.cache, wide[:, 1], slots[:, 0])
    assert_buffers(target, want)


@pytest.mark.parametrize("kind", ["fp8", "nvfp4-page_major_3d", "nvfp4-pair"])
def test_later_writes_overwrite(kind: str) -> None:
    target = make_target(kind, pages=2, seed=8)
    slots = make_slots(20, 256, seed=9)
    formats.write_keys(target.cache, make_keys(20, torch.float32, seed=10), slots)
    keys = make_keys(20, torch.float32, seed=11)
    want = oracle_write(target, keys, slots)
    formats.write_keys(target.cache, keys, slots)
    assert_buffers(target, want)


def test_empty_write() -> None:
    target = make_target("nvfp4", pages=1)
    before = target.snapshot()
    formats.write_keys(target.cache, torch.zeros(0, 128), torch.zeros(0, dtype=torch.int64))
    assert_buffers(target, before)


# --------------------------------------------------------------------------- quantize agrees


@pytest.mark.parametrize("dtype", KEY_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_quantize_writes_what_write_keys_writes(fmt: str, dtype: torch.dtype) -> None:
    keys = make_keys(2 * 128, dtype, seed=12)
    whole = formats.quantize(keys.view(2, 128, 128), fmt)
    target = make_target(fmt, pages=2, seed=13)
    formats.write_keys(target.cache, keys, torch.arange(256))
    assert torch.equal(target.buffers[0], whole.contiguous().view(-1).view(torch.uint8))
    if fmt == "nvfp4":  # every in-page layout, one quantizer
        pair = formats.quantize(keys.view(2, 128, 128), fmt, layout="pair")
        iv = formats.quantize(keys.view(2, 128, 128), fmt, layout="interleaved")
        target = make_target("nvfp4-interleaved", pages=2, seed=14)
        formats.write_keys(target.cache, keys, torch.arange(256))
        assert torch.equal(target.buffers[0].view(2, 9216), iv)
        target = make_target("nvfp4-pair", pages=2, seed=15)
        formats.write_keys(target.cache, keys, torch.arange(256))
        assert torch.equal(target.buffers[0].view(2, 128, 64), pair[0])
        assert torch.equal(target.buffers[1].view(2, 128, 8), pair[1].view(torch.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind: str) -> None:
    """write_keys -> dequantize: the key values of quantize (bit for bit) and within the
    format's error of the keys."""
    target = make_target(kind, pages=2, seed=16)
    keys = torch.randn(256, 128, generator=torch.Generator().manual_seed(17))
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(18))
    formats.write_keys(target.cache, keys[perm], perm)
    got = formats.dequantize(target.cache, target.fmt).view(256, 128)
    want = formats.dequantize(formats.quantize(keys.view(2, 128, 128), target.fmt), target.fmt)
    assert torch.equal(got.view(torch.int32), want.view(-1, 128).view(torch.int32))
    err = (got - keys).abs()
    if target.fmt == "nvfp4":
        # half an e2m1 step (at most one scale, |x / s| in (4, 6]; saturation costs less) with
        # the scale amax / 6 rounded up to 2**-4 relative, then the key value's e4m3 rounding
        s = keys.abs().view(256, 8, 16).amax(-1, keepdim=True) / 6 * 1.0625
        bound = (s * 1.0625 + keys.abs().view(256, 8, 16) * 2.0**-4).view(256, 128)
    else:
        bound = keys.abs() * (2.0**-8 if target.fmt == "bf16" else 2.0**-4)
    assert bool((err <= bound + 2.0**-9).all())


# --------------------------------------------------------------------------- bad input


def _bad_calls(target) -> list[tuple[type[Exception], str, object, object, object]]:
    keys = make_keys(6, torch.float32, seed=19)
    slots = torch.tensor([0, 5, -1, 130, 255, 7])
    nan = keys.clone()
    nan[3, 77] = float("nan")
    inf = keys.clone()
    inf[5, 0] = -float("inf")
    past = slots.clone()
    past[4] = 256  # pages * 128: the first slot past the cache
    meta = torch.device("meta")
    c, k, s = target.cache, keys, slots
    i32 = r"slot_mapping: expected a torch\.int32 or torch\.int64 tensor, got "
    ftype = r"keys: expected a bf16/fp16/fp32 tensor, got "
    fshape = r"keys: expected shape \[tokens, 128\], got "
    sshape = r"slot_mapping: expected shape \[tokens\] = \[6\] \(one slot per key\), got "
    dev = r"expected a tensor on the cache's device cpu, got meta"
    infer = r"index_cache: cannot infer cache_format"
    return [
        (
            ValueError,
            r"slot_mapping: token 4 has slot 256, outside the cache's 256 slots",
            c,
            k,
            past,
        ),
        (ValueError, r"token 1 has slot 1000000", c, k, torch.tensor([0, 10**6, 2, 3, 4, 5])),
        (ValueError, r"keys: contains NaN or Inf", c, nan, s),
        (ValueError, r"keys: contains NaN or Inf", c, inf, s),
        (TypeError, ftype + r"torch\.float64 \[6, 128\]", c, k.double(), s),
        (TypeError, ftype + r"torch\.int32", c, k.to(torch.int32), s),
        (TypeError, ftype + "list", c, k.tolist(), s),
        (ValueError, fshape + r"\[6, 64\]", c, k[:, :64], s),
        (ValueError, fshape + r"\[6, 1, 128\]", c, k[:, None], s),
        (TypeError, i32 + r"torch\.float32 \[6\]", c, k, s.float()),
        (TypeError, i32 + r"torch\.int16", c, k, s.to(torch.int16)),
        (TypeError, i32 + "list", c, k, s.tolist()),
        (ValueError, sshape + r"\[5\]", c, k, s[:5]),
        (ValueError, sshape + r"\[6, 1\]", c, k, s[:, None]),
        (ValueError, "keys: " + dev, c, k.to(meta), s),
        (ValueError, "slot_mapping: " + dev, c, k, s.to(meta)),
        (TypeError, infer, torch.zeros(2, 128, 128), k, s),
        (TypeError, infer, torch.zeros(2, 9000, dtype=torch.uint8), k, s),
    ]


@pytest.mark.parametrize("kind", ["bf16-pool", "fp8", "nvfp4", "nvfp4-pool", "nvfp4-interleaved"])
def test_bad_input_refused_before_any_write(kind: str) -> None:
    target = make_target(kind, pages=2, seed=20)
    before = target.snapshot()
    for exc, match, cache, keys, slots in _bad_calls(target):
        with pytest.raises(exc, match=match):
            formats.write_keys(cache, keys, slots)  # type: ignore[arg-type]
        assert_buffers(target, before)


def test_bad_cache_refused() -> None:
    keys, slots = make_keys(2, torch.float32), torch.tensor([0, 1])
    pool80 = torch.zeros(2, 128, 80, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"index_cache: the trailing \[128, 72\] dims must be"):
        formats.write_keys(pool80[:, :, :72], keys, slots)
    packed = torch.zeros(2, 128, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"index_cache: NVFP4 pair disagrees"):
        formats.write_keys((packed, torch.zeros(3, 128, 8, dtype=torch.uint8)), keys, slots)
    with pytest.raises(ValueError, match=r"index_cache: .*contiguous"):
        formats.write_keys(
            torch.zeros(2, 128, 128, dtype=torch.bfloat16).transpose(1, 2), keys, slots
        )
    assert not bool(pool80.any()) and not bool(packed.any())


def test_check_writes_on_cpu_is_a_no_op() -> None:
    formats.check_writes("cpu")
    formats.check_writes(torch.device("cpu"))


def test_bad_slot_error_class() -> None:
    assert issubclass(BadSlotError, CPIndexError) and issubclass(BadSlotError, ValueError)
    assert not issubclass(BadSlotError, BadBlockTableError)


# --------------------------------------------------------------------------- on a GPU
# formats.write_keys on the GPU (the fused writer kernel) against the CPU writer, bit for bit.
#
# The CPU writer is checked element by element against a pure-Python one (above);
# here every format, form and key dtype must give the same bytes on the device, every byte of the
# buffers included (skipped slots, pool bytes). Also: a slot past the cache reported through the
# error word (``check_writes``), and a write captured in a CUDA graph and replayed.


DEV = "cuda"


@pytest.fixture(scope="module")
def _writer_kernel():
    from cpindex.kernels import load

    if not hasattr(load(torch.device(DEV, torch.cuda.current_device())), "write_keys"):
        pytest.skip("the kernel module has no write_keys binding")


def _same_on_both(kind: str, pages: int, keys: torch.Tensor, slots: torch.Tensor, seed: int):
    """Write on the CPU and on the GPU into identical poisoned caches; both targets."""
    cpu = make_target(kind, pages, "cpu", seed)
    gpu = make_target(kind, pages, DEV, seed)
    formats.write_keys(cpu.cache, keys, slots)
    formats.write_keys(gpu.cache, keys.to(DEV), slots.to(DEV))
    torch.cuda.synchronize()
    return cpu, gpu


def _assert_same(cpu, gpu) -> None:
    for a, b in zip(cpu.snapshot(), gpu.snapshot(), strict=True):
        diff = (a != b).nonzero().flatten()
        assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


@pytest.mark.gpu
@pytest.mark.usefixtures("_writer_kernel")
@pytest.mark.parametrize("dtype", KEY_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_equals_cpu(kind: str, dtype: torch.dtype) -> None:
    pages = 40
    keys = make_keys(3000, dtype, seed=KINDS.index(kind))
    slots = make_slots(3000, pages * 128, seed=3)
    for slot_dtype in (torch.int64, torch.int32):
        cpu, gpu = _same_on_both(kind, pages, keys, slots.to(slot_dtype), seed=4)
        _assert_same(cpu, gpu)
    formats.check_writes(DEV)


@pytest.mark.gpu
@pytest.mark.usefixtures("_writer_kernel")
@pytest.mark.parametrize("kind", ["bf16", "fp8-pool", "nvfp4-pool", "nvfp4-interleaved"])
def test_gpu_strided_keys_and_slots(kind: str) -> None:
    """Keys with a row stride and a strided int32 slot_mapping, as a stack may hand them."""
    keys = torch.zeros(500, 2, 128)
    keys[:, 1] = make_keys(500, torch.float32, seed=5)
    slots = torch.stack([make_slots(500, 8 * 128, seed=6), torch.zeros(500, dtype=torch.int64)])
    slots = slots.T.to(torch.int32)
    cpu = make_target(kind, 8, "cpu", seed=7)
    gpu = make_target(kind, 8, DEV, seed=7)
    formats.write_keys(cpu.cache, keys[:, 1], slots[:, 0])
    formats.write_keys(gpu.cache, keys.to(DEV)[:, 1], slots.to(DEV)[:, 0])
    torch.cuda.synchronize()
    _assert_same(cpu, gpu)


@pytest.mark.gpu
@pytest.mark.usefixtures("_writer_kernel")
@pytest.mark.parametrize("kind", ["bf16", "fp8", "nvfp4", "nvfp4-interleaved"])
def test_slot_past_the_cache_is_reported(kind: str) -> None:
    """A slot >= pages * 128 is skipped and reported; the other keys are written."""
    pages, bad_token = 4, 13
    keys = make_keys(50, torch.float32, seed=8)
    slots = make_slots(50, pages * 128, seed=9)
    past = slots.clone()
    past[bad_token] = pages * 128 + 5
    cpu = make_target(kind, pages, "cpu", seed=10)
    gpu = make_target(kind, pages, DEV, seed=10)
    skipped = past.clone()
    skipped[bad_token] = -1
    formats.write_keys(cpu.cache, keys, skipped)
    formats.write_keys(gpu.cache, keys.to(DEV), past.to(DEV))  # no error at launch
    torch.cuda.synchronize()
    _assert_same(cpu, gpu)
    with pytest.raises(
        BadSlotError, match=rf"token {bad_token} has slot_mapping {pages * 128 + 5}"
    ):
        formats.check_writes(DEV)
    formats.check_writes(DEV)  # reported once; the word is clear again
    formats.write_keys(gpu.cache, keys.to(DEV), slots.to(DEV))
    torch.cuda.synchronize()
    formats.check_writes(torch.device(DEV, torch.cuda.current_device()))


@pytest.mark.gpu
@pytest.mark.usefixtures("_writer_kernel")
def test_bad_input_refused_on_the_host() -> None:
    """Shape, dtype and device errors raise before anything is launched."""
    target = make_target("nvfp4", 2, DEV, seed=11)
    before = target.snapshot()
    keys = make_keys(4, torch.float32).to(DEV)
    slots = torch.tensor([0, 1, 2, 3], device=DEV)
    with pytest.raises(ValueError, match=r"keys: expected a tensor on the cache's device"):
        formats.write_keys(target.cache, keys.cpu(), slots)
    with pytest.raises(ValueError, match=r"slot_mapping: expected a tensor on the cache's device"):
        formats.write_keys(target.cache, keys, slots.cpu())
    with pytest.raises(TypeError, match=r"slot_mapping: expected a torch\.int32 or torch\.int64"):
        formats.write_keys(target.cache, keys, slots.float())
    with pytest.raises(ValueError, match=r"keys: expected shape \[tokens, 128\]"):
        formats.write_keys(target.cache, keys[:, :64], slots)
    torch.cuda.synchronize()
    for a, b in zip(before, target.snapshot(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.usefixtures("_writer_kernel")
@pytest.mark.parametrize("kind", ["fp8", "nvfp4-page_major_3d", "nvfp4-interleaved"])
def test_graph_capture_and_replay(kind: str) -> None:
    """A write captured in a CUDA graph (the first write on the device, made eagerly, sets up
    its error word) writes the static inputs' current contents at every replay."""
    pages = 16
    target = make_target(kind, pages, DEV, seed=12)
    static_keys = make_keys(300, torch.bfloat16, seed=13).to(DEV)
    static_slots = make_slots(300, pages * 128, seed=14).to(DEV).to(torch.int32)
    formats.write_keys(target.cache, static_keys, static_slots)  # warm-up, outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        formats.write_keys(target.cache, static_keys, static_slots)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        keys = make_keys(300, torch.bfloat16, seed=20 + step)
        slots = make_slots(300, pages * 128, seed=30 + step).to(torch.int32)
        cpu = make_target(kind, pages, "cpu", seed=12)
        for i, buf in enumerate(target.snapshot()):  # the CPU copy starts where the GPU is
            cpu.buffers[i].copy_(buf)
        formats.write_keys(cpu.cache, keys, slots)
        static_keys.copy_(keys)
        static_slots.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(cpu, target)
    formats.check_writes(DEV)
