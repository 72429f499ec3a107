"""The one typed configuration of cpindex.

Every knob lives here and is read once: from keyword arguments, from ``CPINDEX_*`` environment
variables, or from a JSON/YAML file. A serving stack logs ``config.dump_json()`` and can replay
the exact run with ``CPIndexConfig.from_file``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TransportName = Literal["auto", "ipc", "mori", "collective"]
CacheFormat = Literal["bf16", "fp8", "nvfp4"]

ENV_PREFIX = "CPINDEX_"

#: The fused kernel keeps one mma column per head, so one pass scores at most this many heads.
MAX_KERNEL_HEADS = 8
#: Query tokens of one request the kernel scores in one pass over its pages (T * H <= 64).
MAX_QUERY_LEN = 8
#: Most blocks ``select_blocks`` returns per (row, head); MiniMax-M3 selects 16.
MAX_TOPK = 64


class CPIndexConfig(BaseModel):
    """Configuration of one :class:`cpindex.IndexCP` instance.

    Sizes are capture-stable upper bounds: buffers and kernel grids are derived from them (and
    from the static ``rows``/``width`` of a call), never from the contents of ``seq_lens``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    transport: TransportName = Field(
        "auto", description="'auto' picks the fastest transport every rank can use."
    )
    world_size: int | None = Field(
        None, ge=1, description="Ranks in the group; None takes the group's size."
    )
    num_heads: int = Field(4, ge=1, le=MAX_KERNEL_HEADS, description="Index-query heads H.")
    head_dim: Literal[128] = Field(128, description="Index head dimension (MiniMax-M3: 128).")
    block_size: Literal[128] = Field(128, description="Tokens per KV block / cache page.")
    cache_format: CacheFormat = Field("nvfp4", description="Index-key cache format.")
    max_rows: int = Field(
        256, ge=1, le=65536, description="Most query rows (requests x query_len) in one call."
    )
    max_query_len: int = Field(
        8,
        ge=1,
        le=MAX_QUERY_LEN,
        description="Most query tokens per request (speculative/MTP decode rows) in one call.",
    )
    max_width: int = Field(
        4096, ge=1, le=1 << 20, description="Most score columns (blocks) in one call."
    )
    max_topk: int = Field(
        16,
        ge=1,
        le=MAX_TOPK,
        description="Most blocks select_blocks returns per (row, head); sizes its buffers.",
    )
    sm_scale: float = Field(128**-0.5, gt=0.0, description="Positive score scale.")
    timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0, description="Longest wait for a peer before the call fails."
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

    @model_validator(mode="after")
    def _heads_divide_world(self) -> CPIndexConfig:
        w = self.world_size
        if w is not None and self.num_heads % w and w % self.num_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) and world_size ({w}) must divide one another: "
                "each rank owns num_heads/world_size heads, or each head is replicated on "
                "world_size/num_heads ranks"
            )
        return self

    # --- derived -------------------------------------------------------------------------
    def heads_per_rank(self, world_size: int | None = None) -> int:
        """Heads whose scores each rank receives (1 when heads are replicated over ranks)."""
        w = world_size or self.world_size or 1
        return max(1, self.num_heads // w)

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
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> CPIndexConfig:
        """Build from ``CPINDEX_<FIELD>`` variables (e.g. ``CPINDEX_TRANSPORT=ipc``).

        Keyword ``overrides`` win over the environment. Unknown ``CPINDEX_*`` names are an error,
        so a typo never silently falls back to a default.
        """
        env = os.environ if environ is None else environ
        fields = set(cls.model_fields)
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in fields:
                raise ValueError(
                    f"unknown environment variable {key}; known: "
                    + ", ".join(ENV_PREFIX + f.upper() for f in sorted(fields))
                )
            values[name] = None if raw.lower() in ("", "none", "null") else raw
        values.update(overrides)
        return cls.model_validate(values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> CPIndexConfig:
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file holding one mapping."""
        p = Path(path)
        text = p.read_text()
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"config file {p} must end in .json, .yaml or .yml")
        if not isinstance(data, dict):
            raise ValueError(f"config file {p} must hold a mapping, got {type(data).__name__}")
        return cls.model_validate(data)

    def dump_json(self) -> str:
        """The config as JSON, loadable again with :meth:`from_file` or ``model_validate_json``."""
        return self.model_dump_json(indent=2)

    def dump_file(self, path: str | os.PathLike[str]) -> None:
        """Write the config to ``path`` (JSON or YAML by suffix)."""
        p = Path(path)
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            p.write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))
        else:
            p.write_text(self.dump_json() + "\n")


__all__ = ["CPIndexConfig", "CacheFormat", "TransportName", "ValidationError"]
