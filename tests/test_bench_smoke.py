"""The paper benchmarks run end to end on the tiny shape: make_model, trace record, paper_tables --json."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flashllm
from flashllm.format import manifest as fmt

from bench import sparsity
from bench.compute import attention_ab, cpu_overhead, matvec_ab, roofline
from bench.io import runtime as io_runtime
from bench.models import activation_trace, make_model, routing_trace
from bench.moe import expert_kernels, quality as moe_quality, run as moe_run
from bench.paper import measure as paper_measure, tables as paper_tables


@pytest.fixture(scope="module")
def tiny_random(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out = make_model.main(["--shape", "tiny", "--out", str(root / "tiny"), "--dtype", "float32", "--quiet"])
    return root, out


def test_make_model_writes_the_shape_and_the_same_weights_unbundled(tiny_random):
    root, out = tiny_random
    mm = make_model
    m = fmt.read_manifest(out, verify=True)
    assert m.spec == mm.spec_for("tiny") and m.layout.bundled
    header = m.data["files"]["resident"]["size"] + m.data["files"]["ffn"]["size"] - mm.model_bytes(m.spec, 4)
    assert 0 < header < 1 << 16  # all tensors of the shape, plus the safetensors header
    nb = mm.main(["--shape", "tiny", "--out", str(root / "tiny-nb"), "--dtype", "float32", "--no-bundle", "--quiet"])
    assert not fmt.read_manifest(nb).layout.bundled
    ids = [5, 9, 17, 33, 2, 64]
    np.testing.assert_array_equal(flashllm.load(nb).logits(ids), flashllm.load(out).logits(ids))
    assert not list(root.glob(".*partial*"))  # written atomically: no leftovers


def test_make_model_hf_checkpoint_converts_to_the_same_files(tmp_path):
    from flashllm.converters import convert

    out = make_model.main(["--shape", "tiny-llama", "--out", str(tmp_path / "m"), "--hf", "--quiet"])
    conv = convert(out / "hf", tmp_path / "conv", progress=False)
    a, b = (fmt.read_manifest(d).data["files"] for d in (out, conv))
    assert a["ffn"]["sha256"] == b["ffn"]["sha256"] and a["resident"]["sha256"] == b["resident"]["sha256"]


def test_trace_record_and_replay_preserve_frequencies(tiny_random, tiny_models, tmp_path):
    tr = activation_trace
    text = tmp_path / "heldout.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    meta = tr.main(["record", str(tiny_models("opt").model_dir), "--data", str(text), "--out",
                    str(tmp_path / "t.npz"), "--tokens", "40", "--seq-len", "20", "--json"])
    assert meta["predictor"] == "oracle" and meta["tokens"] == 40 and meta["summary"]["recall"] == [1.0, 1.0]
    trace = tr.Trace.load(tmp_path / "t.npz")
    assert trace.predicted.shape == (2, 40, 128)
    spec = fmt.read_manifest(tiny_random[1]).spec  # 8 layers, FFN 512: a "bigger" model
    pred = tr.TracePredictor(trace, spec, seed=3)
    x = np.zeros((1, spec.d_model), dtype=np.float32)
    first = np.concatenate([pred.predict(layer, x) for layer in range(spec.n_layers)])  # trace token 0
    assert first.shape == (8, 512) and first.dtype == bool
    assert pred.layers == [0, 0, 0, 0, 1, 1, 1, 1]
    counts = np.bincount(pred.neurons[5], minlength=128)
    assert counts.min() == counts.max() == 4  # every small neuron followed by 4 large ones
    replay = np.stack([np.concatenate([pred.predict(layer, x) for layer in range(8)]) for _ in range(39)])
    # token t of layer 5 is small layer 1's token t, through the neuron map: same frequencies and reuse
    small = trace.predicted[1, 1:40]
    np.testing.assert_array_equal(replay[:, 5], small[:, pred.neurons[5]])
    # an imperfect lookahead (small layer 1 measured as: needed neurons scored 1..3, 0.6 others per needed
    # neuron above cut -1 and 0.3 above 0, none above 2; layer 0: none)
    grid = [-1.0, 0.0, 2.0]
    layer1 = {"needed_quantiles": [1.0, 3.0], "recall": [1.0, 1.0, 0.5], "named_per_needed": [1.6, 1.3, 0.5]}
    with pytest.raises(ValueError, match="3 layers for a trace of 2"):
        tr.TracePredictor(trace, spec, seed=3, lookahead={"grid": grid, "layers": [None, layer1, layer1]})
    pred = tr.TracePredictor(trace, spec, seed=3, lookahead={"grid": grid, "layers": [None, layer1]})
    exact = [pred.predict(layer, x) for layer in range(8)]
    assert pred.scores(5, x) is None  # a replayed set has no scores
    pred.t0, pred.early = 0, True  # the same token's lookahead guesses
    scores = [pred.scores(layer, x)[0] for layer in range(1, 8)]
    for e, sc in zip(exact[4:], scores[3:]):  # layers 4-7 follow small layer 1
        e = e[0]
        assert ((sc[e] >= 1) & (sc[e] <= 3)).all()  # needed neurons: from their quantiles
        wrong_0, wrong_m1 = ((sc > 0) & ~e).sum() / e.sum(), ((sc > -1) & ~e).sum() / e.sum()
        assert 0.2 < wrong_0 < 0.4 and 0.5 < wrong_m1 < 0.7 and not ((sc > 2) & ~e).any()
        assert (pred.predict(5, x)[0] == (pred.scores(5, x)[0] > 0)).sum() > 0


def test_paper_tables_json(tiny_random, capsys):
    root, out = tiny_random
    report = paper_tables.main([
        str(out), "--dram-budget", "0.5", "--tokens", "3", "--warmup", "2", "--naive-tokens", "2",
        "--hybrid-tokens", "2", "--fig7-windows", "1,4", "--fig8-tokens", "6", "--predictor-rank", "8",
        "--threads", "4", "--torch-threads", "1", "--work-dir", str(root), "--json", "--quiet"])
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) >= {"table2", "table3", "fig7", "fig8", "meta", "ratios"}
    assert [r["config"] for r in printed["table2"]] == ["naive", "hybrid", "hybrid+predictor", "+windowing",
                                                        "+bundling"]
    t3 = {r["config"]: r for r in printed["table3"]}
    assert list(t3) == ["naive", "hybrid", "all"]
    for r in t3.values():
        assert set(r) >= {"io_ms", "mem_ms", "compute_ms", "total_ms", "flash_gb_per_token", "dram_gb"}
        assert r["total_ms"] > 0 and r["io_ms"] > 0 and r["dram_gb"] > 0  # every config reads from flash
    assert t3["all"]["flash_gb_per_token"] < t3["hybrid"]["flash_gb_per_token"] < t3["naive"]["flash_gb_per_token"]
    budget = report["meta"]["budget_gb"]
    assert all(r["dram_allocated_gb"] <= budget * 1.0001 for r in printed["table2"])
    t2 = {r["config"]: r for r in printed["table2"]}
    assert t2["+bundling"]["reads_per_token"] < t2["+windowing"]["reads_per_token"]  # one read per neuron, not two
    assert [r["window"] for r in printed["fig7"]] == [1, 4]
    assert len(printed["fig8"]) == 6 and all((r["io_ms"] > 0) == (r["flash_gb"] > 0) for r in printed["fig8"])
    assert printed["fig8"][0]["flash_gb"] > 0  # the first token finds an empty cache
    assert printed["ratios"]["naive/all"]["flash_bytes"] > 1
    assert not (root / "tiny-unbundled").exists()  # the unbundled copy it wrote is deleted


def test_moe_run_reports_each_policy_and_removes_its_model(tmp_path):
    report = moe_run.main(["--shape", "tiny-moe", "--work", str(tmp_path), "--budget", "0.6", "--dtype",
                                    "float32", "--tokens", "3", "--policies", "lru", "--no-cgroup", "--json"])
    assert [r["label"] for r in report["runs"]] == ["model: lru", "model: lru + prefetch", "uniform: lru",
                                                    "uniform: lru + prefetch"]
    assert all("error" not in r and 0 <= r["expert_hit_rate"] <= 1 for r in report["runs"])
    assert report["slots"] < report["n_experts"] and report["runs"][1]["expert_read_ahead_recall"] is not None
    assert not (tmp_path / "tiny-moe").exists()


def test_moe_expert_kernels_times_each_way_to_hold_an_int4_expert():
    rows = expert_kernels.main(["--shape", "tiny-moe", "--group", "32", "--rounds", "2", "--threads", "1"])
    assert {r["case"] for r in rows} == {"dequantize at each use", "int4 kernel, use", "int4 kernel, insert",
                                         "int4 kernel, insert, other CPU's packing",
                                         "dequantized slot, use", "dequantized slot, insert"}
    assert all(r["median_ms"] >= r["min_ms"] > 0 and r["cpu_ms"] > 0 for r in rows)


def test_moe_expert_kernels_times_mlx_affine_slots_against_dequantized():
    pytest.importorskip("mlx.core")
    rows = expert_kernels.main(["--shape", "tiny-moe", "--group", "32", "--rounds", "2", "--backend",
                                             "mlx", "--bits", "8"])
    assert {r["case"] for r in rows} == {"MLX affine slot (int8), use", "MLX affine slot (int8), insert",
                                         "dequantized slot (float32), use", "dequantized slot (float32), insert"}
    assert all(r["median_ms"] >= r["min_ms"] > 0 for r in rows)


def test_moe_quality_bench_compares_quantized_experts_with_float32(tiny_models, tmp_path):
    from tiny import TEXT

    text = tmp_path / "text.txt"
    text.write_text(" ".join(np.random.default_rng(0).choice(TEXT.split(), 400)) + "\n")
    out = moe_quality.main(["--model", str(tiny_models("qwen3_moe").ckpt), "--data", str(text), "--group", "32",
                                     "--max-tokens", "96", "--seq-len", "32", "--gen-tokens", "8", "--prompt-tokens", "8",
                                     "--budget-tokens", "16", "--context", "64", "--budget", "1.5",
                                     "--out", str(tmp_path / "q.md")])
    rows = out["rows"]
    assert rows[0]["label"] == "float32" and rows[0]["top1_agreement"] == 1.0 and "slots" not in rows[0]
    for r in rows[1:]:
        assert r["budget_max_logit_diff"] < 1e-3 and r["slots"] >= 1  # streamed = dense at the budget
    assert rows[3]["expert_slots"] == "int4 kernel layout (repacked on insert)"
    assert rows[4]["expert_slots"] != rows[3]["expert_slots"]
    assert "| float32 |" in (tmp_path / "q.md").read_text()


def test_silu_sparsity_bench_runs_and_writes_its_table(tiny_models, tmp_path, capsys):
    from tiny import TEXT

    text = tmp_path / "text.txt"
    text.write_text(" ".join(np.random.default_rng(0).choice(TEXT.split(), 1200)) + "\n")
    sparsity.main([str(tiny_models("llama").ckpt), "--calib", str(text), "--heldout", str(text),
                                 "--sparsity", "0.4", "--rank", "4", "--max-tokens", "400", "--eval-tokens", "64",
                                 "--gen-tokens", "4", "--dram-budget", "none,1.0", "--out", str(tmp_path / "silu")])
    rows = json.loads((tmp_path / "silu.json").read_text())["rows"]
    assert [(p["dram_budget"], p["predictor"]) for p in rows[0]["points"]] == \
        [(b, p) for b in (None, 1.0) for p in ("oracle", "gate", "lowrank")]
    points = {p["predictor"]: p for p in rows[0]["points"] if p["dram_budget"] is None}
    assert points["oracle"]["ppl_sparse"] == pytest.approx(points["gate"]["ppl_sparse"], rel=1e-4)  # both exact
    assert points["gate"]["predictor_bytes"] > points["lowrank"]["predictor_bytes"] > 0 == points["oracle"]["predictor_bytes"]
    text = (tmp_path / "silu.md").read_text()
    assert "| unlimited | 0.4 |" in text and "| 1 | 0.4 |" in text


def test_moe_trace_replay_maps_small_routing_onto_a_bigger_moe():
    mt = routing_trace
    rng = np.random.default_rng(0)
    routed = np.stack([np.stack([rng.choice(16, 2, replace=False) for _ in range(50)]) for _ in range(4)])
    trace = {"routed": routed, "guessed": routed[:, ::-1].copy(), "meta": {"n_experts": 16}}
    replay = mt.ReplayRouting(trace, n_layers=8, n_experts=128, top_k=8)
    first = replay(5, np.zeros((3, 128)), False)  # layer 5 follows small layer 1, shifted one block
    assert first.shape == (3, 8) and all(len(set(row)) == 8 for row in first)
    small = routed[1, [mt.SHIFT % 50 + t for t in range(3)]]
    np.testing.assert_array_equal(first, replay.big_ids(5, small))
    guess = replay(5, np.zeros((1, 128)), True)  # the next token's recorded guess; the cursor does not move
    np.testing.assert_array_equal(guess, replay.big_ids(5, trace["guessed"][1, [(3 + mt.SHIFT) % 50]]))
    assert replay.cursor[5] == 3
    # a token's two small experts become four fixed big experts each: reuse is preserved
    assert set(replay.big_ids(0, routed[0, :1])[0]) == set(replay.big_ids(0, routed[0, :1][:, ::-1])[0])
    st = mt.stats(trace)
    assert len(st["layers"]) == 4 and st["random_reuse"] == pytest.approx(1 - (14 / 16) ** 4, abs=1e-4)
    with pytest.raises(ValueError, match="cannot replay top-2 of 16 onto top-3 of 128"):
        mt.ReplayRouting(trace, 8, 128, 3)


def test_trace_coactivation_order_moves_neurons_and_keeps_copies_apart(tiny_random, tiny_models, tmp_path, capsys):
    tr = activation_trace
    text = tmp_path / "heldout.txt"
    text.write_text("def f(x):\n    return [x * 2 for _ in range(3)]\n" * 40)
    tr.main(["record", str(tiny_models("opt").model_dir), "--data", str(text), "--out", str(tmp_path / "t.npz"),
             "--tokens", "40", "--seq-len", "20", "--json"])
    spec = fmt.read_manifest(tiny_random[1]).spec  # 8 layers, FFN 512, from 2 small layers of 128
    plain = tr.TracePredictor(tmp_path / "t.npz", spec, seed=3)
    ordered = tr.TracePredictor(tmp_path / "t.npz", spec, seed=3, order="coactivation", window=4)
    assert ordered.order["calibration_tokens"] == 20
    for a, b in zip(plain.neurons, ordered.neurons):
        np.testing.assert_array_equal(np.sort(a), np.sort(b))  # the same neurons, at other positions
        assert not np.array_equal(a, b)
        pos = np.argsort(b, kind="stable").reshape(128, 4)  # each small neuron's 4 copies, by position
        assert (np.diff(pos, axis=1) == 128).all()  # one copy per block of 128: never side by side
    replay = io_runtime.replay_reads(tmp_path / "t.npz", spec, 3, 4, 20)
    assert replay["tokens"] == 20
    for g in ("0", "1", "8"):  # gap-filling reads through: fewer reads, more bundles
        assert replay["none"][g]["reads"] <= replay["none"]["0"]["bundles"] <= replay["none"][g]["bundles"]
    assert replay["none"]["0"]["bundles"] == replay["coactivation"]["0"]["bundles"] > 0  # same loads, moved
    runs = {}  # and the runtime replaying it in either order (bench/compute/roofline.py --order)
    for order in ("none", "coactivation"):
        capsys.readouterr()
        roofline.main([str(tiny_random[1]), "--trace", str(tmp_path / "t.npz"),
                                        "--order", order, "--configs", "2t-no-read-ahead", "--rounds", "1",
                                        "--tokens", "2", "--warmup", "1", "--roofline-rounds", "0", "--beside-rounds",
                                        "0", "--no-paired", "--json"])
        runs[order] = json.loads(capsys.readouterr().out)
    assert runs["coactivation"]["meta"]["mode_desc"].endswith("from the trace in coactivation order")
    plain, ordered = (runs[o]["runs"][0] for o in ("none", "coactivation"))
    assert ordered["read_bytes"] == plain["read_bytes"] > 0  # the same rows, in fewer reads
    assert 0 < ordered["reads"] < plain["reads"]
    assert all(isinstance(t["faults"], int) for t in plain["per_token"])


def test_paper_measure_records_read_sizes_and_lookahead(tiny_random):
    pm = paper_measure
    run = dict(label="t", mode="sparse", window=2, bundled=True, backend="torch", budget="60%", threads=4,
               seed=0, tokens=3, warmup=1, model_dir=str(tiny_random[1]), read_sizes=True, read_ahead=True)
    out = pm.measure(run)
    sizes = {int(b): c for b, c in out["read_sizes"].items()}
    assert sum(sizes.values()) == pytest.approx(out["reads"]) and out["reads"] > 0  # every read, by size
    assert sum(b * c for b, c in sizes.items()) <= out["bytes_read"] + 1e-6
    assert min(sizes) >= fmt.read_manifest(tiny_random[1]).layout.stride  # whole bundles or runs of them
    assert out["read_ahead"] == "into cache rows" and out["read_ahead_rows"] == 0 and 0 <= out["read_ahead_recall"] <= 1
    assert out["cpu_ms"] > 0 and out["io_cpu_ms"] > 0  # the process's CPU per token, and its reader threads'


def test_make_model_layers_cuts_the_shape_to_its_first_layers(tmp_path):
    mm = make_model
    out = mm.main(["--shape", "tiny-moe", "--layers", "1", "--out", str(tmp_path / "m"), "--quiet"])
    spec = fmt.read_manifest(out).spec
    assert spec.n_layers == 1 and spec.n_experts == mm.spec_for("tiny-moe").n_experts
    with pytest.raises(SystemExit, match="make_model: error: --layers 3: expected 1 to 2"):
        mm.main(["--shape", "tiny-moe", "--layers", "3", "--out", str(tmp_path / "n"), "--quiet"])


def test_cpu_overhead_times_the_runtime_functions_per_token(tiny_random, tiny_models, tmp_path):
    """bench/compute/cpu_overhead.py: a child per (checkout, config) wraps the runtime's per-token functions and
    reports their calls, wall and CPU per token beside the token's io/mem/compute split."""
    text = tmp_path / "heldout.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    activation_trace.main(["record", str(tiny_models("opt").model_dir), "--data", str(text), "--out",
                         str(tmp_path / "t.npz"), "--tokens", "20", "--seq-len", "20", "--json"])
    out = tmp_path / "r.json"
    cpu_overhead.main([str(tiny_random[1]), "--trace", str(tmp_path / "t.npz"), "--dram-budget", "0.9", "--predictor-rank", "0",
                                "--context", "32", "--configs", "default,inline", "--tokens", "2", "--warmup", "1",
                                "--json-out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"] for r in runs] == ["default", "inline"]
    for r in runs:
        calls = {name: p[0] for name, p in r["probes"].items()}
        assert calls["SparseMode.ffn"] == 8 and calls["NeuronCache.evict"] == 8  # 8 layers, once per token
        assert r["compute_ms"] == pytest.approx(r["total_ms"] - r["io_ms"] - r["mem_ms"] - r["predictor_ms"])
        assert r["other_ms"] == pytest.approx(r["compute_ms"] - r["math_ms"])


def test_matvec_ab_builds_two_revisions_and_times_them_side_by_side(capsys):
    """bench/compute/matvec_ab.py: the native kernels of two git revisions built apart, timed on the same weights."""
    import shutil
    import subprocess
    from pathlib import Path

    from flashllm.backends import native

    root = Path(__file__).resolve().parents[1]
    if native.library() is None or shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs the native kernels and a git checkout")
    assert matvec_ab.main(["--base", "HEAD", "--head", "HEAD", "--shapes", "64x256", "--rounds", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[64, 256]")]
    assert [line.split(" ")[2] for line in lines] == ["1", "2"]  # one line per thread count
    assert all("base/head time" in line for line in lines)


def test_attention_ab_builds_two_revisions_and_times_them_cold_and_warm(capsys):
    """bench/compute/attention_ab.py: two revisions' attention kernels, each position timed cold and warm; bad positions
    are refused."""
    import shutil
    import subprocess
    from pathlib import Path

    from flashllm.backends import native

    root = Path(__file__).resolve().parents[1]
    if native.library() is None or shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs the native kernels and a git checkout")
    small = ["--base", "HEAD", "--head", "HEAD", "--context", "16", "--layers", "2", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "32", "--flush", "64x256", "--rounds", "1"]
    assert attention_ab.main([*small, "--positions", "3", "15"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " keys, " in line]
    assert [line.split(",")[0] for line in lines] == ["4 keys", "4 keys", "16 keys", "16 keys"]
    assert [line.split(",")[1].split(":")[0].strip() for line in lines] == ["cold", "warm"] * 2
    with pytest.raises(SystemExit) as refused:
        attention_ab.main([*small, "--positions", "16"])
    assert refused.value.code == 2 and "--positions must lie in 0..15" in capsys.readouterr().err
