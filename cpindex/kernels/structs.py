"""ctypes mirrors of the structs in launch.h, checked field by field against the compiled module.

Python fills a struct once per call shape and hands its bytes to the binding, which patches the
per-call pointers; no per-call argument marshalling beyond that.
"""

from __future__ import annotations

import ctypes as C

import torch

from ..config import MAX_FUSED_TOPK  # noqa: F401 (the kernel's bound, re-exported)

MAX_HEADS = 8
MAX_WORLD = 16
MAX_DST = 16
FORMAT_IDS = {"bf16": 0, "fp8": 1, "nvfp4": 2}
#: The kernel for nvfp4 values whose tokens are only 8-byte aligned (vLLM's 72-byte tokens).
NVFP4_NARROW = 3
ERR_TIMEOUT_QUERIES, ERR_TIMEOUT_SCORES, ERR_BAD_PAGE, ERR_WIDTH, ERR_LENGTH = 1, 2, 3, 4, 5
ERR_MISMATCH = 6
#: write_keys: a slot past the cache (``peer``: the token index, ``detail``: the slot).
ERR_SLOT = 7
ERR_TAG, ERR_AGREEMENT, ERR_REPLICA = 8, 9, 10
#: The tag word of a call made without a tag (tags are 0 <= tag < 2**63).
NO_TAG = (1 << 64) - 1


class ErrorWord(C.Structure):
    _fields_ = [
        ("code", C.c_uint32),
        ("rank", C.c_uint32),
        ("peer", C.c_uint32),
        ("claim", C.c_uint32),
        ("call", C.c_uint64),
        ("detail", C.c_uint64),
        ("mine", C.c_uint64),
    ]


class PushState(C.Structure):
    _fields_ = [
        ("calls", C.c_void_p),
        ("ticket", C.c_void_p),
        ("q_flags", C.c_void_p),
        ("s_flags", C.c_void_p),
        ("peer_q_slot", C.c_void_p * MAX_WORLD),
        ("peer_q_flag", C.c_void_p * MAX_WORLD),
        ("peer_s_flag", C.c_void_p * MAX_WORLD),
        ("peer_q_ident", C.c_void_p * MAX_WORLD),
        ("peer_q_tag", C.c_void_p * MAX_WORLD),
        ("peer_fp", C.c_void_p * MAX_WORLD),
        ("barrier", C.c_void_p),
        ("q_idents", C.c_void_p),
        ("q_tags", C.c_void_p),
        ("fps", C.c_void_p),
        ("fp_acc", C.c_void_p),
        ("q_src", C.c_void_p),
        ("q_bytes", C.c_int64),
        ("timeout_ticks", C.c_uint64),
    ]


class ScoreParams(C.Structure):
    _fields_ = [
        ("kv", C.c_void_p),
        ("ks", C.c_void_p),
        ("kv_page_stride", C.c_int64),
        ("ks_page_stride", C.c_int64),
        ("kv_token_stride", C.c_int64),
        ("ks_token_stride", C.c_int64),
        ("num_pages", C.c_int64),
        ("fp4_lut", C.c_void_p),
        ("q", C.c_void_p),
        ("q_src_stride", C.c_int64),
        ("q_row_stride", C.c_int64),
        ("q_heads_per_src", C.c_int),
        ("q_src_magic", C.c_uint32),
        ("block_table", C.c_void_p),
        ("bt_row_stride", C.c_int64),
        ("bt_cols", C.c_int64),
        ("seq_lens", C.c_void_p),
        ("requests", C.c_int),
        ("query_len", C.c_int),
        ("width", C.c_int),
        ("num_heads", C.c_int),
        ("rank", C.c_int),
        ("world", C.c_int),
        ("init_blocks", C.c_int),
        ("local_blocks", C.c_int),
        ("scale", C.c_float),
        ("heads_magic", C.c_uint32),
        ("dst", C.c_void_p * MAX_DST),
        ("dst_copies", C.c_int),
        ("shard_columns", C.c_int),
        ("out_row_stride", C.c_int64),
        ("ident", C.c_uint64),
        ("tag", C.c_uint64),
        ("agree", C.c_int),
        ("poison_count", C.c_int64),
        ("poison", C.c_void_p),
        ("topk", C.c_int),
        ("heads_per_rank", C.c_int),
        ("cand_copies", C.c_int),
        ("cand_dst", C.c_void_p * MAX_DST),
        ("cand", C.c_void_p),
        ("ids_out", C.c_void_p),
        ("scores_out", C.c_void_p),
        ("err", C.c_void_p),
        ("err_host", C.c_void_p),
        ("trailer", C.c_int64),
        ("local_state", C.c_void_p),
    ]


def image(s: C.Structure) -> torch.Tensor:
    """The struct's bytes as a CPU uint8 tensor (what the binding takes)."""
    return torch.frombuffer(bytearray(bytes(s)), dtype=torch.uint8)


def check_layout(layout: dict[str, int]) -> None:
    """Raise if the compiled structs and these mirrors disagree (a stale or foreign build)."""
    for key, value in layout.items():
        kind, field = key.split(".", 1)
        if kind == "sizeof":
            mine = C.sizeof(
                {"ScoreParams": ScoreParams, "PushState": PushState, "ErrorWord": ErrorWord}[field]
            )
        else:
            mine = getattr({"ScoreParams": ScoreParams, "PushState": PushState}[kind], field).offset
        if mine != value:
            raise RuntimeError(
                f"cpindex kernel struct mismatch: {key} is {value} in C++, {mine} here"
            )
