"""CPU worlds for the transport tests: each (kind, ranks) started once per test module, its
failure too, so that a broken world fails every test that needs it without starting again.

The inputs every rank reads alike (the problems) are made once: in the test process, shared by
the in-process ranks and the reference, and handed to gloo processes in a file
(:func:`save_problems`, :func:`load_problems`) instead of being generated again in each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cpindex import testing
from cpindex.comm import Comm
from cpindex.spawn import spawn_processes
from cpindex.world import run_threads

SHARED = "problems.pt"  # in a gloo world's folder: the problems its ranks load


def save_problems(problems: dict[str, testing.Problem], folder: str | Path) -> None:
    """Write ``problems`` (by name) where :func:`load_problems` finds them (plain tensors and
    numbers only: ``torch.load`` reads it with ``weights_only``)."""
    packed = {
        name: (p.q, p.index_cache, p.block_table, p.seq_lens, p.width, p.fmt, p.query_len)
        for name, p in problems.items()
    }
    torch.save(packed, Path(folder) / SHARED)


def load_problems(folder: str | Path) -> dict[str, testing.Problem]:
    packed = torch.load(Path(folder) / SHARED)
    return {name: testing.Problem(*fields) for name, fields in packed.items()}


class Worlds:
    """``gloo_entry(rank, world, out_dir)`` runs in each gloo process and saves its result as
    ``out_dir/rank{rank}.pt`` (a string there is a traceback: the world failed);
    ``thread_fn(comm)`` runs on each in-process rank and returns its result."""

    def __init__(
        self,
        name: str,
        gloo_entry: Callable[[int, int, str], None],
        thread_fn: Callable[[Comm], Any],
        *,
        gloo_timeout_s: float | None = None,
        threads_timeout_s: float = 120.0,
        problems: Callable[[int], dict[str, testing.Problem]] | None = None,
    ) -> None:
        """``problems(world)``: the problems of a world of that size by name, saved for its
        gloo ranks (:func:`load_problems` in ``gloo_entry``)."""
        self.name, self.gloo_entry, self.thread_fn = name, gloo_entry, thread_fn
        self.problems = problems
        self.gloo_timeout_s, self.threads_timeout_s = gloo_timeout_s, threads_timeout_s
        self._started: dict[tuple[str, int], list[Any] | BaseException] = {}

    def results(self, kind: str, world: int, tmp_path_factory) -> list[Any]:
        """Every rank's result in a world of ``kind`` ("gloo" or "threads")."""
        key = (kind, world)
        if key not in self._started:
            try:
                self._started[key] = self._start(kind, world, tmp_path_factory)
            except BaseException as e:  # start a broken world once, not once per test
                self._started[key] = e
        res = self._started[key]
        if isinstance(res, BaseException):
            raise RuntimeError(f"the {kind} world of {world} ranks failed") from res
        return res

    def _start(self, kind: str, world: int, tmp_path_factory) -> list[Any]:
        problems = self.problems(world) if self.problems is not None else None  # made here once
        if kind != "gloo":
            return run_threads(world, self.thread_fn, timeout_s=self.threads_timeout_s)
        d = Path(tmp_path_factory.mktemp(f"{self.name}-gloo{world}"))
        if problems is not None:
            save_problems(problems, d)
        spawn_processes(
            world, self.gloo_entry, str(d), backend="gloo", timeout_s=self.gloo_timeout_s
        )
        got = [torch.load(d / f"rank{r}.pt") for r in range(world)]
        failed = [g for g in got if isinstance(g, str)]
        if failed:
            raise RuntimeError(failed[0])
        return got
