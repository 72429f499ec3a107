"""The one typed configuration of cpindex.

Every knob lives here and is read once: from keyword arguments, from ``CPINDEX_*`` environment
variables, or from a JSON/YAML file. A serving stack logs ``config.dump_json()`` and can replay
the exact run with ``CPIndexConfig.from_file``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

TransportName = Literal["auto", "ipc", "mori", "collective"]
CacheFormat = Literal["bf16", "fp8", "nvfp4"]

ENV_PREFIX = "CPINDEX_"
#: ``CPINDEX_*`` variables that are not configuration, which :meth:`CPIndexConfig.from_env`
#: skips: the kernel build's cache folder, and the kernel switches of the benchmark builds.
NOT_CONFIG_ENV = frozenset({"CPINDEX_CACHE_DIR", "CPINDEX_KERNEL_DEFINES"})
#: Largest config file :meth:`CPIndexConfig.from_file` reads (a full dump is under 1 KiB).
MAX_CONFIG_FILE_BYTES = 64 << 10

#: The fused kernel keeps one mma column per head, so one pass scores at most this many heads.
MAX_KERNEL_HEADS = 8
#: Largest ``select_blocks`` topk the kernel selects itself (kernels/config.h, kMaxSelect);
#: larger takes torch ops.
MAX_FUSED_TOPK = 16
#: Query tokens of one request the kernel scores in one pass over its pages (T * H <= 64).
MAX_QUERY_LEN = 8
#: Most blocks ``select_blocks`` returns per (row, head); MiniMax-M3 selects 16.
MAX_TOPK = 64
#: ``sm_scale`` must lie in this range. With fp8/nvfp4 inputs |q·k| <= 128 * 448 * 448 (about
#: 2.6e7), so a scaled score stays below 2.6e13: finite in fp32 and far below the forced values
#: (1e29, 1e30), which must always win. The smallest non-zero product (e4m3 subnormals, 2**-9
#: each: 2**-18) scaled by 1e-6 is about 3.8e-12, far above fp32's smallest normal (1.2e-38), so
#: no score flushes to zero. bf16 inputs are assumed O(1) (RMS-normed keys, docs/contract.md §4).
SM_SCALE_RANGE = (1e-6, 1e6)
#: Default of ``max_buffer_bytes``: what one rank may allocate for an instance's buffers.
DEFAULT_MAX_BUFFER_BYTES = 4 << 30


def _not_bool(v: object) -> object:
    # pydantic's lax mode reads True as 1; a bool for a count or a scale is always a mistake.
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got the bool {v}")
    return v


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


def _block_count_or_auto(v: object) -> object:
    """``cp_min_blocks``: ``"auto"`` or a block count >= 0 (a string of digits from the
    environment counts too); one clear message instead of a union's two."""
    if v == "auto":
        return v
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a block count >= 0 or 'auto', got {v!r}")
    return v


#: A call's blocks (requests x width) from which it goes context-parallel; "auto" takes the
#: threshold from the gate's model (``cpindex.gate``).
CpMinBlocks = Annotated[int | Literal["auto"], BeforeValidator(_block_count_or_auto)]


def _align256(n: int) -> int:
    return -(-n // 256) * 256


class CPIndexConfig(BaseModel):
    """Configuration of one :class:`cpindex.IndexCP` instance.

    Sizes are capture-stable upper bounds: buffers and kernel grids are derived from them (and
    from the static ``rows``/``width`` of a call), never from the contents of ``seq_lens``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    transport: TransportName = Field(
        "auto", description="'auto' picks the fastest transport every rank can use."
    )
    world_size: Int | None = Field(
        None, ge=1, description="Ranks in the group; None takes the group's size."
    )
    num_heads: Int = Field(4, ge=1, le=MAX_KERNEL_HEADS, description="Index-query heads H.")
    head_dim: Literal[128] = Field(128, description="Index head dimension (MiniMax-M3: 128).")
    block_size: Literal[128] = Field(128, description="Tokens per KV block / cache page.")
    cache_format: CacheFormat = Field("nvfp4", description="Index-key cache format.")
    max_rows: Int = Field(
        256, ge=1, le=65536, description="Most query rows (requests x query_len) in one call."
    )
    max_query_len: Int = Field(
        8,
        ge=1,
        le=MAX_QUERY_LEN,
        description="Most query tokens per request (speculative/MTP decode rows) in one call.",
    )
    max_width: Int = Field(
        4096, ge=1, le=1 << 20, description="Most score columns (blocks) in one call."
    )
    max_topk: Int = Field(
        16,
        ge=1,
        le=MAX_TOPK,
        description="Most blocks select_blocks returns per (row, head); sizes its buffers.",
    )
    sm_scale: Float = Field(
        128**-0.5,
        gt=0.0,
        allow_inf_nan=False,
        description=f"Positive score scale, in [{SM_SCALE_RANGE[0]:g}, {SM_SCALE_RANGE[1]:g}].",
    )
    timeout_s: Float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        allow_inf_nan=False,
        description="Longest wait for a peer before the call fails (local: may differ by rank).",
    )
    error_check: Literal["next_call", "sync"] = Field(
        "next_call",
        description="'next_call': a timed-out wait raises at the next call (graph-safe, no "
        "sync); 'sync': every call synchronizes its stream and raises at once.",
    )
    prefer_mori: bool = Field(
        False, description="Let 'auto' pick 'mori' when MORI is usable on every rank."
    )
    ipc_self_test: bool = Field(
        True, description="Check at construction that peer writes really land (IOMMU, P2P)."
    )
    fingerprint: bool = Field(
        True,
        description="Compare a hash of the block-table entries and lengths each call reads "
        "(and, where ranks share a head, their queries) across ranks on every call.",
    )
    cp_min_blocks: CpMinBlocks = Field(
        "auto",
        description="A call goes context-parallel from this many blocks (requests x width; "
        "both static sizes): below it each rank scores its own heads alone, with the same "
        "results. 0: always context-parallel. 'auto': from the gate's model (docs/design.md, "
        "'CP per call: the gate').",
    )
    max_buffer_bytes: Int = Field(
        DEFAULT_MAX_BUFFER_BYTES,
        ge=1,
        description="Most bytes of buffers one rank allocates for an instance (see "
        "buffer_bytes); a config that needs more is refused (local: may differ by rank).",
    )

    #: Fields each rank may set on its own. Every other field must be equal on all ranks:
    #: construction compares them and the transports' call identities carry their digest. A
    #: rank with a shorter ``timeout_s`` gives up sooner, and then every rank raises (the
    #: exchange has one outcome for all); it never changes what a call computes.
    LOCAL_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"timeout_s", "error_check", "max_buffer_bytes"}
    )

    @field_validator("sm_scale")
    @classmethod
    def _sm_scale_in_range(cls, v: float) -> float:
        lo, hi = SM_SCALE_RANGE
        if not lo <= v <= hi:
            raise ValueError(
                f"sm_scale must be in [{lo:g}, {hi:g}] (got {v!r}): outside it fp32 scores "
                "overflow to inf, pass the forced values 1e29/1e30, or flush to 0"
            )
        return v

    @model_validator(mode="after")
    def _heads_divide_world(self) -> CPIndexConfig:
        w = self.world_size
        if w is not None and self.num_heads % w and w % self.num_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) and world_size ({w}) must divide one another: "
                "each rank owns num_heads/world_size heads, or each head is replicated on "
                "world_size/num_heads ranks"
            )
        if w is not None and self.buffer_bytes(w) > self.max_buffer_bytes:
            raise ValueError(
                f"this config needs {self.buffer_bytes(w):,} bytes of buffers per rank at "
                f"world_size {w} (max_rows={self.max_rows}, max_width={self.max_width}, "
                f"num_heads={self.num_heads}), more than max_buffer_bytes="
                f"{self.max_buffer_bytes:,}; lower max_rows or max_width, or raise "
                "max_buffer_bytes"
            )
        return self

    # --- derived -------------------------------------------------------------------------
    def heads_per_rank(self, world_size: int | None = None) -> int:
        """Heads whose scores each rank receives (1 when heads are replicated over ranks)."""
        w = world_size or self.world_size or 1
        return max(1, self.num_heads // w)

    def buffer_bytes(self, world_size: int | None = None) -> int:
        """Bytes of device (or CPU) memory one rank allocates for an instance in a group of
        ``world_size`` ranks: the larger transport's buffers plus ``select_blocks``' results.

        * ``ipc``/``mori`` region (``transports/peer.py``, ``PeerLayout``): a 4 KiB flag page,
          one 256-byte-aligned query slot per rank, the float32 receive buffer
          ``[heads_per_rank, max_rows, max_width]`` and int64 ``select_blocks`` candidate
          slots ``[W, heads_per_rank, max_rows, max_topk]``.
        * ``collective`` (``transports/collective.py``): the gathered queries of every rank,
          each followed by a 16-byte agreement trailer, a float32 shard ``[num_heads,
          max_rows, ceil(max_width / W)]``, the received shards
          ``[W, heads_per_rank, max_rows, ceil(max_width / W)]``, the output, the received
          int64 candidates ``[W, heads_per_rank, max_rows, max_topk]``, the kernel's
          selection's int64 send buffer ``[W, heads_per_rank, max_rows, min(max_topk, 16)]``,
          the shard's block ids' key bits and the agreement's few words (under 64 bytes plus
          2 per rank).
        * ``select_blocks`` results (``selection.Outputs``): int32 ids and float32 scores,
          ``[heads_per_rank, max_rows, max_topk]`` each.
        * on a GPU, the path below the CP gate's own int64 candidates for its fused selection,
          ``[heads_per_rank, max_rows, min(max_topk, 16)]`` (``transports/local.py``); counted
          everywhere, so the figure is the same on every rank and device.
        """
        w = world_size or self.world_size or 1
        hpr = self.heads_per_rank(w)
        rows, width = self.max_rows, self.max_width
        q_rank = rows * hpr * self.head_dim * (2 if self.cache_format == "bf16" else 1)
        kw = -(-width // w)
        out = hpr * rows * width * 4
        cand = w * hpr * rows * self.max_topk * 8
        peer = 4096 + w * _align256(q_rank) + _align256(out) + cand
        shards = self.num_heads * rows * kw * 4 + w * hpr * rows * kw * 4
        send = w * hpr * rows * min(self.max_topk, MAX_FUSED_TOPK) * 8
        collective = w * (q_rank + 16) + shards + out + cand + send + kw * 8 + 64 + 2 * w
        select = hpr * rows * self.max_topk * 8
        local = hpr * rows * min(self.max_topk, MAX_FUSED_TOPK) * 8
        return max(peer, collective) + select + local

    def shared_values(self) -> dict[str, Any]:
        """The fields every rank must agree on (all but :attr:`LOCAL_FIELDS`), by name."""
        return {k: v for k, v in self.model_dump().items() if k not in self.LOCAL_FIELDS}

    def digest(self) -> int:
        """A stable 64-bit hash of :meth:`shared_values`, never 0: equal on every rank of a
        group that may work together (the same bytes across processes, runs and hosts). Call
        identities carry it, so ranks holding different configurations never pair calls."""
        text = json.dumps(self.shared_values(), sort_keys=True).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") | 1

    def with_world_size(self, world_size: int) -> CPIndexConfig:
        """This config bound to a group of ``world_size`` ranks (validated again)."""
        if self.world_size not in (None, world_size):
            raise ValueError(
                f"config.world_size is {self.world_size} but the process group has "
                f"{world_size} ranks"
            )
        return type(self).model_validate({**self.model_dump(), "world_size": world_size})

    # --- loading and dumping -------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CPIndexConfig:
        """Build from ``CPINDEX_<FIELD>`` variables, one per field of this model (e.g.
        ``CPINDEX_TRANSPORT=ipc``, ``CPINDEX_MAX_ROWS=64``).

        Each value is read as a JSON scalar when it is one (``128``, ``2.5``, ``true``,
        ``null``), as a JSON file would give it to :meth:`from_file`, else as the string itself
        (``ipc``). ``none``/``null`` unset a field whose default is ``None``. Keyword
        ``overrides`` win over the environment.

        The variables of :data:`NOT_CONFIG_ENV` (read by the kernel build, not configuration)
        are skipped. Any other ``CPINDEX_*`` name is an error naming the closest fields, so a
        typo never silently falls back to a default.
        """
        env = os.environ if environ is None else environ
        fields = cls.model_fields
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX) or key in NOT_CONFIG_ENV:
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in fields:
                close = difflib.get_close_matches(name, list(fields), n=2)
                hint = "".join(f"did you mean {ENV_PREFIX}{c.upper()}? " for c in close[:1])
                raise ValueError(
                    f"unknown environment variable {key}: {hint}configuration variables are "
                    f"CPINDEX_<FIELD> for the fields of CPIndexConfig ({', '.join(fields)}); "
                    f"{', '.join(sorted(NOT_CONFIG_ENV))} are read elsewhere"
                )
            if not raw.strip():
                raise ValueError(
                    f"environment variable {key} is set but empty; unset it to take the "
                    f"default ({fields[name].default!r}) or give a value"
                )
            nullable = fields[name].default is None
            if nullable and raw.strip().lower() in ("none", "null"):
                values[name] = None
            else:
                values[name] = _env_scalar(key, raw)
        values.update(overrides)
        return cls.model_validate(values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> CPIndexConfig:
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file holding one flat mapping of field
        names to values, at most :data:`MAX_CONFIG_FILE_BYTES` of UTF-8 text.

        Raises ``ValueError`` for a file too large, not UTF-8, not valid JSON/YAML, not a
        mapping, nested, or with keys that are not fields (naming a few of them); pydantic's
        ``ValidationError`` (a ``ValueError``) for values a field refuses.
        """
        p = Path(path)
        suffix = _suffix(p)
        # Opened without blocking, and a FIFO (or socket, or directory) refused before any read:
        # a FIFO with no writer would block open() or read() for good. Devices are read up to
        # the bound like files.
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        mode = os.fstat(fd).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISDIR(mode):
            os.close(fd)
            raise ValueError(
                f"config file {p} is a FIFO, socket or directory; pass the path of a regular "
                ".json or .yaml file"
            )
        with os.fdopen(fd, "rb") as f:  # read past the bound by one byte only
            try:
                raw = f.read(MAX_CONFIG_FILE_BYTES + 1) or b""
            except BlockingIOError:  # a device with nothing to read now (a terminal)
                raise ValueError(f"config file {p}: nothing to read without waiting") from None
        if len(raw) > MAX_CONFIG_FILE_BYTES:
            raise ValueError(
                f"config file {p} is larger than {MAX_CONFIG_FILE_BYTES:,} bytes; a config "
                "file is one small mapping of field: value (a full dump is under 1 KiB)"
            )
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"config file {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
            ) from None
        try:
            if suffix == "yaml":
                import yaml

                try:
                    data = yaml.safe_load(text)
                except yaml.YAMLError as e:
                    raise ValueError(f"config file {p}: not valid YAML: {e}") from None
            else:
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"config file {p}: not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(
                f"config file {p} is nested too deeply; a config file is one flat mapping of "
                "field: value"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping, got {type(data).__name__}")
        unknown = [k for k in data if k not in cls.model_fields]
        if unknown:
            raise ValueError(f"config file {p}: {_unknown_keys(unknown, list(cls.model_fields))}")
        nested = [k for k, v in data.items() if isinstance(v, (dict, list))]
        if nested:
            raise ValueError(
                f"config file {p}: {nested[0]!r} holds a {type(data[nested[0]]).__name__}; "
                "every field takes one value"
            )
        return cls.model_validate(data)

    def dump_json(self) -> str:
        """The config as JSON, loadable again with :meth:`from_file` or ``model_validate_json``."""
        return self.model_dump_json(indent=2)

    def dump_file(self, path: str | os.PathLike[str]) -> None:
        """Write the config to ``path``: JSON for ``.json``, YAML for ``.yaml``/``.yml`` (the
        suffixes :meth:`from_file` reads; any other is refused before anything is written)."""
        p = Path(path)
        if _suffix(p) == "yaml":
            import yaml

            p.write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))
        else:
            p.write_text(self.dump_json() + "\n")


def _env_scalar(key: str, raw: str) -> Any:
    """An environment value as a JSON file would hold it: a JSON scalar if it parses as one,
    else the string itself."""
    try:
        value = json.loads(raw)
    except ValueError:  # JSONDecodeError, or a number too long to convert
        return raw
    if isinstance(value, (dict, list)):
        raise ValueError(f"environment variable {key}: expected one value, got {raw!r}")
    return value


def _unknown_keys(unknown: list[Any], fields: list[str], show: int = 5) -> str:
    """A short message naming at most ``show`` of ``unknown`` (a file may hold any number)."""
    names = [repr(k)[:60] for k in unknown[:show]]
    more = f" and {len(unknown) - show:,} more" if len(unknown) > show else ""
    first = unknown[0]
    close = difflib.get_close_matches(first, fields, n=2) if isinstance(first, str) else []
    hint = f" ({names[0]}: did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return (
        f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(names)}{more}{hint}; "
        f"the fields are: {', '.join(fields)}"
    )


def _suffix(p: Path) -> str:
    """``"json"`` or ``"yaml"`` by the file's suffix; ValueError for any other."""
    suffix = p.suffix.lower()
    if suffix == ".json":
        return "json"
    if suffix in (".yaml", ".yml"):
        return "yaml"
    raise ValueError(f"config file {p} must end in .json, .yaml or .yml")


__all__ = ["CPIndexConfig", "CacheFormat", "TransportName", "ValidationError"]
