# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm-dsv4-bench`` without vLLM: every command reaches its module (``--help``), no
command means ``step-ab``, an unknown one is refused; the A/B engine's CLI pieces
(positive ints, batch lists, ``finish`` / ``conclude``). The commands themselves:
test_step_ab.py, test_layer_ab_format.py, test_e2e_layers.py, test_solo_identity.py and
tests/vllm/test_step_ab_engine.py."""

from __future__ import annotations

import argparse

import pytest

from vllm_dsv4_backend.bench import ab, cli


def test_every_command_reaches_its_module(capsys: pytest.CaptureFixture[str]) -> None:
    flags = {"step-ab": "--requests", "layer-ab": "--reps", "e2e-layers": "--rounds",
             "solo-identity": "--concurrency", "kernels": "--no-naive"}
    assert set(flags) == set(cli.SUBCOMMANDS)
    for name, flag in flags.items():
        with pytest.raises(SystemExit) as ei:
            cli.main([name, "--help"])
        assert ei.value.code == 0
        out = capsys.readouterr().out
        assert flag in out and f"vllm-dsv4-bench {name}" in out, name


def test_default_command_and_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.SUBCOMMANDS)
    with pytest.raises(SystemExit) as ei:
        cli.main(["--requests", "0"])  # step-ab's flag, checked by step-ab's parser
    assert ei.value.code == 2
    assert "vllm-dsv4-bench step-ab" in capsys.readouterr().err
    assert cli.main(["layer-bench"]) == 2
    assert "unknown command 'layer-bench'" in capsys.readouterr().err


def test_argument_types() -> None:
    assert ab.positive("3") == 3 and ab.batches("1,8, 32") == [1, 8, 32]
    for bad in ("0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab.positive(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        ab.batches(",")
    args = ab.parser("doc\n\nmore", context=16).parse_args([])
    assert (args.batches, args.context, args.prefill, args.threads, args.flash_shaped,
            args.json) == ([1, 8, 32], 16, 1024, None, False, None)


def test_finish_and_conclude(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ab.finish({"a": 1}, str(tmp_path / "r.json"), "table") == 0
    assert (tmp_path / "r.json").read_text().strip().startswith("{")
    assert capsys.readouterr().out == "table\n"
    assert ab.finish({"a": 1}, None, "t2") == 0 and not (tmp_path / "t2").exists()

    def failing() -> dict:
        raise RuntimeError("server died")

    assert ab.conclude("step-ab", failing, str, None) == 3
    assert capsys.readouterr().err == "step-ab failed: server died\n"
    assert ab.conclude("x", lambda: {"b": 2}, lambda r: f"b={r['b']}", None) == 0
    assert capsys.readouterr().out == "b=2\n"


def test_ratio_stats() -> None:
    assert ab.ratio_stats([]) == {"pairs": 0, "ratio_median": None, "ratio_ci95_lo": None,
                                  "ratio_ci95_hi": None, "verdict": "n/a"}
    row = ab.ratio_stats([1.1 + 0.001 * i for i in range(40)])
    assert row["pairs"] == 40 and row["verdict"] == "plugin"
    assert row["ratio_ci95_lo"] <= row["ratio_median"] <= row["ratio_ci95_hi"]
