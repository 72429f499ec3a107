"""Tests for cpindex.config: defaults, validators, environment, files, derived values."""

from __future__ import annotations

import json
import os
import time

import pytest
import yaml
from pydantic import ValidationError

from cpindex.config import (
    MAX_CONFIG_FILE_BYTES,
    MAX_KERNEL_HEADS,
    NOT_CONFIG_ENV,
    CPIndexConfig,
)

# --------------------------------------------------------------------------- defaults


def test_defaults_match_the_seed_deployment():
    c = CPIndexConfig()
    assert c.transport == "auto"
    assert c.world_size is None
    assert c.num_heads == 4
    assert c.head_dim == 128
    assert c.block_size == 128
    assert c.cache_format == "nvfp4"
    assert c.max_rows == 256
    assert c.max_width == 4096
    assert c.sm_scale == pytest.approx(128**-0.5, rel=0, abs=0)
    assert c.timeout_s == 10.0
    assert c.error_check == "next_call"
    assert c.prefer_mori is False
    assert c.ipc_self_test is True


def test_config_is_frozen():
    c = CPIndexConfig()
    with pytest.raises(ValidationError, match="frozen"):
        c.max_rows = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- validators


@pytest.mark.parametrize(("heads", "world"), [(3, 2), (4, 3), (6, 4), (8, 3), (2, 3), (3, 4)])
def test_heads_and_world_must_divide(heads, world):
    msg = rf"num_heads \({heads}\) and world_size \({world}\) must divide one another"
    with pytest.raises(ValidationError, match=msg):
        CPIndexConfig(num_heads=heads, world_size=world)


@pytest.mark.parametrize(
    ("heads", "world"), [(4, 1), (4, 2), (4, 4), (4, 8), (2, 4), (1, 3), (8, 2)]
)
def test_heads_and_world_that_divide_are_accepted(heads, world):
    assert CPIndexConfig(num_heads=heads, world_size=world).world_size == world


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_rows", 0, "greater than or equal to 1"),
        ("max_rows", -3, "greater than or equal to 1"),
        ("max_rows", 65537, "less than or equal to 65536"),
        ("max_width", 0, "greater than or equal to 1"),
        ("max_width", (1 << 20) + 1, "less than or equal to 1048576"),
        ("num_heads", 0, "greater than or equal to 1"),
        ("num_heads", MAX_KERNEL_HEADS + 1, f"less than or equal to {MAX_KERNEL_HEADS}"),
        ("world_size", 0, "greater than or equal to 1"),
        ("world_size", -1, "greater than or equal to 1"),
        ("sm_scale", 0.0, "greater than 0"),
        ("sm_scale", -1.0, "greater than 0"),
        ("timeout_s", 0.0, "greater than 0"),
        ("timeout_s", 3601.0, "less than or equal to 3600"),
    ],
)
def test_size_bounds_name_the_field(field, value, expected):
    with pytest.raises(ValidationError) as ei:
        CPIndexConfig(**{field: value})
    text = str(ei.value)
    assert field in text
    assert expected in text


def test_unknown_key_rejected():
    with pytest.raises(ValidationError, match=r"(?s)max_row\b.*Extra inputs are not permitted"):
        CPIndexConfig(max_row=4)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("transport", "nccl", "'auto', 'ipc', 'mori' or 'collective'"),
        ("transport", "IPC", "'auto', 'ipc', 'mori' or 'collective'"),
        ("cache_format", "fp4", "'bf16', 'fp8' or 'nvfp4'"),
        ("cache_format", "int8", "'bf16', 'fp8' or 'nvfp4'"),
        ("error_check", "never", "'next_call' or 'sync'"),
        ("head_dim", 64, "Input should be 128"),
        ("head_dim", 256, "Input should be 128"),
        ("block_size", 64, "Input should be 128"),
    ],
)
def test_literals_rejected_with_choices(field, value, expected):
    with pytest.raises(ValidationError) as ei:
        CPIndexConfig(**{field: value})
    assert field in str(ei.value)
    assert expected in str(ei.value)


def test_validation_error_is_a_value_error():
    with pytest.raises(ValueError):
        CPIndexConfig(max_rows=0)


# --------------------------------------------------------------------------- environment


def test_from_env_reads_prefixed_variables():
    env = {
        "CPINDEX_TRANSPORT": "ipc",
        "CPINDEX_CACHE_FORMAT": "fp8",
        "CPINDEX_MAX_ROWS": "8",
        "CPINDEX_MAX_WIDTH": "64",
        "CPINDEX_SM_SCALE": "0.25",
        "CPINDEX_PREFER_MORI": "true",
        "CPINDEX_WORLD_SIZE": "none",
        "CPINDEX_NUM_HEADS": "2",
        "PATH": "/usr/bin",  # not ours: ignored
        "XCPINDEX_FOO": "1",  # prefix must be at the start
    }
    c = CPIndexConfig.from_env(env)
    assert c.transport == "ipc"
    assert c.cache_format == "fp8"
    assert c.max_rows == 8
    assert c.max_width == 64
    assert c.sm_scale == 0.25
    assert c.prefer_mori is True
    assert c.world_size is None
    assert c.num_heads == 2


@pytest.mark.parametrize("transport", ["auto", "ipc", "mori", "collective"])
def test_from_env_transport(transport):
    assert CPIndexConfig.from_env({"CPINDEX_TRANSPORT": transport}).transport == transport


def test_from_env_unknown_variable_named():
    with pytest.raises(ValueError, match=r"unknown environment variable CPINDEX_FOO\b") as ei:
        CPIndexConfig.from_env({"CPINDEX_FOO": "1", "CPINDEX_MAX_ROWS": "4"})
    # the message says what the configuration's variables are, so a typo is easy to fix
    assert "CPINDEX_<FIELD>" in str(ei.value)
    assert "max_rows" in str(ei.value) and "transport" in str(ei.value)


def test_from_env_unknown_variable_names_the_closest_field():
    with pytest.raises(ValueError, match=r"did you mean CPINDEX_MAX_ROWS\?"):
        CPIndexConfig.from_env({"CPINDEX_MAX_ROW": "4"})


@pytest.mark.parametrize("name", sorted(NOT_CONFIG_ENV))
def test_from_env_skips_variables_that_are_not_configuration(name):
    assert name in {"CPINDEX_CACHE_DIR", "CPINDEX_KERNEL_DEFINES"}
    c = CPIndexConfig.from_env({name: "/tmp/x CP_A=1", "CPINDEX_MAX_ROWS": "4"})
    assert c == CPIndexConfig(max_rows=4)


def test_from_env_reads_values_as_a_json_file_would():
    env = {
        "CPINDEX_HEAD_DIM": "128",  # Literal[128]: the string '128' alone would be refused
        "CPINDEX_BLOCK_SIZE": " 128 ",
        "CPINDEX_TIMEOUT_S": "2.5",
        "CPINDEX_SM_SCALE": "1e-2",
        "CPINDEX_IPC_SELF_TEST": "false",
        "CPINDEX_TRANSPORT": '"collective"',  # a JSON string is read as one
        "CPINDEX_ERROR_CHECK": "sync",  # not JSON: the string itself
        "CPINDEX_WORLD_SIZE": "null",
    }
    c = CPIndexConfig.from_env(env)
    assert (c.head_dim, c.block_size, c.timeout_s, c.sm_scale) == (128, 128, 2.5, 0.01)
    assert c.ipc_self_test is False
    assert (c.transport, c.error_check, c.world_size) == ("collective", "sync", None)
    with pytest.raises(ValidationError, match="head_dim"):
        CPIndexConfig.from_env({"CPINDEX_HEAD_DIM": "64"})
    with pytest.raises(ValidationError, match="max_rows"):
        CPIndexConfig.from_env({"CPINDEX_MAX_ROWS": "true"})  # a bool is not a count
    with pytest.raises(ValueError, match="CPINDEX_MAX_ROWS: expected one value"):
        CPIndexConfig.from_env({"CPINDEX_MAX_ROWS": "[1, 2]"})


def test_from_env_bad_value_names_field():
    with pytest.raises(ValidationError, match="max_rows"):
        CPIndexConfig.from_env({"CPINDEX_MAX_ROWS": "many"})
    with pytest.raises(ValidationError, match="transport"):
        CPIndexConfig.from_env({"CPINDEX_TRANSPORT": "carrier-pigeon"})


def test_from_env_overrides_win():
    env = {"CPINDEX_TRANSPORT": "ipc", "CPINDEX_MAX_ROWS": "8"}
    c = CPIndexConfig.from_env(env, transport="collective", max_width=32)
    assert c.transport == "collective"
    assert c.max_rows == 8
    assert c.max_width == 32


def test_from_env_defaults_to_process_environment(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("CPINDEX_"):
            monkeypatch.delenv(key)
    assert CPIndexConfig.from_env() == CPIndexConfig()
    monkeypatch.setenv("CPINDEX_CACHE_FORMAT", "bf16")
    monkeypatch.setenv("CPINDEX_TIMEOUT_S", "2.5")
    c = CPIndexConfig.from_env()
    assert c.cache_format == "bf16"
    assert c.timeout_s == 2.5
    monkeypatch.setenv("CPINDEX_TRANSPROT", "ipc")
    with pytest.raises(ValueError, match="CPINDEX_TRANSPROT"):
        CPIndexConfig.from_env()


# --------------------------------------------------------------------------- files

_CUSTOM = dict(
    transport="collective",
    world_size=2,
    num_heads=8,
    cache_format="fp8",
    max_rows=17,
    max_width=333,
    sm_scale=0.123456789012345,
    timeout_s=3.5,
    error_check="sync",
    prefer_mori=True,
    ipc_self_test=False,
)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml", ".JSON"])
@pytest.mark.parametrize("custom", [True, False])
def test_file_round_trip(tmp_path, suffix, custom):
    c = CPIndexConfig(**_CUSTOM) if custom else CPIndexConfig()
    path = tmp_path / f"cfg{suffix}"
    c.dump_file(path)
    back = CPIndexConfig.from_file(path)
    assert back == c
    assert back.sm_scale == c.sm_scale  # floats survive exactly
    # the file is what its suffix says
    text = path.read_text()
    data = json.loads(text) if suffix.lower() == ".json" else yaml.safe_load(text)
    assert data["max_rows"] == c.max_rows
    assert data["world_size"] == c.world_size


def test_dump_json_round_trip():
    c = CPIndexConfig(**_CUSTOM)
    assert CPIndexConfig.model_validate_json(c.dump_json()) == c


def test_from_file_rejects_bad_suffix_and_non_mapping(tmp_path):
    p = tmp_path / "cfg.toml"
    p.write_text("max_rows = 3\n")
    with pytest.raises(ValueError, match=r"must end in \.json, \.yaml or \.yml"):
        CPIndexConfig.from_file(p)
    p = tmp_path / "cfg.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping, got list"):
        CPIndexConfig.from_file(p)


def test_from_file_validates(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"max_rows": 4, "bogus": 1}))
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        CPIndexConfig.from_file(p)
    p.write_text(json.dumps({"num_heads": 3, "world_size": 2}))
    with pytest.raises(ValidationError, match="must divide one another"):
        CPIndexConfig.from_file(p)


def test_from_file_bounds_the_size_read(tmp_path):
    p = tmp_path / "cfg.json"
    pad = " " * MAX_CONFIG_FILE_BYTES
    p.write_text('{"max_rows": 4}' + pad)
    with pytest.raises(ValueError, match=f"larger than {MAX_CONFIG_FILE_BYTES:,} bytes"):
        CPIndexConfig.from_file(p)
    p.write_text('{"max_rows": 4}' + pad[: MAX_CONFIG_FILE_BYTES - 20])
    assert CPIndexConfig.from_file(p).max_rows == 4
    endless = tmp_path / "endless.yaml"  # not a regular file: read up to the bound only
    os.symlink("/dev/zero", endless)
    with pytest.raises(ValueError, match="larger than"):
        CPIndexConfig.from_file(endless)


def test_from_file_with_300k_unknown_keys_fails_fast_and_short(tmp_path):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({f"key{i}": i for i in range(300_000)}))
    t0 = time.monotonic()
    with pytest.raises(ValueError) as ei:
        CPIndexConfig.from_file(p)
    assert time.monotonic() - t0 < 2.0
    assert len(str(ei.value)) < 400, str(ei.value)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_from_file_names_a_few_unknown_keys(tmp_path, suffix):
    keys = {f"k{i}": i for i in range(3000)} | {"max_rows": 4}
    p = tmp_path / f"cfg{suffix}"
    p.write_text(json.dumps(keys) if suffix == ".json" else yaml.safe_dump(keys, sort_keys=False))
    with pytest.raises(ValueError) as ei:
        CPIndexConfig.from_file(p)
    msg = str(ei.value)
    assert "unknown keys 'k0', 'k1', 'k2', 'k3', 'k4' and 2,995 more" in msg
    assert "max_rows" in msg  # the fields are listed
    assert len(msg) < 500, msg
    p.write_text(json.dumps({"max_row": 4}) if suffix == ".json" else "max_row: 4\n")
    with pytest.raises(ValueError, match="did you mean 'max_rows'"):
        CPIndexConfig.from_file(p)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_from_file_refuses_undecodable_bytes(tmp_path, suffix):
    p = tmp_path / f"cfg{suffix}"
    p.write_bytes(b"max_rows: 4\n" if suffix == ".yaml" else b'{"max_rows": 4}')
    assert CPIndexConfig.from_file(p).max_rows == 4
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())  # a UTF-8 byte-order mark is fine
    assert CPIndexConfig.from_file(p).max_rows == 4
    p.write_bytes(b'{"transport": "\xff\xfe"}')
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 0xff at offset 15\)"):
        CPIndexConfig.from_file(p)


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".json", '{"max_rows": ' + "[" * 5000 + "]" * 5000 + "}"),
        (".yaml", "max_rows: " + "[" * 800 + "]" * 800),  # past Python's recursion limit
        (".yaml", "max_rows: " + "{a: " * 800 + "}" * 800),
    ],
)
def test_from_file_refuses_deep_nesting_without_recursion_error(tmp_path, suffix, text):
    p = tmp_path / f"cfg{suffix}"
    p.write_text(text)
    with pytest.raises(ValueError, match="nested too deeply"):
        CPIndexConfig.from_file(p)


@pytest.mark.parametrize("value", [[4], {"a": 4}])
def test_from_file_refuses_nested_values(tmp_path, value):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps({"max_rows": value}))
    with pytest.raises(ValueError, match=r"'max_rows' holds a (list|dict); every field takes one"):
        CPIndexConfig.from_file(p)


# --------------------------------------------------------------------------- derived


def test_with_world_size_binds_and_revalidates():
    c = CPIndexConfig(max_rows=5)
    bound = c.with_world_size(4)
    assert bound.world_size == 4
    assert bound.max_rows == 5
    assert c.world_size is None  # the original is untouched
    assert CPIndexConfig(world_size=2).with_world_size(2).world_size == 2
    with pytest.raises(ValidationError, match=r"num_heads \(4\) and world_size \(3\)"):
        c.with_world_size(3)


def test_with_world_size_mismatch_message():
    with pytest.raises(
        ValueError, match=r"config\.world_size is 2 but the process group has 4 ranks"
    ):
        CPIndexConfig(world_size=2).with_world_size(4)


@pytest.mark.parametrize(
    ("heads", "world", "hpr"),
    [(4, 1, 4), (4, 2, 2), (4, 4, 1), (4, 8, 1), (8, 2, 4), (8, 4, 2), (2, 4, 1), (1, 8, 1)],
)
def test_heads_per_rank(heads, world, hpr):
    assert CPIndexConfig(num_heads=heads).heads_per_rank(world) == hpr
    assert CPIndexConfig(num_heads=heads, world_size=world).heads_per_rank() == hpr
    assert CPIndexConfig(num_heads=heads).with_world_size(world).heads_per_rank() == hpr


def test_heads_per_rank_unbound_is_one_rank():
    assert CPIndexConfig(num_heads=4).heads_per_rank() == 4
