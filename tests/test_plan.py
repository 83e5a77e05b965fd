"""flashllm plan: the cache replay counts what the runtime's cache does, the MILP respects the budget,
a plan loads and runs within it, and per-layer cache rows given as an option are what the runtime uses."""

import shutil

import numpy as np
import pytest

import flashllm
from flashllm.format import manifest as fmt
from flashllm.planner import sparse as plan_sparse
from flashllm.planner import solver as planner
from flashllm.budget import parse_budget
from flashllm.planner.replay import replay
from flashllm.errors import FlashLLMError
from flashllm.planner.profile import MachineProfile
from tiny import write_random_predictors


class FakeDisk:
    measured_at = "test"

    def cost_model(self, inflight):
        return 1e-4 / min(inflight, 8), 1e9

    def gap_bytes(self, inflight):
        return 0


MACHINE = MachineProfile("test", "torch", "cpu", 1, 5e9, {}, {dt: {"per_call_s": 1e-5, "bytes_per_s": 5e9}
                                                              for dt in ("float32", "bfloat16", "float16")},
                         {"dense": 1e-4, "sparse": 2e-4, "predictor": 2e-5})


def test_replay_counts_loads_reads_and_drops():
    masks = [np.array([[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]], bool)]
    full = replay(masks, window=2, capacity=6, d_ffn=6)
    # loads: {0,1,3} (2 runs), {2} (1 run), {4,5} (1 run)
    assert full["loaded"] == pytest.approx(6 / 3) and full["reads"] == pytest.approx(4 / 3)
    assert full["drop_share"] == 0
    tight = replay(masks, window=2, capacity=3, d_ffn=6)
    assert tight["drop_share"] > 0  # the second token needs 4 rows
    # neurons 1 and 0 are hot: pinned at load, never read per token; loads {3}, {2}, {4,5}
    hot = replay(masks, window=2, capacity=5, d_ffn=6, hot=np.array([0.5, 0.9, 0, 0, 0, 0]))
    assert hot["pinned"] == 2 and hot["loaded"] == pytest.approx(4 / 3) and hot["drop_share"] == 0


@pytest.mark.parametrize("predictor,dtype", [("lowrank", None), ("lowrank", "bfloat16"), ("gate", None)])
def test_replay_counts_what_the_runtime_reads(tiny_models, tmp_path, predictor, dtype):
    """The replay of the runtime's own predicted sets, with the geometry probed from the loaded runtime,
    gives its reads, bytes and loads per decode token exactly (staging chunks, alignment, pinned hot
    neurons, a resident gate's up+down reads)."""
    from flashllm.planner import sparse as plan_sparse
    from flashllm.planner.replay import Replays

    family = "llama-relu" if predictor == "gate" else "opt"  # a gated ReLU FFN for the gate predictor
    model_dir = shutil.copytree(tiny_models(family).model_dir, tmp_path / family)
    write_random_predictors(model_dir, trained_for=fmt.read_manifest(model_dir).data["files"]["ffn"]["sha256"],
                            frequencies=True)
    spec = fmt.read_manifest(model_dir).spec
    rows = int(0.8 * spec.d_ffn)  # ~half the neurons per token: the window shrinks and evicts, nothing is dropped
    model = flashllm.load(model_dir, mode="sparse", predictor=predictor, dtype=dtype, context=64,
                          cache_rows=tuple([rows] * spec.n_layers), window=3, read_ahead=False)  # no lookahead reads
    facts = plan_sparse.probe(model)
    assert facts.predictor == predictor and facts.capacities == [rows] * spec.n_layers
    masks = [[] for _ in range(spec.n_layers)]
    with model.hooks.observing("predict", lambda layer, mask: masks[layer].append(mask[0].copy())):
        model.logits(list(range(3, 23)), prefill=1)  # one token at a time: every token decodes
    replays = Replays([[np.array(m)] for m in masks], spec.d_ffn, facts.geometry, facts.hot)
    runtime = model.token_stats
    per_token = {k: float(np.mean([t[k] for t in runtime])) for k in ("reads", "bytes_read", "neurons_dropped")}
    assert per_token["neurons_dropped"] == 0  # (a drop keeps the highest-scored neurons; the replay has no scores)
    assert sum(replays.at(l, 3, rows)["pinned"] for l in range(spec.n_layers)) > 0
    assert sum(replays.at(l, 3, rows)["reads"] for l in range(spec.n_layers)) == pytest.approx(per_token["reads"])
    assert sum(replays.at(l, 3, rows)["bytes"] for l in range(spec.n_layers)) == pytest.approx(per_token["bytes_read"])


def test_milp_picks_cheapest_within_memory():
    # one layer, one window: capacity 10 costs 1.0 s, capacity 20 costs 0.5 s; row 100 bytes
    curves = [{4: [{"capacity": 10}, {"capacity": 20}]}]
    costs = [{4: [1.0, 0.5]}]
    assert plan_sparse.solve(costs, curves, 100, 2000)[1] == [20]
    assert plan_sparse.solve(costs, curves, 100, 1500)[1] == [10]
    assert plan_sparse.solve(costs, curves, 100, 500) is None


@pytest.fixture(autouse=True)
def short_calibration(monkeypatch):
    monkeypatch.setattr(planner, "CALIBRATE_SECONDS", 0.0)  # the tokens asked for, once (keeps the tests fast)


@pytest.fixture(scope="module")
def planned_model(tiny_models, tmp_path_factory):
    out = shutil.copytree(tiny_models("opt").model_dir, tmp_path_factory.mktemp("plan") / "opt")
    write_random_predictors(out, trained_for=fmt.read_manifest(out).data["files"]["ffn"]["sha256"])
    (out.parent / "sample.txt").write_text("def main(): return sum(x * x for x in range(10))\n" * 40)
    return out


def test_plan_fits_its_budget_and_runs(planned_model):
    budget = "345KiB"  # between what sparse (252 KiB + rows for a token's set) and hybrid or dense (366 KiB) need at context 64
    plan = planner.make_plan(planned_model, budget, MACHINE, FakeDisk(), data=planned_model.parent / "sample.txt",
                             context=64, sample_tokens=128)
    assert plan.mode in ("sparse", "hybrid")
    assert plan.predicted["total_ms"] > 0
    parts = ("compute_ms", "predictor_ms", "io_ms", "mem_ms")
    assert abs(sum(plan.predicted[k] for k in parts) - plan.predicted["total_ms"]) < 1e-6
    model = flashllm.load(planned_model, context=64, **plan.load_options())  # fits: load checks the budget
    model.logits([1, 5, 9, 12, 3], prefill=2)
    assert model.stats["dram_bytes"] <= flashllm.budget.budget_bytes(budget, model.model_bytes)
    if plan.mode == "sparse":
        assert model.stats["cache_capacity"] == plan.cache_rows
    path = planner.save_plan(planned_model, plan)
    assert planner.saved_plan(planned_model) == plan and path.name == planner.PLAN_FILE


def test_calibration_reproduces_its_measurement_and_scales_terms():
    from flashllm.planner.calibration import Measured, calibrate

    m = Measured(total_ms=100.0, compute_ms=40.0, ffn_ms=10.0, predictor_ms=5.0, io_ms=50.0, mem_ms=5.0,
                 bytes_read=1e6, reads=10, spread=0.08, tokens=8)
    cal = calibrate(m, model_ffn_s=0.02, model_io_s=0.025, model_mem_s=0.0)
    here = cal.apply(0.02, 0.025, 0.0)
    assert here.total_s * 1e3 == pytest.approx(m.total_ms)  # the reference point is predicted as measured
    there = cal.apply(0.04, 0.0125, 0.0)  # twice the FFN, half the I/O of the model's terms
    assert there.to_ms()["compute_ms"] == pytest.approx(30 + 20) and there.io_s * 1e3 == pytest.approx(25)
    assert there.mem_s * 1e3 == pytest.approx(5.0) and cal.noise == 0.08  # a term the model puts at 0 stays as measured
    # reads measured slower or faster than the cost model stand as measured, unless faster than the disk's best
    # measured rate (then a cache served them): 1e6 bytes in 50 ms is 19 MiB/s
    assert calibrate(m, 0.02, 0.1, 0.0).apply(0.02, 0.1, 0.0).io_s == pytest.approx(0.05)
    slow_disk = FakeDisk()
    slow_disk.mibps = [[5.0, 10.0]]  # 1e6 bytes take 95 ms at its best
    assert calibrate(m, 0.02, 0.1, 0.0, disk=slow_disk).apply(0.02, 0.1, 0.0).io_s == pytest.approx(1e6 / 10 / 2**20)
    assert calibrate(m, 0.02, 0.025, 0.0, min_noise=0.1).noise == 0.1


def test_calibrated_plan_keeps_defaults_unless_the_gain_beats_the_noise(planned_model):
    plan = planner.make_plan(planned_model, "345KiB", MACHINE, FakeDisk(), data=planned_model.parent / "sample.txt",
                             context=64, sample_tokens=128, calibrate_tokens=6)
    assert plan.predicted.get("calibrated") and "model_ms" in plan.predicted
    noise = float(next(n for n in plan.notes if n.startswith("calibrated")).split("noise")[1].split("%")[0].split()[-1])
    default = next((a for a in plan.alternatives if "runtime default" in a["what"]), None)
    if default is not None:  # the plan is not the defaults: it must be predicted faster by more than the noise
        assert plan.predicted["total_ms"] < default["total_ms"] * (1 - noise / 100)


def test_cache_rows_option_is_checked(planned_model):
    spec = fmt.read_manifest(planned_model).spec
    model = flashllm.load(planned_model, mode="sparse", cache_rows=tuple([7] * spec.n_layers), context=64)
    assert model.stats["cache_capacity"] == [7] * spec.n_layers
    with pytest.raises(FlashLLMError, match="cache_rows: 1 values"):
        flashllm.load(planned_model, mode="sparse", cache_rows=(7,), context=64)
    with pytest.raises(FlashLLMError, match="budget leaves"):
        flashllm.load(planned_model, mode="sparse", cache_rows=tuple([spec.d_ffn] * spec.n_layers), context=64,
                      dram_budget="345KiB")


@pytest.mark.parametrize("mode", ["dense", "hybrid", "naive"])
def test_cache_rows_outside_sparse_mode_is_an_error_naming_the_option(planned_model, capsys, mode):
    from flashllm.cli.main import main

    capsys.readouterr()
    assert main(["generate", str(planned_model), "--prompt", "def", "--max-new-tokens", "1", "--mode", mode,
                 "--cache-rows", "7,7"]) == 1
    err = capsys.readouterr().err
    assert "--cache-rows" in err and f"mode {mode!r} has none" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def cached_profiles(planned_model, tmp_path, monkeypatch):
    """This machine's profiles as if measured before: fake numbers in a private cache."""
    from flashllm.io import disk_profile
    from flashllm.planner import profile

    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path / "cache"))
    profile.save(MACHINE)
    disk_profile.save(disk_profile.DiskProfile(disk_profile.disk_key(planned_model), "test", "t", True, [4096, 1 << 20],
                                               [1, 32], [[10.0, 200.0], [40.0, 800.0]], [100.0, 1000.0]))


def test_plan_cli_and_plan_auto(planned_model, cached_profiles, capsys):
    import json

    from flashllm.cli.main import main

    (planned_model / planner.PLAN_FILE).unlink(missing_ok=True)
    capsys.readouterr()
    assert main(["plan", str(planned_model), "--dram-budget", "345KiB", "--context", "64", "--json", "--data",
                 str(planned_model.parent / "sample.txt"), "--sample-tokens", "128"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"] in ("sparse", "hybrid") and plan["predicted"]["total_ms"] > 0
    assert (planned_model / planner.PLAN_FILE).is_file()
    # --plan auto reuses the saved plan made for this budget and context
    code = main(["generate", str(planned_model), "--prompt", "def main", "--max-new-tokens", "3", "--plan", "auto",
                 "--dram-budget", "345KiB", "--context", "64", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    stats = json.loads(out.out)["stats"]
    assert stats["mode"] == plan["mode"]
    if plan["mode"] == "sparse":
        assert stats["cache_capacity"] == plan["cache_rows"] and stats["window"] == plan["window"]
    assert "plan:" not in out.err  # nothing planned anew


def test_plan_errors_are_one_line(planned_model, cached_profiles, capsys, recwarn):
    import json

    from flashllm.cli.main import main

    meta_file = planned_model / "predictors.json"
    saved = meta_file.read_text()
    meta = json.loads(saved)  # a predicted set that the caches at the runtime's least budget cannot hold
    for layer in meta["layers"]:
        layer["predicted_fraction"] = 0.5
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    try:
        assert main(["plan", str(planned_model), "--dram-budget", "20KiB", "--context", "64", "--quiet",
                     "--sample-tokens", "64"]) == 1
    finally:
        meta_file.write_text(saved)
    err = capsys.readouterr().err
    assert err.startswith("flashllm: error:") and "nothing fits" in err and len(err.strip().splitlines()) == 1
    assert "--dtypes float32,bfloat16" in err and "a smaller --context" in err
    # nothing loads at 20 KiB, but dropping predicted neurons lowers what sparse mode needs: --max-dropped is named
    # with the least budget sparse mode loads at, below the smallest budget of a plan that drops nothing
    loads_from = err.split("--max-dropped SHARE (sparse mode loads from --dram-budget ")[1].split(",")[0]
    # the runtime's warning about the plan's own load at its least budget (not the user's) is not shown
    assert not [w for w in recwarn if "--dram-budget" in str(w.message)], [str(w.message) for w in recwarn]
    smallest = err.split("the smallest budget that works is --dram-budget ")[1].split()[0]  # names a budget that works
    assert parse_budget(loads_from) < parse_budget(smallest)
    assert main(["plan", str(planned_model), "--dram-budget", smallest, "--context", "64", "--quiet",
                 "--sample-tokens", "64", "--calibrate-tokens", "0"]) == 0


def test_plan_auto_at_another_context_says_whether_it_uses_the_saved_plan(planned_model, cached_profiles, capsys):
    """A plan made for --context 32 serves --plan auto at a smaller context (its KV cache only shrinks) and
    says so; at a larger one a line says the saved plan is not used, and why, before planning again."""
    import json

    from flashllm.cli.main import main

    (planned_model / planner.PLAN_FILE).unlink(missing_ok=True)
    assert main(["plan", str(planned_model), "--dram-budget", "345KiB", "--context", "32", "--json", "--data",
                 str(planned_model.parent / "sample.txt"), "--sample-tokens", "128"]) == 0
    plan = json.loads(capsys.readouterr().out)
    path = planned_model / planner.PLAN_FILE
    run = ["generate", str(planned_model), "--prompt", "def main", "--max-new-tokens", "2", "--plan", "auto",
           "--dram-budget", "345KiB", "--json", "--context"]
    assert main(run + ["16"]) == 0
    out = capsys.readouterr()
    assert out.err == f"flashllm: --plan auto: using {path}, made for --context 32, at --context 16 (a smaller " \
                      f"KV cache: it still fits its budget)\n", out.err
    stats = json.loads(out.out)["stats"]
    assert stats["mode"] == plan["mode"] and (plan["mode"] != "sparse" or stats["cache_capacity"] == plan["cache_rows"])
    assert main(run + ["64"]) == 0  # planned again, for the tiny model's whole context
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"flashllm: --plan auto: {path} was made for --context 32, not 64 (too little room for this KV " \
                     f"cache): planning again for --context 64, which replaces it (`flashllm plan {planned_model} " \
                     f"--context 64` with your other plan options to choose them)", err


def test_plan_auto_that_finds_nothing_says_how_to_plan_over_more(planned_model, cached_profiles, capsys):
    """generate has no --dtypes/--max-dropped: a --plan auto refusal points to `flashllm plan`, which has them."""
    from flashllm.cli.main import main

    (planned_model / planner.PLAN_FILE).unlink(missing_ok=True)
    capsys.readouterr()
    assert main(["generate", str(planned_model), "--prompt", "def main", "--max-new-tokens", "2", "--plan", "auto",
                 "--dram-budget", "20KiB", "--context", "64"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the planner's progress lines
    assert err.startswith("flashllm: error: --plan auto: ") and "nothing fits" in err, err
    assert f"`flashllm plan {planned_model}` with the same --dram-budget" in err


def test_a_budget_that_only_fits_by_dropping_says_so_and_max_dropped_plans_it(planned_model):
    """At sparse mode's smallest budget (one cache row per layer) every token drops predicted neurons: the
    refusal names --max-dropped, and with it the plan is made."""
    from flashllm.budget import BudgetTooSmall

    with pytest.raises(BudgetTooSmall) as small:
        flashllm.load(planned_model, mode="sparse", predictor="lowrank", dram_budget="20KiB", context=64)
    least = small.value.needed
    kw = dict(data=planned_model.parent / "sample.txt", context=64, sample_tokens=64, calibrate_tokens=0)
    with pytest.raises(FlashLLMError, match="nothing fits") as refused:
        planner.make_plan(planned_model, least, MACHINE, FakeDisk(), **kw)
    assert "--max-dropped SHARE" in str(refused.value)
    plan = planner.make_plan(planned_model, least, MACHINE, FakeDisk(), max_dropped=1.0, **kw)
    assert plan.mode == "sparse" and plan.predicted["dropped_share"] > 0


def test_plan_output_carries_no_warnings_meant_for_generate(planned_model, cached_profiles, capsys, recwarn):
    """Calibrating sparse mode at a budget whose caches drop predicted neurons: the runtime's warnings (which
    advise generate's --on-overflow and a budget for the runtime's default caches) stay out of plan's output;
    the plan says it in its own notes."""
    import json

    from flashllm.budget import BudgetTooSmall
    from flashllm.cli.main import main
    from flashllm.errors import DroppedNeuronsWarning

    with pytest.raises(BudgetTooSmall) as small:
        flashllm.load(planned_model, mode="sparse", predictor="lowrank", dram_budget="20KiB", context=64)
    capsys.readouterr()
    assert main(["plan", str(planned_model), "--dram-budget", str(small.value.needed), "--context", "64",
                 "--max-dropped", "0.99", "--calibrate-tokens", "6", "--sample-tokens", "64", "--json",
                 "--data", str(planned_model.parent / "sample.txt")]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "--on-overflow" not in err, err
    assert not [w for w in recwarn if issubclass(w.category, DroppedNeuronsWarning)], [str(w.message) for w in recwarn]
    notes = json.loads(out)["notes"]
    assert any("could not hold every predicted neuron on" in n and "calibration tokens" in n for n in notes), notes


def test_plan_weighs_the_gate_predictor_against_lowrank(tiny_models, tmp_path):
    """A gated FFN with a sparse activation can run the low-rank predictors or its resident gate rows: the
    plan costs both (the gate's rows charged to the budget, its reads up and down rows only) and the
    cheaper prediction wins."""
    from flashllm.planner import sparse as plan_sparse

    model_dir = shutil.copytree(tiny_models("llama-relu").model_dir, tmp_path / "llama-relu")
    write_random_predictors(model_dir, trained_for=fmt.read_manifest(model_dir).data["files"]["ffn"]["sha256"])
    (tmp_path / "sample.txt").write_text("def main(): return sum(x * x for x in range(10))\n" * 40)
    assert planner.predictor_choices(fmt.read_manifest(model_dir)) == ["lowrank", "gate"]
    spec = fmt.read_manifest(model_dir).spec
    gate = plan_sparse.probe(flashllm.load(model_dir, mode="sparse", predictor="gate", dram_budget="400KiB", context=64))
    lowrank = plan_sparse.probe(flashllm.load(model_dir, mode="sparse", predictor="lowrank", dram_budget="400KiB", context=64))
    assert gate.predictor_bytes == spec.n_layers * spec.d_ffn * spec.d_model * 4 and gate.ranks is None
    assert gate.fixed - lowrank.fixed == gate.predictor_bytes - lowrank.predictor_bytes  # charged to the budget
    assert gate.geometry.layout.parts == ("up", "down") and gate.row < lowrank.row
    plan = planner.make_plan(model_dir, "400KiB", MACHINE, FakeDisk(), data=tmp_path / "sample.txt", context=64,
                             sample_tokens=64, calibrate_tokens=0)
    costed = [(plan.to_dict()["predictor"] if plan.mode == "sparse" else plan.mode, plan.predicted["total_ms"])]
    costed += [(a["what"], a["total_ms"]) for a in plan.alternatives]
    assert any("gate predictor" in w for w, _ in costed[1:]) or plan.predictor == "gate"
    assert any("lowrank predictor" in w for w, _ in costed[1:]) or plan.predictor == "lowrank"
    assert costed[0][1] == min(ms for _, ms in costed)  # no calibration, no noise: the cheapest prediction
    model = flashllm.load(model_dir, context=64, **plan.load_options())
    assert model.stats.get("predictor", plan.predictor) == plan.predictor


def test_plan_of_a_directory_that_is_no_model_fails_before_profiling(tmp_path, capsys, monkeypatch):
    """`flashllm plan DIR` on a directory that holds no model says so at once, without measuring the machine first
    (that takes minutes where no profile is cached)."""
    from flashllm.io import disk_profile
    from flashllm.planner import profile
    from flashllm.cli.main import main

    def measured(*a, **k):
        raise AssertionError("the machine was profiled before the directory was checked")

    monkeypatch.setattr(profile, "profile", measured)
    monkeypatch.setattr(disk_profile, "profile", measured)
    (tmp_path / "notes.txt").write_text("not a model")
    capsys.readouterr()
    assert main(["plan", str(tmp_path), "--dram-budget", "50%", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashllm: error:") and "not a flashllm model directory" in err and err.count("\n") == 1


def test_plan_of_a_read_only_model_directory_is_printed_and_said_unsaved(planned_model, cached_profiles, capsys,
                                                                          monkeypatch):
    """`flashllm plan` where plan.json cannot be written (a read-only model directory): the plan is printed as
    usual and one warning line says it was not saved, instead of a traceback."""
    from flashllm.cli.main import main

    def read_only(model_dir, plan):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(planner, "save_plan", read_only)
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match=r"plan.json not saved \(Permission denied\); `--plan auto` plans again"):
        code = main(["plan", str(planned_model), "--dram-budget", "345KiB", "--context", "64", "--data",
                     str(planned_model.parent / "sample.txt"), "--sample-tokens", "128", "--calibrate-tokens", "0",
                     "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("plan: ") and "Traceback" not in err, err
