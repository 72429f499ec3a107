"""The public entry point: :class:`IndexCP` and the per-process ``init``/``get`` pair."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import construction, formats, gate, lockstep
from .comm import Comm
from .config import CPIndexConfig
from .errors import CPIndexError, add_note
from .plan import Plan
from .runner import SCORE, SELECT


class IndexCP:
    """Context-parallel block scoring over the ranks of a group.

    Construction is collective (every rank of the group, same config): the ranks agree on one
    transport (``config.transport``; ``"auto"`` picks the fastest all ranks can run), allocate
    and exchange buffers, and self-test. After that, every rank makes the same sequence of
    calls (:meth:`select_blocks`, the block ids sparse attention reads, or :meth:`score_push`,
    the scores), on one stream at a time (a second stream or micro-batch needs its own
    instance). Call every instance of a process from one thread, in the same order on every
    rank: a call while another thread is inside a call of any instance is refused.

    Context parallelism pays from a size on: a call of fewer than :attr:`cp_min_blocks` blocks
    (``requests * width``) is scored by each rank alone for its own heads, with the same results
    in the same views and nothing exchanged (docs/design.md, "CP per call: the gate").

    A decode step's shared inputs go into a :class:`~cpindex.plan.Plan` once
    (:meth:`plan`); each layer's call then passes its queries, its cache, the plan and a tag::

        plan = cp.plan(block_table, seq_lens, query_len=T)
        for layer in range(layers):
            ids = cp.select_blocks(iq[layer], caches[layer], plan, tag=step * layers + layer)

    Args:
        config: the configuration (default ``CPIndexConfig()``); ``world_size`` is bound to the
            group's size.
        group: a ``torch.distributed`` process group (default: the world group).
        device: this rank's device (default: the current CUDA device, else CPU).
        comm: instead of ``group``, an explicit :class:`cpindex.world.Comm` (the one-process
            world of :func:`cpindex.world.run_threads` passes its ``ThreadComm`` here).
    """

    def __init__(
        self,
        config: CPIndexConfig | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        comm: Comm | None = None,
    ) -> None:
        # Agreed on first, then built with every round bounded (cpindex.construction).
        built = construction.build(config, group, device, comm)
        self.comm, self.config, self.device = built.comm, built.config, built.device
        self.heads_per_rank = built.heads_per_rank
        self._transport, self._local = built.transport, built.local
        self._gate, self._runner = built.gate, built.runner

    # ---- properties -----------------------------------------------------------------------
    @property
    def transport_name(self) -> str:
        """The transport in use (what ``"auto"`` resolved to)."""
        return self._transport.name

    @property
    def capturable(self) -> bool:
        """Whether ``score_push`` and ``select_blocks`` may be captured in a CUDA/HIP graph
        with this transport."""
        return self.device.type == "cuda" and self._transport.capturable

    @property
    def cp_min_blocks(self) -> int:
        """The resolved CP gate: calls of at least this many blocks (``requests * width``) go
        context-parallel, smaller ones are scored by each rank alone for its own heads, with
        the same results (``config.cp_min_blocks``, ``"auto"`` resolved; the same on every
        rank; docs/design.md, "CP per call: the gate")."""
        return self._gate.threshold

    @property
    def gate(self) -> gate.Gate:
        """How :attr:`cp_min_blocks` was resolved (source and the model's inputs)."""
        return self._gate

    def uses_cp(self, plan_or_sizes: Plan | tuple[int, int], op: str = SCORE) -> bool:
        """Whether ``op`` calls (``"score_push"`` or ``"select_blocks"``, each with its own
        threshold) with this plan, or of ``(requests, width)``, go context-parallel. Static
        sizes only: the same answer on every rank and at every graph replay."""
        if op not in (SCORE, SELECT):
            raise ValueError(f"op: expected 'score_push' or 'select_blocks', got {op!r}")
        if isinstance(plan_or_sizes, Plan):
            return self._gate.uses_cp(plan_or_sizes.blocks, op)
        if (
            not isinstance(plan_or_sizes, tuple)
            or len(plan_or_sizes) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in plan_or_sizes)
        ):
            raise TypeError(
                "plan_or_sizes: expected a Plan or a (requests, width) pair of ints, got "
                f"{plan_or_sizes!r}"
            )
        requests, width = plan_or_sizes
        if requests < 1 or width < 1:
            raise ValueError(f"plan_or_sizes: requests and width must be >= 1, got {plan_or_sizes}")
        return self._gate.uses_cp(requests * width, op)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    # ---- the step's plan and the calls ------------------------------------------------------
    def plan(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        query_len: int = 1,
        init_blocks: int = 0,
        local_blocks: int = 1,
        width: int | None = None,
    ) -> Plan:
        """Validate a decode step's shared inputs once, for every layer's call of the step.

        Args:
            block_table: int32 ``[requests, max_blocks]``, rows contiguous: request r's
                logical block j lives in page ``block_table[r, j]``.
            seq_lens: int32 ``[requests]``, causal lengths through each request's last query
                token (so ``>= query_len``); token t sees ``seq_lens[r] - query_len + 1 + t``.
            query_len: query tokens per request (speculative/MTP decode), at most
                ``config.max_query_len``; ``requests * query_len <= config.max_rows``.
            init_blocks, local_blocks: forced-selection counts (MiniMax-M3: 0 and 1).
            width: score columns, ``ceil(max(seq_lens)/128) <= width <= max_width``; default
                ``block_table.shape[1]`` (capture-stable).

        Returns:
            a :class:`~cpindex.plan.Plan` for :meth:`score_push` and :meth:`select_blocks`.
            It holds the tensors themselves (not copies), so calls read their current
            contents: refill them in place between steps and the plan stays valid, in graph
            replays too. Their shapes must not change (a call refuses a plan whose tensors
            were resized, or whose fields were replaced, naming what changed). Local (no
            communication) and host-only: no launch, nothing allocated, capture-safe.

        Raises:
            TypeError, ValueError: bad input, naming the argument. With peers, above the CP
                gate, this counts as this rank refusing its next call: its peers raise too (at once
                on ``collective``; on ``ipc``/``mori`` their kernels find this rank late,
                ``PeerTimeoutError`` within ``timeout_s``), and this instance refuses calls
                until :meth:`reset`.
        """
        return self._runner.plan(block_table, seq_lens, query_len, init_blocks, local_blocks, width)

    def score_push(
        self, iq: torch.Tensor, index_cache: formats.Cache, plan: Plan, *, tag: int | None = None
    ) -> torch.Tensor:
        """This rank's heads' block scores over every block of every row.

        Args:
            iq: ``[rows, heads_per_rank, 128]`` (or ``[rows, 128]``) query rows of this rank's
                heads, contiguous, ``rows = plan.rows = requests * query_len``, request-major
                (token t of request r is row ``r * query_len + t``); ``float8_e4m3fn`` for
                fp8/nvfp4 caches, ``bfloat16`` for bf16.
            index_cache: the paged index-key cache in ``config.cache_format``: bf16 or fp8
                ``[pages, 128, 128]``, nvfp4 ``uint8 [pages, 9216]`` (or vLLM's
                ``[pages, 128, 72]``) or the public pair ``(packed uint8 [pages, 128, 64],
                scales e4m3 [pages, 128, 8])``.
            plan: the step's :meth:`plan`, made by this instance (or one of the same
                configuration) and unchanged since.
            tag: an int in ``[0, 2**63)`` naming the call, the same on every rank (e.g.
                ``step * layers + layer``), or None. Ranks whose tags differ raise
                :class:`~cpindex.OutOfStepError` naming both: a skipped or reordered call is
                caught even where consecutive calls have equal shapes. A host int: a captured
                call replays with the tag it was captured with.

        Returns:
            float32 ``[heads_per_rank, rows, width]``: a view of the instance's receive
            buffer, overwritten by the next call. Keep it with ``.clone()``::

                a = cp.score_push(iq, cache, plan)          # call 1's scores
                b = cp.score_push(iq, cache, plan)          # a shows call 2's scores now
                a = cp.score_push(iq, cache, plan).clone()  # a copy: stays call 3's scores

            Work that reads the view must run on the instance's stream (or be ordered before
            the next call).

        Raises:
            TypeError, ValueError: bad input (a changed plan included), naming the argument,
                before anything is launched. Below the CP gate, or with one rank, the call is
                not made and the instance stays usable; otherwise the call still counts, the
                peers raise too (at once on ``collective``, within ``timeout_s`` on
                ``ipc``/``mori``), and the instance refuses calls until :meth:`reset`.
            OutOfStepError, PeerTimeoutError, PeerConnectionError: the ranks are not making
                the same call (another tag, shape, block table or lengths), a peer did not
                come within ``timeout_s``, or a peer is gone.
            BrokenInstanceError: an earlier call failed on this rank; :meth:`reset` first.
        """
        return self._runner.call(SCORE, iq, index_cache, plan, tag)

    def select_blocks(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        plan: Plan,
        *,
        topk: int = 16,
        tag: int | None = None,
        return_scores: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' ``topk`` best blocks per row: what sparse attention reads
        (docs/contract.md §6). ``iq``, ``index_cache``, ``plan``, ``tag``, errors: as in
        :meth:`score_push`.

        Per (head, row): the ``topk`` columns with the highest scores, forced blocks included,
        ``-inf`` columns never, equal scores to the lower block id. Ranks exchange only their
        ``topk`` candidates per (head, row), so the exchange does not grow with ``width``:
        ``collective`` through torch.distributed, ``ipc`` and ``mori`` inside the one fused
        launch (up to ``topk`` 16; a larger ``topk`` pushes the scores and selects from them).

        Args:
            topk: blocks per (head, row), at most ``config.max_topk`` (MiniMax-M3: 16).
            return_scores: also return each selected block's score.

        Returns:
            int32 ``[heads_per_rank, rows, topk]``: block-table *columns* (logical block ids,
            not page ids) in ascending order, then ``-1`` for each slot a row with fewer than
            ``topk`` blocks in its context leaves. With ``return_scores``, also float32
            ``[heads_per_rank, rows, topk]``, aligned with the ids (``-inf`` where padded).
            Views valid until the next call.
        """
        ids, scores = self._runner.call(SELECT, iq, index_cache, plan, tag, topk, return_scores)
        return (ids, scores) if return_scores else ids

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        """Bytes this rank sends its peers in one call's score (``topk=None``: ``score_push``)
        or candidate (``select_blocks``) exchange; the query exchange, the same for both, is
        not counted. ``collective``'s ``select_blocks``: ``(W-1) * heads_per_rank * rows *
        topk * 8``, whatever the width; a score exchange: ``(W-1) * heads_per_rank * rows *
        ceil(width / W) * 4``."""
        return self._transport.exchange_bytes(rows, width, topk)

    def check(self) -> None:
        """Raise an error recorded by an earlier call (timeouts, bad block tables, ranks whose
        block tables disagreed). Reads host memory only: cheap, and usable after graph
        replays. Marks the instance broken too, except for an error of a call below the CP
        gate (this rank's own input, no peer involved): raised once, the instance stays
        usable."""
        self._runner.check()

    def reset(self, timeout_s: float | None = None) -> None:
        """Collective, bounded by ``timeout_s`` (default ``config.timeout_s``): bring every
        rank back in step after a failure.

        Every rank meets in a round first. Whatever happened before (a rank that called
        ``reset()`` alone and timed out, rounds a rank missed, resets repeated), a ``reset()``
        called on every rank meets in that one call: rounds abandoned earlier are skipped. A
        rank that does not come within ``timeout_s`` makes the others raise
        :class:`PeerTimeoutError` naming it, and the instance stays broken: call ``reset()``
        again on every rank. Then the transport waits for this rank's kernels and clears its
        error words and handshake state, the call count goes back to 0 on every rank, and
        calls are accepted again. A reset on a healthy instance is harmless.

        Raises :class:`PeerConnectionError` when a peer or the group's store is gone, and
        :class:`CPIndexError` when a collective was left half done (a rank stopped inside a
        call after its peers started exchanging data): the process group must be rebuilt."""
        construction.reset(self._runner, timeout_s)

    def close(self) -> None:
        """Collective, bounded by ``timeout_s``: release buffers and peer mappings. Idempotent.

        ``ipc`` and ``mori`` ranks meet before freeing memory their peers write into. A rank
        that does not come within ``timeout_s`` makes the others raise
        :class:`PeerTimeoutError` naming it; they keep that memory then (a late peer may still
        write into it) until the process ends."""
        runner = self._runner
        if not runner.closed:
            runner.closed = True
            self._transport.close(
                meet=lambda: lockstep.meet(
                    self.comm, f"close/{runner.instance}", self.config.timeout_s, what="close"
                )
            )

    def __enter__(self) -> IndexCP:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        try:  # leaving on an error: close, but never hide that error behind close's own
            self.close()
        except Exception as e:
            add_note(exc, f"closing afterwards failed too: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return (
            f"IndexCP(transport={self.transport_name!r}, rank={self.rank}/{self.world_size}, "
            f"device={self.device}, format={self.config.cache_format!r})"
        )


_instance: Any = None
_instance_args: tuple[Any, ...] | None = None


def shared(make: Any, args: tuple[Any, ...], where: str = "cpindex.init") -> Any:
    """This process's shared instance: ``make(*args)`` on the first call (collective), the
    same instance on a later call with equal arguments (no communication); other arguments
    raise :class:`CPIndexError` (:func:`shutdown` first). :func:`init` and the drop-in's
    ``cpindex.vllm.init`` are this, with their own constructors."""
    global _instance, _instance_args
    if _instance is not None:
        if (make, args) != _instance_args:
            raise CPIndexError(
                f"{where} called again with other arguments than the instance it made "
                f"({_instance!r}); call cpindex.shutdown() first"
            )
        return _instance
    _instance, _instance_args = make(*args), (make, args)
    return _instance


def init(
    config: CPIndexConfig | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> IndexCP:
    """Create this process's shared instance (collective, once, outside capture) and return
    it; :func:`get` returns it anywhere. A later call with equal arguments returns that
    instance without communicating; other arguments raise :class:`CPIndexError`."""
    return shared(IndexCP, (config, group, device))


def get() -> Any:
    """The instance :func:`init` (or ``cpindex.vllm.init``) created."""
    if _instance is None:
        raise CPIndexError("cpindex.get() before cpindex.init()")
    return _instance


def shutdown() -> None:
    """Close and forget the shared instance (collective); a no-op without one."""
    global _instance, _instance_args
    if _instance is not None:
        inst, _instance, _instance_args = _instance, None, None
        inst.close()
