"""bench/peers.py: parsing llama-bench and accelerate output, outcomes, ratios, the table; one tiny run
in a memory group (peers that are not installed are skipped and say so)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tiny import bench  # noqa: E402


LLAMA_BENCH_JSON = json.dumps([
    {"build_commit": "0c1e57098", "build_number": 0, "n_threads": 2, "model_type": "llama 7B F16",
     "model_size": 13476831232, "n_prompt": 0, "n_gen": 4, "avg_ns": 40_000_000_000, "stddev_ns": 0,
     "samples_ns": [40_000_000_000], "avg_ts": 0.1}])


def test_parse_llama_bench_gives_ms_per_generated_token():
    r = bench("peers_report").parse_llama_bench(LLAMA_BENCH_JSON)
    assert r["ms_per_token"] == pytest.approx(10_000.0) and r["tokens"] == 4
    assert r["build"].startswith("0c1e57098") and r["threads"] == 2
    with pytest.raises(ValueError, match="no token-generation test"):
        bench("peers_report").parse_llama_bench(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ns": 1}]))


def test_parse_progress_keeps_the_tokens_of_an_unfinished_run():
    lines = [{"event": "load", "load_s": 3.0, "modules_disk": 20}, {"event": "token", "ms": 100.0},
             {"event": "token", "ms": 300.0}]
    r = bench("peers_report").parse_progress("\n".join(json.dumps(e) for e in lines) + "\n")
    assert r["token_ms"] == [100.0, 300.0] and r["ms_per_token"] == 200.0 and r["tokens"] == 2
    assert r["modules_disk"] == 20 and not r["done"]
    done = bench("peers_report").parse_progress(json.dumps({"event": "done", "rss_peak": 5}))
    assert done["done"] and "ms_per_token" not in done


@pytest.mark.parametrize("rc, timed_out, oom, expected", [
    (0, False, 0, "ran"), (-9, False, 1, "OOM-killed"), (137, False, None, "OOM-killed"),
    (-9, True, 0, "timeout"), (1, False, 0, "error"), (1, False, 2, "OOM-killed")])
def test_outcome(rc, timed_out, oom, expected):
    assert bench("peers_report").outcome(rc, timed_out, oom) == expected


def test_summary_ratios_and_table():
    peers = bench("peers_report")
    runs = [dict(peer="flashllm", label="flashllm", round=0, outcome="ran", ms_per_token=1000.0, cgroup_peak=7e9),
            dict(peer="llama.cpp", label="llama.cpp", round=0, outcome="ran", ms_per_token=4000.0, cgroup_peak=8e9),
            dict(peer="flashllm", label="flashllm", round=1, outcome="ran", ms_per_token=3000.0, cgroup_peak=6e9),
            dict(peer="llama.cpp", label="llama.cpp", round=1, outcome="ran", ms_per_token=2000.0, cgroup_peak=8.1e9),
            dict(peer="llama.cpp", label="llama.cpp", round=2, outcome="OOM-killed", cgroup_peak=8.2e9),
            dict(peer="accelerate", label="accelerate", round=0, outcome="timeout", ms_per_token=500.0, tokens=1)]
    rows = peers.summarize(runs)
    fl, ll, acc = rows
    assert fl["ms_per_token"] == 2000.0 and fl["range"] == (1000.0, 3000.0) and fl["peak_bytes"] == 7e9
    assert ll["ms_per_token"] == 3000.0 and ll["outcomes"] == ["ran", "ran", "OOM-killed"] and ll["peak_bytes"] == 8.2e9
    assert acc["outcomes"] == ["timeout (1 tokens)"]
    r = peers.ratios(rows, runs)
    assert r["llama.cpp"]["ratio"] == pytest.approx(2 / 3) and r["llama.cpp"]["per_round"] == [0.25, 1.5]
    assert r["accelerate"] == {"ratio": 4.0, "per_round": [2.0]}
    text = peers.table(rows, r)
    assert "| llama.cpp | ran, ran, OOM-killed | 3,000 (2,000–4,000) | 8.20 | 0.67 (flashllm 1.5× faster); " \
           "per round 0.25–1.50 |" in text
    assert "| flashllm | ran, ran | 2,000 (1,000–3,000) | 7.00 | — |" in text
    assert "| accelerate | timeout (1 tokens) | 500 | — | 4.00 (flashllm 4.0× slower) |" in text
    assert peers.ratios([dict(peer="llama.cpp", label="l", ms_per_token=None)]) == {"l": {"ratio": None,
                                                                                        "per_round": []}}


def test_tiny_run_in_memory_groups_skips_missing_peers(tmp_path):
    peers = bench("peers")
    model = bench("make_model").main(["--shape", "tiny-llama", "--out", str(tmp_path / "m"), "--hf", "--quiet"])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # never read: llama-bench is not where --llama-cpp points
    report = peers.main(["--flashllm", str(model), "--gguf", str(gguf), "--hf", str(model / "hf"), "--dram-budget",
                         "1MiB", "--tokens", "2", "--warmup", "1", "--llama-cpp", str(tmp_path / "none"),
                         "--peers", "flashllm,llama.cpp", "--markdown", str(tmp_path / "p.md"), "--quiet",
                         "--timeout", "300"])
    by = {r["label"]: r for r in report["runs"]}
    assert by["flashllm (sparse)"]["outcome"] == "ran" and by["flashllm (sparse)"]["tokens"] == 2
    assert by["flashllm (sparse)"]["ms_per_token"] > 0
    assert {by[f"llama.cpp ({c})"]["outcome"] for c in peers.LLAMA_CONFIGS} == {"skipped"}
    assert "not installed" in by["llama.cpp (default)"]["why"]
    assert "HF accelerate (disk offload)" not in by  # not in --peers
    md = (tmp_path / "p.md").read_text()
    assert "| flashllm (sparse) | ran |" in md and "skipped: not installed" in md
    if report["memory_limit"]:  # root with cgroup v1: the run had its own group, removed afterwards
        group = Path(by["flashllm (sparse)"]["cgroup"])
        assert by["flashllm (sparse)"]["cgroup_limit"] == report["memory_limit"]
        assert 0 < by["flashllm (sparse)"]["cgroup_peak"] <= report["memory_limit"]
        assert not group.exists()
    else:
        assert "memory limit: none" in md


@pytest.mark.parametrize("flag", ["--flashllm", "--gguf"])
def test_missing_inputs_are_one_line_errors(tmp_path, flag):
    argv = ["--flashllm", str(tmp_path / "nope")] if flag == "--flashllm" else \
        ["--flashllm", str(tmp_path), "--gguf", str(tmp_path / "x.gguf")]
    with pytest.raises(SystemExit, match=f"peers: error: {flag}"):
        bench("peers").main(argv)


def _group_or_skip():
    why = bench("paper_tables").MemoryGroup.available()
    if why:
        pytest.skip(why)


def test_a_run_over_the_limit_is_oom_killed_and_its_group_removed(tmp_path):
    _group_or_skip()
    grow = "b = []\nwhile True: b.append(bytearray(1 << 20))"  # 1 MiB at a time, touched
    res = bench("peers").run_child([sys.executable, "-c", grow], 64 << 20, [], 120, "flashllm-peers-test-oom",
                                   lambda m: None)
    assert res["outcome"] == "OOM-killed" and res["oom_kills"] >= 1 and res["cgroup_peak"] <= 64 << 20
    assert not Path(res["cgroup"]).exists()


def test_a_run_past_its_time_is_killed_as_timeout(tmp_path):
    _group_or_skip()
    res = bench("peers").run_child(["sleep", "60"], 64 << 20, [], 1, "flashllm-peers-test-timeout", lambda m: None)
    assert res["outcome"] == "timeout" and res["wall_s"] < 30 and not Path(res["cgroup"]).exists()
