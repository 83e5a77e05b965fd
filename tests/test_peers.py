"""bench/peers (`python -m bench peers`): parsing llama-bench and accelerate output, outcomes, ratios, the table; one tiny run
in a memory group (peers that are not installed are skipped and say so)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.models import make_model
from bench.harness import MemoryGroup
from bench.peers import gguf_convert, gguf_write, report as peers_report, run as peers


LLAMA_BENCH_JSON = json.dumps([
    {"build_commit": "0c1e57098", "build_number": 0, "n_threads": 2, "model_type": "llama 7B F16",
     "model_size": 13476831232, "n_prompt": 0, "n_gen": 4, "avg_ns": 40_000_000_000, "stddev_ns": 0,
     "samples_ns": [40_000_000_000], "avg_ts": 0.1}])


def test_parse_llama_bench_gives_ms_per_generated_token():
    r = peers_report.parse_llama_bench(LLAMA_BENCH_JSON)
    assert r["ms_per_token"] == pytest.approx(10_000.0) and r["tokens"] == 4
    assert r["build"].startswith("0c1e57098") and r["threads"] == 2
    with pytest.raises(ValueError, match="no token-generation test"):
        peers_report.parse_llama_bench(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ns": 1}]))


def test_parse_progress_keeps_the_tokens_of_an_unfinished_run():
    lines = [{"event": "load", "load_s": 3.0, "modules_disk": 20}, {"event": "token", "ms": 100.0},
             {"event": "token", "ms": 300.0}]
    r = peers_report.parse_progress("\n".join(json.dumps(e) for e in lines) + "\n")
    assert r["token_ms"] == [100.0, 300.0] and r["ms_per_token"] == 200.0 and r["tokens"] == 2
    assert r["modules_disk"] == 20 and not r["done"]
    done = peers_report.parse_progress(json.dumps({"event": "done", "rss_peak": 5}))
    assert done["done"] and "ms_per_token" not in done


@pytest.mark.parametrize("rc, timed_out, oom, expected", [
    (0, False, 0, "ran"), (-9, False, 1, "OOM-killed"), (137, False, None, "OOM-killed"),
    (-9, True, 0, "timeout"), (1, False, 0, "error"), (1, False, 2, "OOM-killed")])
def test_outcome(rc, timed_out, oom, expected):
    assert peers_report.outcome(rc, timed_out, oom) == expected


def test_summary_ratios_and_table():
    peers = peers_report
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
           "per round: 0.25–1.50 |" in text
    assert "| flashllm | ran, ran | 2,000 (1,000–3,000) | 7.00 | — |" in text
    assert "| accelerate | timeout (1 tokens) | 500 | — | 4.00 (flashllm 4.0× slower) |" in text
    assert peers.ratios([dict(peer="llama.cpp", label="l", ms_per_token=None)]) == {"l": {"ratio": None,
                                                                                        "per_round": []}}


def test_tiny_run_in_memory_groups_skips_missing_peers(tmp_path):
    model = make_model.main(["--shape", "tiny-llama", "--out", str(tmp_path / "m"), "--hf", "--quiet"])
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
        peers.main(argv)


def _group_or_skip():
    why = MemoryGroup.available()
    if why:
        pytest.skip(why)


def test_a_run_over_the_limit_is_oom_killed_and_its_group_removed(tmp_path):
    _group_or_skip()
    grow = "b = []\nwhile True: b.append(bytearray(1 << 20))"  # 1 MiB at a time, touched
    res = peers.run_child([sys.executable, "-c", grow], 64 << 20, [], 120, "flashllm-peers-test-oom",
                                   lambda m: None)
    assert res["outcome"] == "OOM-killed" and res["oom_kills"] >= 1 and res["cgroup_peak"] <= 64 << 20
    assert not Path(res["cgroup"]).exists()


def test_a_run_past_its_time_is_killed_as_timeout(tmp_path):
    _group_or_skip()
    res = peers.run_child(["sleep", "60"], 64 << 20, [], 1, "flashllm-peers-test-timeout", lambda m: None)
    assert res["outcome"] == "timeout" and res["wall_s"] < 30 and not Path(res["cgroup"]).exists()


def test_moe_model_runs_once_per_routing_with_budget_of_the_gguf(tmp_path):
    mm = make_model
    spec = dataclasses.replace(mm.spec_for("tiny-moe"), n_experts=16)  # the replayed trace routes 2 of 16
    model = mm.write_model(spec, tmp_path / "m", progress=False, shape_name="tiny-moe")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 400_000)  # only its size is used: llama-bench is not where --llama-cpp points
    report = peers.main(["--flashllm", str(model), "--gguf", str(gguf), "--budget-of", "gguf",
                                  "--dram-budget", "0.5", "--tokens", "2", "--warmup", "1", "--llama-cpp",
                                  str(tmp_path / "none"), "--peers", "flashllm,llama.cpp", "--quiet",
                                  "--moe-routing", "model,replay+prefetch,uniform", "--quantize-resident", "int4",
                                  "--markdown", str(tmp_path / "p.md"), "--timeout", "300"])
    assert report["dram_budget"] == 200_000 and report["top_k"] == 2
    fl = [r for r in report["runs"] if r["peer"] == "flashllm"]
    assert [r["routing"] for r in fl] == ["model", "replay+prefetch", "uniform"]
    assert all(r["outcome"] == "ran" and r["ms_per_token"] > 0 and 0 <= r["expert_hit_rate"] <= 1 for r in fl)
    assert [r["prefetch_recall"] is not None for r in fl] == [False, True, False]
    # the child's storage reads are counted: at least its expert reads (all of them hit the disk: cache dropped)
    assert all(r["storage_bytes_read"] >= r["bytes_read"] * r["tokens"] for r in fl)
    md = (tmp_path / "p.md").read_text()
    assert "(50% of the GGUF's" in md and "experts streamed, replayed routing, prefetch), resident int4" in md
    assert "uniform random routing" in md and "| expert cache hit rate | prefetch recall |" in md
    assert "computes only the top-2 experts" in md and "llama-bench 1 warm-up + 2 timed; random token ids" in md
    ra = peers.read_ahead_kb(gguf)
    assert report["read_ahead_kb"] == ra and (ra is None or f"disk read-ahead {ra} KiB" in md)


def test_cgroup_limit_is_the_groups_limit_and_the_budget_is_what_it_leaves(tmp_path):
    _group_or_skip()
    mm = make_model
    model = mm.write_model(mm.spec_for("tiny-moe"), tmp_path / "m", progress=False, shape_name="tiny-moe")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 4096)
    args = ["--flashllm", str(model), "--gguf", str(gguf), "--budget-of", "gguf", "--peers", "flashllm", "--quiet"]
    with pytest.raises(SystemExit, match="peers: error: --cgroup-limit 0.00 GB leaves no DRAM budget"):
        peers.main(args + ["--cgroup-limit", "0.5"])
    report = peers.main(args + ["--cgroup-limit", "1GiB", "--cgroup-slack", "64", "--moe-routing", "model",
                                         "--tokens", "1", "--warmup", "0", "--markdown", str(tmp_path / "p.md")])
    assert report["memory_limit"] == 1 << 30 and report["runs"][0]["cgroup_limit"] == 1 << 30
    assert report["dram_budget"] == (1 << 30) - report["baseline_rss"] - (64 << 20)
    assert report["runs"][0]["outcome"] == "ran" and report["runs"][0]["dram_bytes"] <= report["dram_budget"]
    assert "flashllm's DRAM budget" in (tmp_path / "p.md").read_text() and "= the limit less" in (tmp_path / "p.md").read_text()


def test_bad_moe_routing_and_budget_of_without_gguf_are_one_line_errors(tmp_path):
    with pytest.raises(SystemExit, match="peers: error: --moe-routing oracle"):
        peers.main(["--flashllm", str(tmp_path), "--moe-routing", "oracle"])
    with pytest.raises(SystemExit, match="peers: error: --moe-routing model[+]lookahead"):
        peers.main(["--flashllm", str(tmp_path), "--moe-routing", "replay,model+lookahead"])
    with pytest.raises(SystemExit, match="peers: error: --budget-of gguf needs --gguf"):
        peers.main(["--flashllm", str(tmp_path), "--budget-of", "gguf"])


def _llama_cpp_or_skip() -> Path:
    root = gguf_write.DEFAULT_LLAMA_CPP
    if not (root / "src" / "llama.cpp" / "gguf-py" / "gguf").is_dir():
        pytest.skip(f"no llama.cpp source at {root} (bench/build_llama_cpp.sh)")
    return root


def test_gguf_write_holds_the_moe_weights_llama_cpp_loads(tmp_path):
    root = _llama_cpp_or_skip()
    gw, mm = gguf_write, make_model
    spec = mm.spec_for("tiny-moe")
    out = gw.write(spec, tmp_path / "t.gguf", seed=3, llama_cpp=root, progress=False)
    gguf = gw.gguf_module(root)
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    q4, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == q4
    assert list(tensors["blk.1.ffn_down_exps.weight"].shape) == [spec.d_ffn, spec.d_model, spec.n_experts]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == f32
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type == f32
    assert len(tensors) == 3 + spec.n_layers * 12
    field = reader.get_field("qwen3moe.expert_count")
    assert field.parts[-1].tolist() == [spec.n_experts]
    assert len(reader.get_field("tokenizer.ggml.tokens").data) == spec.vocab_size
    # resident tensors are make_model's weights of that seed, Q4_0-quantized: within one step of a block
    weights = mm.RandomWeights(spec, "float16", 3)
    want = weights.stored("layers.1.q.weight", (spec.n_heads * spec.head_dim, spec.d_model))
    got = gguf.quants.dequantize(tensors["blk.1.attn_q.weight"].data, q4).reshape(want.shape)
    step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 8
    assert np.all(np.abs(got - want).reshape(-1, 32) <= step * 1.01 + 1e-6)
    assert not np.allclose(got, weights.stored("layers.0.q.weight", want.shape), atol=1e-3)
    bench_bin = root / "bin" / "llama-bench"
    if bench_bin.is_file():
        res = subprocess.run([str(bench_bin), "-m", str(out), "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-o", "json"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-500:]
        assert peers_report.parse_llama_bench(res.stdout)["model_type"].startswith("qwen3moe")


def test_gguf_write_refuses_dense_families(tmp_path):
    with pytest.raises(SystemExit, match="gguf_write: error: family 'llama'"):
        gguf_write.write(make_model.spec_for("tiny-llama"), tmp_path / "t.gguf")


def test_gguf_convert_of_a_shape_equals_the_conversion_of_its_hf_checkpoint(tmp_path):
    root = _llama_cpp_or_skip()
    gc = gguf_convert
    model = make_model.main(["--shape", "tiny-llama", "--out", str(tmp_path / "m"), "--hf", "--seed", "5",
                                      "--quiet"])
    a = gc.convert(model / "hf", tmp_path / "a.gguf", llama_cpp=root)
    b = gc.convert(None, tmp_path / "b.gguf", llama_cpp=root, shape="tiny-llama", seed=5)
    gguf = gguf_write.gguf_module(root)
    ta, tb = ({t.name: t for t in gguf.GGUFReader(p).tensors} for p in (a, b))
    assert sorted(ta) == sorted(tb) and len(ta) == 3 + 2 * 9
    assert all(ta[n].tensor_type == tb[n].tensor_type and np.array_equal(ta[n].data, tb[n].data) for n in ta)
    c = gc.convert(None, tmp_path / "c.gguf", llama_cpp=root, shape="tiny-llama", seed=6)
    tc = {t.name: t for t in gguf.GGUFReader(c).tensors}
    assert not np.array_equal(tc["blk.0.attn_q.weight"].data, tb["blk.0.attn_q.weight"].data)


def test_link_resident_reuses_the_same_bytes_and_refuses_another_seed(tmp_path):
    mm = make_model
    f16 = mm.main(["--shape", "tiny-llama", "--out", str(tmp_path / "a"), "--seed", "2", "--quiet"])
    written = mm.main(["--shape", "tiny-llama", "--out", str(tmp_path / "b"), "--seed", "2", "--quantize", "int4",
                       "--quiet"])
    linked = mm.main(["--shape", "tiny-llama", "--out", str(tmp_path / "c"), "--seed", "2", "--quantize", "int4",
                      "--link-resident", str(f16), "--quiet"])
    assert (linked / "resident.safetensors").stat().st_ino == (f16 / "resident.safetensors").stat().st_ino
    assert (linked / "resident.safetensors").read_bytes() == (written / "resident.safetensors").read_bytes()
    assert (linked / "ffn.bin").read_bytes() == (written / "ffn.bin").read_bytes()
    with pytest.raises(SystemExit, match="--link-resident .*seed 3"):
        mm.main(["--shape", "tiny-llama", "--out", str(tmp_path / "d"), "--seed", "3", "--link-resident", str(f16),
                 "--quiet"])


def test_llama_cpp_runs_once_per_read_ahead_and_the_setting_is_restored(tmp_path):
    model = make_model.main(["--shape", "tiny", "--out", str(tmp_path / "m"), "--quiet"])
    args = peers.setup_arg_parser().parse_args(["--flashllm", str(model), "--gguf", str(tmp_path / "m.gguf"),
                                                "--llama-config", "default,no-mmap", "--read-ahead-kb", "128,8192",
                                                "--peers", "llama.cpp", "--llama-cpp", str(tmp_path / "none")])
    runs = peers.plan(args, 1 << 20, tmp_path)
    assert [(r["label"], r["read_ahead_kb"]) for r in runs] == [
        ("llama.cpp (default, read-ahead 128 KiB)", 128), ("llama.cpp (default, read-ahead 8192 KiB)", 8192),
        ("llama.cpp (no-mmap, read-ahead 128 KiB)", 128), ("llama.cpp (no-mmap, read-ahead 8192 KiB)", 8192)]
    knob = tmp_path / "read_ahead_kb"  # stands in for sysfs
    knob.write_text("8192\n")
    with pytest.raises(RuntimeError):
        with peers.read_ahead(knob, 128):
            assert knob.read_text() == "128"
            raise RuntimeError("the run failed")
    assert knob.read_text() == "8192"  # restored whatever happened
    with peers.read_ahead(knob, None):  # no setting asked: untouched
        assert knob.read_text() == "8192"
