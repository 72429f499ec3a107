"""The command line. Runs that start ranks: ``python -m cpindex`` in a real subprocess; what the
parent decides alone (help, argument errors, refusals before any rank starts, info): ``main``
in this process, which is the same code without a second interpreter start per check."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from cpindex import kernels
from cpindex.cli import build_parser


def _cpindex(*args: str, timeout: float = 120, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "cpindex", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """``cpindex.cli.main(argv)`` in this process: its exit status (argparse's too), stdout and
    stderr."""
    from cpindex import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse: --help, --version, bad arguments
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_two_ranks_matches():
    res = _cpindex("demo", "--world", "2", "--rows", "3", "--context", "1000")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "all ranks match" in res.stdout, out
    assert "MISMATCH" not in out
    assert "cpindex demo: 2 ranks, 3 rows up to 1000 tokens (8 blocks), format nvfp4" in out
    assert "transport collective" in out
    # one line per rank, both matching, same top-16
    rank_lines = [ln.split() for ln in res.stdout.splitlines() if ln.split()[:1] in (["0"], ["1"])]
    assert len(rank_lines) == 2, out
    assert all(ln[-2:] == ["yes", "same"] for ln in rank_lines), out


def test_help(capsys):
    code, out, err = _main(capsys, "--help")
    assert code == 0, err
    for word in ("demo", "bench", "info", "--version"):
        assert word in out
    assert "``" not in out  # no raw rST markup


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings and action.dest != "help":
            yield action


def test_every_option_has_help_and_a_default_shown(capsys):
    for action in _options(build_parser()):
        assert action.help, action.option_strings
        # argparse appends "(default: X)"; where the default is None the help says it itself
        if action.default is None:
            assert "default:" in action.help, action.option_strings
    code, out, err = _main(capsys, "bench", "--help")
    assert code == 0, err
    text = " ".join(out.split())
    for shown in ("(default: collective,ipc on a GPU machine", "(default: 4; --kernel: 1",
                  "(default: nvfp4)",
                  "(default: True)", "cpindex[bench]"):  # fmt: skip
        assert shown in text, shown


def test_info_names_one_pick(capsys):
    code, out, err = _main(capsys, "info")
    assert code == 0, err
    picks = [ln for ln in out.splitlines() if ln.startswith("'auto' would pick:")]
    assert len(picks) == 1, out
    assert picks[0].count("collective") == 1, picks[0]


def test_plot_without_matplotlib_fails_naming_the_extra(capsys, tmp_path, monkeypatch):
    """--plot fails at once (exit 2), naming the extra, when matplotlib cannot be imported
    (``sys.modules`` entry None: the import raises ImportError), before anything is timed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "out.png"
    code, out, err = _main(capsys, "bench", "--world", "2", "--rows", "1", "--context", "1k",
                           "--iters", "1", "--plot", str(png))  # fmt: skip
    assert code == 2
    assert "pip install cpindex[bench]" in err, err
    assert not png.exists()
    assert out == ""  # failed before timing anything


def test_demo_help_lists_options(capsys):
    code, out, err = _main(capsys, "demo", "--help")
    assert code == 0, err
    for opt in ("--world", "--rows", "--context", "--format", "--transport", "--seed"):
        assert opt in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "cpindex: error: the following arguments are required: COMMAND"),
        (["demo", "--format", "int4"], "cpindex demo: error: argument --format: invalid choice"),
        (["frobnicate"], "cpindex: error: argument COMMAND: invalid choice: 'frobnicate'"),
        (["bench", "--kernel", "--gate"], "cpindex bench: error: argument --gate: not allowed"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(capsys, args, says):
    """argparse's own errors come in the style of every other refusal: one line, no usage
    block, exit 2."""
    code, out, err = _main(capsys, *args)
    assert code == 2
    assert err.startswith(says) and err.count("\n") == 1, err
    assert "usage:" not in err and out == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--world", "0"], "argument --world: '0': expected one integer >= 1"),
        (["demo", "--rows", "-3"], "argument --rows: '-3': expected one integer >= 1"),
        (["demo", "--context", "x"], "argument --context: 'x': expected one integer >= 1"),
        (["bench", "--world", "2,4"], "argument --world: '2,4': expected one integer >= 1"),
        (["bench", "--iters", "0"], "argument --iters: '0': expected one integer >= 1"),
        (["bench", "--rows", "1,0"], "argument --rows: '1,0': expected a comma list of integers"),
        (["bench", "--query-len", "0"], "argument --query-len: '0': expected a comma list"),
    ],
)
def test_counts_below_one_are_refused_by_name(capsys, args, says):
    """A zero or negative count is an argparse error naming the option (exit 2), before any
    rank starts: not a silent success or a traceback from deep inside."""
    code, out, err = _main(capsys, *args)
    assert code == 2, out + err
    assert says in err, err


def test_bench_cpu_writes_json(capsys, tmp_path, monkeypatch):
    """`cpindex bench` on a CPU machine: collective + scoring + no-CP baseline, JSON out; the
    table printed once with its legend; no temporary file left behind or named in the JSON.
    A context that is not a whole number of blocks (1000 tokens: the last block partial) and a
    comma list of query lengths, as --help says; nothing printed that does not apply here (the
    selection legend without --select, the nccl-tests note on CPU, a transport not asked for)."""
    out = tmp_path / "bench.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    argv = ["bench", "--world", "2", "--rows", "1,3", "--context", "1000", "--iters", "2",
            "--query-len", "1,2", "--out", str(out)]  # fmt: skip
    code, stdout, err = _main(capsys, *argv)
    assert code == 0, err[-2000:]
    lines = stdout.splitlines()
    headers = [i for i, ln in enumerate(lines) if "collective us" in ln and "no-CP us" in ln]
    assert len(headers) == 1, stdout
    body = lines[headers[0] + 1 : headers[0] + 5]
    assert [ln.split()[:4] for ln in body] == [
        ["nvfp4", "1", "1", "1000"], ["nvfp4", "1", "2", "1000"],
        ["nvfp4", "3", "1", "1000"], ["nvfp4", "3", "2", "1000"],
    ], stdout  # fmt: skip
    assert sum(ln.lstrip().startswith("nvfp4") for ln in lines) == 4, stdout
    assert sum(ln.startswith("copy bandwidth: ") for ln in lines) == 1, stdout
    for word in ("  x ", "  GB/s ", "  score ", "  % copy ", "  no-CP "):  # the legend
        assert any(ln.startswith(word) for ln in lines), (word, stdout)
    for noise in ("Selection", "select", "alltoall_perf", "nccl-tests", "ipc", "skipping"):
        assert noise not in stdout, (noise, stdout)
    assert list(tmp.iterdir()) == []
    text = out.read_text()
    assert "results_path" not in text and str(tmp) not in text
    data = json.loads(text)
    assert data["meta"]["kernel_sources"] == kernels.sources_digest()  # names the code it ran
    assert data["spec"]["transports"] == ["collective"]
    assert [(r["rows"], r["query_len"]) for r in data["results"]] == [
        (1, 1),
        (1, 2),
        (3, 1),
        (3, 2),
    ]
    for r in data["results"]:
        assert r["agree"] == {"collective": True}
        assert r["collective"]["median_ms"] > 0 and r["nocp"]["median_ms"] > 0
        assert r["copy_gbs"] > 0 and 0 < r["scan_bytes_rank0"] <= r["scan_bytes_rank"]


def test_bench_cpu_select_prints_bytes_beside_times(capsys, tmp_path):
    """`cpindex bench --select` on CPU: select_blocks beside score_push + topk, and the bytes of
    both exchanges; the candidate bytes do not change with the context."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--world", "2", "--rows", "2", "--context", "1k,4k", "--iters", "1",
            "--query-len", "4", "--formats", "fp8", "--select", "--out", str(out)]  # fmt: skip
    code, stdout, err = _main(capsys, *argv)
    assert code == 0, err[-2000:]
    assert sum("select us" in ln and "push+topk us" in ln for ln in stdout.splitlines()) == 1
    assert "Selection (topk 16)" in stdout  # its legend, with --select only
    rows = json.loads(out.read_text())["results"]
    assert [r["context"] for r in rows] == [1024, 4096]
    for r in rows:
        assert r["collective_select"]["median_ms"] > 0 and r["collective_topk"]["median_ms"] > 0
    assert rows[0]["collective_bytes_select"] == rows[1]["collective_bytes_select"] > 0
    assert rows[1]["collective_bytes_scores"] == 4 * rows[0]["collective_bytes_scores"]


@pytest.mark.parametrize("args", [["--rows", "1,x"], ["--transports", "ipc,carrier"]])
def test_bench_bad_lists_exit_2(capsys, args):
    code, _, err = _main(capsys, "bench", *args)
    assert code == 2
    assert "expected a comma list" in err


def test_plot_legend_says_no_cp_and_explains_score(monkeypatch):
    """The plot's legend uses the table's names: no-CP (not 'nocp'), and says what score is.
    matplotlib is faked: the labels are recorded, nothing is drawn."""
    import types

    from cpindex.bench import runner

    labels: list[str] = []

    class Anything:
        def __getattr__(self, name):
            return lambda *a, **k: None

    class Line2D:
        def __init__(self, *a, label="", **k):
            labels.append(label)

    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda *a, **k: None
    mpl.pyplot = types.SimpleNamespace(subplots=lambda r, c, **k: (Anything(), [[Anything()] * c]))
    mpl.lines = types.SimpleNamespace(Line2D=Line2D)
    for name, mod in [("matplotlib", mpl), ("matplotlib.pyplot", mpl.pyplot),
                      ("matplotlib.lines", mpl.lines)]:  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    t = {"median_ms": 1.0}
    rec = {"format": "nvfp4", "rows": 1, "context": 1024, "collective": t, "score": t, "nocp": t}
    out = {"meta": {"device": "cpu"}, "spec": {"transports": ["collective"], "world": 2},
           "results": [rec]}  # fmt: skip
    runner._plot(out, "unused.png")
    assert any(lb.startswith("no-CP") for lb in labels), labels
    assert any(lb.startswith("score:") and "alone" in lb for lb in labels), labels
    assert not any("nocp" in lb for lb in labels), labels


# ------------------------------------------------------------------------ checked before spawning


_CPU = not torch.cuda.is_available()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--world", "3"], "cpindex demo: error: --world 3: num_heads (4) and world_size "
         "(3) must divide one another"),
        (["bench", "--world", "3"], "cpindex bench: error: --world 3: num_heads (4) and "
         "world_size (3) must divide one another"),
        (["demo", "--rows", "70000"], "cpindex demo: error: --rows 70000 --context 8192: "),
        (["bench", "--query-len", "1,9"], "cpindex bench: error: --query-len: at most 8"),
        (["bench", "--formats", "nvfp4-interleaved"], "cpindex bench: error: --formats "
         "nvfp4-interleaved: only with --kernel"),
        pytest.param(["bench", "--write"], "cpindex bench: error: --write needs a GPU",
                     marks=pytest.mark.skipif(not _CPU, reason="CPU only")),
        pytest.param(["demo", "--transport", "ipc"], "cpindex demo: error: --transport ipc needs "
                     "GPUs", marks=pytest.mark.skipif(not _CPU, reason="a CPU machine's refusal")),
        pytest.param(["bench", "--transports", "ipc"], "cpindex bench: error: --transports ipc: "
                     "ipc needs GPUs", marks=pytest.mark.skipif(not _CPU, reason="CPU only")),
        pytest.param(["bench", "--kernel"], "cpindex bench: error: --kernel needs a GPU",
                     marks=pytest.mark.skipif(not _CPU, reason="CPU only")),
        (["bench", "--gate", "--transports", "collective,auto"], "cpindex bench: error: --gate "
         "--transports collective,auto: one transport at a time"),
        (["bench", "--gate", "--plot", "gate.png"], "cpindex bench: error: --plot: not with "
         "--gate"),
        (["bench", "--gate", "--rccl-tests", "alltoall_perf"], "cpindex bench: error: "
         "--rccl-tests: not with --gate"),
        (["bench", "--gate", "--world", "3"], "cpindex bench: error: --world 3: num_heads (4) "
         "and world_size (3) must divide one another"),
        (["bench", "--gate", "--query-len", "2,9"], "cpindex bench: error: --query-len: at most "
         "8"),
        (["bench", "--gate", "--formats", "nvfp4-pool"], "cpindex bench: error: --formats "
         "nvfp4-pool: only with --kernel"),
        (["bench", "--gate", "--rows", "70000"], "cpindex bench: error: "
         "--rows/--context/--query-len: "),
        pytest.param(["bench", "--gate", "--transports", "ipc"], "cpindex bench: error: "
                     "--transports ipc: ipc needs GPUs",
                     marks=pytest.mark.skipif(not _CPU, reason="CPU only")),
        # sizes past the limits, named; sizes past this machine's memory, before allocating
        (["demo", "--rows", "100000"], "cpindex demo: error: --rows 100000 --context 8192: "
         "max_rows=100000: Input should be less than or equal to 65536"),
        (["demo", "--context", "200000000"], "cpindex demo: error: --rows 8 --context 200000000: "
         "max_width=1562500: "),
        (["demo", "--rows", "4000", "--context", "65536"], "cpindex demo: error: --rows 4000 "
         "--context 65536 on 4 ranks needs about "),
        (["bench", "--context", "100000000"], "cpindex bench: error: --rows 8 --context "
         "100000000 on 4 ranks needs about "),
        (["bench", "--gate", "--rows", "4000", "--context", "64k"], "cpindex bench: error: "
         "--rows 4000 --context 65536 on 4 ranks needs about "),
        (["bench", "--out", "/"], "cpindex bench: error: --out /: is a directory"),
        (["bench", "--plot", "/nonexistent/x.png"], "cpindex bench: error: --plot "
         "/nonexistent/x.png: directory '/nonexistent' does not exist"),
        (["build", "--formats", "int4"], "cpindex build: error: argument --formats: 'int4'"),
        pytest.param(["build", "--arch", "sm_90"], "cpindex build: error: --arch sm_90: this "
                     "torch (", marks=pytest.mark.skipif(bool(torch.version.cuda or
                     torch.version.hip), reason="a CPU build of torch's refusal")),
        pytest.param(["build", "--arch", "gfx942", "--formats", "fp8"], "cpindex build: error: "
                     "--arch gfx942: this torch (", marks=pytest.mark.skipif(
                     bool(torch.version.cuda or torch.version.hip), reason="CPU torch")),
    ],
)  # fmt: skip
def test_arguments_are_checked_before_any_rank_starts(capsys, tmp_path, monkeypatch, argv, says):
    """What every rank would refuse is refused in the parent: one line, exit 2, nothing run
    (so nothing left behind)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code, out, err = _main(capsys, *argv)
    assert code == 2, (out, err)
    assert err.startswith(says), err
    assert err.count("\n") == 1, err  # one line
    assert out == ""
    assert list(tmp_path.iterdir()) == []


def test_version(capsys):
    import cpindex

    code, out, _ = _main(capsys, "--version")
    assert code == 0
    assert out == f"cpindex {cpindex.__version__}\n"


def test_query_len_takes_the_comma_list_its_help_promises():
    args = build_parser().parse_args(["bench", "--query-len", "1,4"])
    assert args.query_len == [1, 4]


# --------------------------------------------------------------------------------------- --gate


def _gate_specs(*argv: str):
    from cpindex.bench.runner import gate_specs

    return gate_specs(build_parser().parse_args(["bench", "--gate", *argv]), gpu=False)


def test_gate_is_a_bench_mode_of_its_own(capsys):
    code, out, err = _main(capsys, "bench", "--help")
    assert code == 0, err
    text = " ".join(out.split())
    for shown in ("--gate", "--gate: one transport, auto", "--gate: one sweep per T",
                  "--gate: also sweep select_blocks", "cp_min_blocks='auto'"):  # fmt: skip
        assert shown in text, shown
    assert build_parser().parse_args(["bench", "--gate"]).gate is True
    code, _, err = _main(capsys, "bench", "--gate", "--kernel")
    assert code == 2 and "not allowed with argument" in err, err


def test_gate_specs_one_sweep_per_format_query_length_and_call():
    """The bench flags that apply become the sweeps' fields: a sweep per (format, T, call),
    every one on the one transport and world; the CPU defaults where a list is not given."""
    specs = _gate_specs("--formats", "fp8,nvfp4", "--query-len", "1,4", "--select",
                        "--world", "2", "--rows", "1,8", "--context", "1k,4k", "--iters", "3",
                        "--no-graphs", "--transports", "collective")  # fmt: skip
    assert [(s.fmt, s.query_len, s.op) for s in specs] == [
        ("fp8", 1, "score_push"), ("fp8", 1, "select_blocks"),
        ("fp8", 4, "score_push"), ("fp8", 4, "select_blocks"),
        ("nvfp4", 1, "score_push"), ("nvfp4", 1, "select_blocks"),
        ("nvfp4", 4, "score_push"), ("nvfp4", 4, "select_blocks"),
    ]  # fmt: skip
    for s in specs:
        assert (s.world, s.transport, s.iters, s.graphs) == (2, "collective", 3, False)
        assert (s.requests, s.contexts) == ([1, 8], [1024, 4096])
    (default,) = _gate_specs()
    assert (default.fmt, default.world, default.transport, default.op) == (
        "nvfp4", 4, "auto", "score_push",
    )  # fmt: skip
    assert (default.requests, default.contexts, default.iters) == ([1, 8], [2048, 8192], 5)


def test_gate_config_is_built_from_the_spec_and_the_world():
    """Each rank's configuration comes from (spec, world): the spec's transport and format,
    sized for its largest call; the gate forced either way or left to auto."""
    from cpindex.bench import gate_sweep

    (spec,) = _gate_specs("--transports", "collective", "--formats", "fp8", "--rows", "2,6",
                          "--context", "1k,3000", "--query-len", "3", "--world", "2")  # fmt: skip
    cfg = gate_sweep.config(spec, 2)
    assert (cfg.transport, cfg.cache_format, cfg.world_size) == ("collective", "fp8", 2)
    assert (cfg.max_rows, cfg.max_query_len, cfg.max_width) == (18, 3, 24)
    assert cfg.cp_min_blocks == "auto" and gate_sweep.config(spec, None, 0).cp_min_blocks == 0


# ------------------------------------------------------------------ misuse, as a user meets it


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # 409 GB of float32 keys per rank: refused from the memory model, nothing allocated
        (["demo", "--context", "100000000"], "cpindex demo: error: --rows 8 --context 100000000 "
         "on 4 ranks needs about "),
        (["bench", "--out", "/nonexistent/x.json"], "cpindex bench: error: --out "
         "/nonexistent/x.json: directory '/nonexistent' does not exist"),
    ],
)  # fmt: skip
def test_misuse_is_one_line_and_exit_2(tmp_path, argv, says):
    """What a user can get wrong, run as they run it: one line on stderr, exit 2, in seconds
    (sizes refused from the library's buffer model and the machine's free memory before
    anything is allocated; the output path before the run). The other refusals, argparse's
    among them, are checked in this process (test_bad_arguments_exit_2_in_one_line,
    test_arguments_are_checked_before_any_rank_starts)."""
    res = _cpindex(*argv, timeout=60, env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2, (res.stdout, res.stderr[-3000:])
    assert res.stderr.startswith(says), res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_before_the_run(capsys, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        code, out, err = _main(capsys, "bench", "--out", str(folder / "x.json"))
    finally:
        folder.chmod(0o700)
    assert code == 2 and "not writable" in err and err.count("\n") == 1, err
    assert out == ""


def test_pydantic_refusals_name_the_field_and_value():
    from cpindex.cli_common import first_error
    from cpindex.config import CPIndexConfig

    with pytest.raises(ValueError) as e:
        CPIndexConfig(max_rows=100000)
    assert first_error(e.value).startswith("max_rows=100000: Input should be less than")
    with pytest.raises(ValueError) as e:
        CPIndexConfig(world_size=3)  # a model check: no field to name
    assert first_error(e.value).startswith("num_heads (4) and world_size (3) must divide")


def test_a_rank_out_of_memory_is_one_line_exit_2():
    """A rank that runs out of memory anyway (the model missed it, or memory went elsewhere)
    or is killed for it: one line, exit 2; a rank's bug keeps its traceback."""
    from cpindex import cli
    from cpindex.spawn import RankFailure, RanksFailed

    def failed(type_name, message, expected=False):
        return RanksFailed([RankFailure(1, type_name, message, "tb", expected, 0.0)])

    oom = failed("RuntimeError", "DefaultCPUAllocator: can't allocate memory: you tried ...")
    assert cli._failure(oom) == (
        2, "rank 1: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried ... "
        "(lower the sizes)",
    )  # fmt: skip
    code, line = cli._failure(failed("ProcessExit", "the process was killed by SIGKILL"))
    assert code == 2 and "most likely out of memory" in line
    assert cli._failure(failed("ValueError", "iq: bad", expected=True))[0] == 2
    assert cli._failure(failed("AssertionError", "x")) is None  # a bug: the traceback
    assert cli._failure(MemoryError())[0] == 2
    assert cli._failure(KeyError("x")) is None


_GPU_VISIBLE = torch.cuda.is_available()


@pytest.mark.skipif(_GPU_VISIBLE, reason="a machine without a GPU")
def test_build_without_a_gpu_or_arch_is_one_line_exit_2(tmp_path):
    """``cpindex build`` with nothing to build for: one line, exit 2, nothing in the cache."""
    res = _cpindex("build", timeout=60, env={"CPINDEX_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 2, (res.stdout, res.stderr[-3000:])
    assert res.stderr == (
        "cpindex build: error: no GPU visible: name the target with --arch (e.g. sm_90, gfx942)\n"
    )
    assert not (tmp_path / "cache").exists()


def test_build_help_names_the_cache_and_arch(capsys):
    code, out, err = _main(capsys, "build", "--help")
    assert code == 0, err
    text = " ".join(out.split())
    for shown in ("--arch LIST", "gfx942", "CPINDEX_CACHE_DIR", "(default: bf16,fp8,nvfp4)"):
        assert shown in text, shown
