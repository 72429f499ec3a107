"""Agreement fingerprints: 64-bit hashes that ranks compare to prove they hold the same call
inputs (docs/design.md, "Ranks in step").

:func:`plan_fingerprint` hashes what a call reads of the step's shared inputs: every
``seq_lens`` entry, and each request's block-table entries in the columns the scan reads
(``init_blocks <= j < ceil(seq_lens[r] / 128) - local_blocks``). Entries outside them (padding,
forced columns) never count, so garbage there cannot make ranks disagree. :func:`query_hash`
hashes a query tensor's bytes (ranks that own the same head compare theirs).

Both are plain torch ops on the inputs' device, except that on a GPU :func:`plan_fingerprint`
is one launch of the compiled kernel (kernels/agree.h, the same value bit for bit, where the
torch ops take some 30 launches): no host sync, capturable in a CUDA/HIP graph (a replay
recomputes them from the tensors' current contents), and the same value on every device for
the same contents. Each hash is a sum over entries of ``value * weight(position)``
in wrapping int64 arithmetic, with odd 64-bit weights mixed from the position, so a change of
any one entry always changes the hash and a change of several collides with probability about
``2**-64``. Not cryptographic: it catches mistakes, not adversaries.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 128


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch keeps (two's complement)."""
    return x - (1 << 64) if x >= 1 << 63 else x


# splitmix64's constants: every input bit moves every output bit.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
#: Position salts: seq_lens entries and table entries never share a weight.
_SALT_LENS = 1 << 62
_SALT_QUERY = 3 << 61


def _weights(positions: torch.Tensor) -> torch.Tensor:
    """Odd 64-bit weights of int64 ``positions`` (in place; splitmix64's finalizer, with
    arithmetic shifts: equal on every device, which is all a fingerprint needs)."""
    x = positions.mul_(_GOLDEN)
    x ^= x >> 30
    x.mul_(_MIX1)
    x ^= x >> 27
    x.mul_(_MIX2)
    x ^= x >> 31
    return x.bitwise_or_(1)


_kernels: dict[torch.device, object] = {}
_UNLOADED = object()


def _kernel(block_table: torch.Tensor, seq_lens: torch.Tensor) -> object | None:
    """The compiled module that computes the plan fingerprint for these tensors, or None (CPU,
    a layout the kernel does not take, or no kernel build: the torch ops then)."""
    dev = block_table.device
    if (
        dev.type != "cuda"
        or block_table.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or block_table.stride(1) != 1
        or not seq_lens.is_contiguous()
    ):
        return None
    mod = _kernels.get(dev, _UNLOADED)
    if mod is _UNLOADED:  # first call on this device: the build IndexCP loaded already
        from . import kernels

        try:
            mod = kernels.load(dev)
        except kernels.KernelUnavailable:
            mod = None
        _kernels[dev] = mod
    return mod


def plan_fingerprint(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    init_blocks: int,
    local_blocks: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Write the fingerprint of one step's ``block_table`` (int32 ``[requests, max_blocks]``)
    and ``seq_lens`` (int32 ``[requests]``) into ``out`` (int64 ``[1]`` on their device) and
    return ``out``. Only entries a call reads count (module docstring); a table's padding
    width (``max_blocks``) does not change the value. On a GPU, one kernel launch."""
    kernel = _kernel(block_table, seq_lens)
    if kernel is not None:
        kernel.plan_fingerprint(block_table, seq_lens, init_blocks, local_blocks, out)
        return out
    requests, max_blocks = block_table.shape
    dev = block_table.device
    lens = seq_lens.to(torch.int64)
    ends = (lens + (BLOCK_SIZE - 1)).div_(BLOCK_SIZE, rounding_mode="floor").sub_(local_blocks)
    cols = torch.arange(max_blocks, device=dev, dtype=torch.int64)
    read = (cols >= init_blocks) & (cols < ends.unsqueeze(1))
    # Position (r, j) as r * 2**32 + j: independent of max_blocks.
    pos = torch.arange(requests, device=dev, dtype=torch.int64).unsqueeze(1).mul(1 << 32) + cols
    terms = _weights(pos).mul_(block_table.to(torch.int64)).mul_(read)
    len_pos = torch.arange(requests, device=dev, dtype=torch.int64).add_(_SALT_LENS)
    total = terms.sum() * _GOLDEN + _weights(len_pos).mul_(lens).sum()
    return out.copy_(total.view(1))


def query_weights(words: int, device: torch.device) -> torch.Tensor:
    """The weights :func:`query_hash` gives a query's first ``words`` int32 words (a prefix of
    a longer query's: made once for the largest, they serve every size)."""
    pos = torch.arange(words, device=device, dtype=torch.int64).add_(_SALT_QUERY)
    return _weights(pos)


def query_hash(iq: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-d int64 hash of the bytes of a contiguous query tensor (any dtype whose rows are a
    multiple of 4 bytes, as a 128-element query row always is), on its device. With
    ``weights`` (:func:`query_weights`, at least as long), two ops."""
    words = iq.view(torch.uint8).view(-1).view(torch.int32)
    if weights is None:
        weights = query_weights(words.numel(), iq.device)
    return torch.mul(words, weights[: words.numel()]).sum()  # in int64, wrapping
