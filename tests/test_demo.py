"""`flashllm demo` on the embedded model: shipped predictors match it and the JSON has its keys."""

import json
import warnings
from pathlib import Path

import pytest

from flashllm.cli.main import main


def test_demo_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    assert main(["demo", "--json", "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_dir"] == str(tmp_path / "tiny-opt") and out["text"]
    sparse, naive = out["stats"]["sparse"], out["stats"]["naive"]
    assert sparse["predictor"] == "lowrank" and sparse["mode"] == "sparse" and naive["mode"] == "naive"
    assert sparse["dram_bytes"] <= sparse["dram_budget"] <= 0.5 * sparse["model_bytes"]
    assert 0 < sparse["bytes_read"] < naive["bytes_read"]


@pytest.mark.parametrize("variant", ["", "--moe", "--swiglu"])
def test_demo_runs_on_mlx(tmp_path, monkeypatch, capsys, variant):
    """`--backend mlx`: every model of the demo on MLX (Metal on a Mac; its CPU build here), named in the report."""
    pytest.importorskip("mlx.core")
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    args, moe = ["demo", "--backend", "mlx", *([variant] if variant else [])], variant == "--moe"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SwiGLU model announces its thresholds (test_demo_swiglu_json)
        assert main(args + ["--json", "--max-new-tokens", "4"]) == 0
        out = json.loads(capsys.readouterr().out)
        sparse, other = out["stats"]["sparse"], out["stats"]["dense" if moe else "naive"]
        assert sparse["backend"] == other["backend"] == "mlx" and len(out["token_ids"]) == 4
        assert 0 < sparse["bytes_read"] and sparse["dram_bytes"] <= sparse["dram_budget"]
        assert out["same_as_dense"] if moe else sparse["bytes_read"] < other["bytes_read"]
        assert main(args + ["--max-new-tokens", "2"]) == 0
    assert "computed " + ("on mlx" if moe else "in bfloat16 on mlx") in capsys.readouterr().out.splitlines()[0]


def test_report_says_slower_when_sparse_is_slower():
    from flashllm.cli.demo import report

    def stats(total_ms, bytes_read):
        return {"bytes_read": bytes_read, "reads": 1, "io_ms": 1.0, "total_ms": total_ms, "dram_bytes": 1 << 20,
                "model_bytes": 2 << 20, "dram_budget": 1 << 20, "backend": "torch"}

    result = {"model_dir": "m", "prompt": "p", "text": "t", "stats": {"sparse": stats(60.0, 1000),
                                                                       "naive": stats(50.0, 12000)}}
    last = report(result).splitlines()[-1]
    assert last == "sparse vs naive: flash bytes 12.00x fewer; latency 1.20x slower"
    result["stats"]["sparse"] = stats(25.0, 24000)
    assert report(result).splitlines()[-1] == "sparse vs naive: flash bytes 2.00x more; latency 2.00x faster"
    result["stats"]["sparse"].update(neurons_dropped=12.5, dropped_mass_share=0.031)
    lines = report(result).splitlines()
    assert lines[-3].split() == ["neurons", "dropped", "/", "token", "12.50", "0.00"]
    assert lines[-1].startswith("note: sparse mode dropped 12.5 predicted neurons per decode token (3.1% of the "
                                "predicted score mass): the demo's 50% budget holds fewer")
    assert "flashllm predictors eval m --data TEXT --dtype bfloat16 --context 256 --dram-budget 50%" in lines[-1]


def test_demo_moe_json(tmp_path, monkeypatch, capsys):
    """The embedded MoE streams its experts at half its size and generates what dense mode generates."""
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    assert main(["demo", "--moe", "--json", "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    model_dir = Path(out["model_dir"])
    assert model_dir.parent == tmp_path and model_dir.name.startswith("tiny-moe-") and len(out["token_ids"]) >= 1
    sparse, dense = out["stats"]["sparse"], out["stats"]["dense"]
    assert out["same_as_dense"] and sparse["predictor"] == "router" and dense["mode"] == "dense"
    assert sparse["dram_bytes"] <= sparse["dram_budget"] <= 0.5 * sparse["model_bytes"] < dense["dram_bytes"]
    assert max(sparse["cache_capacity"]) < 16 and sparse["bytes_read"] > 0 and dense["bytes_read"] == 0


def test_demo_swiglu_json(tmp_path, monkeypatch, capsys):
    """The embedded SwiGLU model runs sparse through its shipped thresholds, with the gate rows resident."""
    from flashllm.cli.demo import dropped_note
    from flashllm.errors import DroppedNeuronsWarning

    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["demo", "--swiglu", "--json", "--max-new-tokens", "6"]) == 0
    assert not [w for w in caught if issubclass(w.category, DroppedNeuronsWarning)]  # the note below instead
    captured = capsys.readouterr()
    out, err = json.loads(captured.out), captured.err
    assert out["model_dir"] == str(tmp_path / "tiny-swiglu") and out["text"]
    sparse, naive = out["stats"]["sparse"], out["stats"]["naive"]
    assert sparse["predictor"] == "gate" and sparse["activation_sparsity"] and naive["mode"] == "naive"
    assert sparse["dram_bytes"] <= sparse["dram_budget"] <= 0.5 * sparse["model_bytes"]
    assert 0 < sparse["bytes_read"] < naive["bytes_read"]
    # its caches cannot hold every predicted neuron at 50%: said once, with the demo's own advice (the runtime's
    # warning names --dram-budget and --on-overflow, which `demo` does not take)
    assert sparse["neurons_dropped"] > 0
    warned = [line for line in err.splitlines() if "dropped" in line]
    assert warned == [f"flashllm: warning: {dropped_note(out)}"], err
    assert "--on-overflow" not in err and f"flashllm predictors eval {out['model_dir']} --data TEXT" in err


def test_demo_model_is_prepared_in_the_shipped_neuron_order(tmp_path):
    """The demo's directory holds the shipped co-activation order (recorded in its manifest): the same
    function as the converter's order, fewer reads per token; a directory in another order is redone."""
    import numpy as np

    import flashllm
    from flashllm.cli import demo
    from flashllm.format import manifest as fmt

    ordered, plain = demo.prepare(tmp_path / "ordered"), demo.prepare(tmp_path / "plain", order=False)
    sha = fmt.read_manifest(ordered).data["neuron_order"]["shipped_sha256"]
    assert sha and "neuron_order" not in fmt.read_manifest(plain).data
    ids = [2, 100, 7, 42, 9, 300]
    dense = [flashllm.load(d, mode="dense", **demo.SETTINGS).logits(ids, prefill=2) for d in (ordered, plain)]
    np.testing.assert_allclose(dense[0], dense[1], rtol=0, atol=0.05)
    reads = []
    for d in (ordered, plain):
        m = flashllm.load(d, mode="sparse", predictor="lowrank", dram_budget=0.5, **demo.SETTINGS)
        list(m.generate_ids(m.tokenizer.encode(demo.PROMPT), 12))
        reads.append(m.stats["reads"])
    assert reads[0] < 0.9 * reads[1]
    assert demo.prepare(plain) == plain and fmt.read_manifest(plain).data["neuron_order"]["shipped_sha256"] == sha


@pytest.mark.parametrize("variant", [[], ["--moe"], ["--swiglu"]])
@pytest.mark.parametrize("tokens", ["0", "1"])
def test_demo_needs_a_decode_token_to_compare(capsys, variant, tokens):
    """0 or 1 new tokens leave no decode token: one clear line (it crashed on --moe, and printed ratios of
    zeros otherwise), before anything is converted."""
    from flashllm.cli.main import main

    assert main(["demo", "--max-new-tokens", tokens, *variant]) == 1
    err = capsys.readouterr().err
    assert err == f"flashllm: error: --max-new-tokens {tokens}: the demo compares decode tokens, so it needs at " \
                  "least 2 (the first new token comes from the prompt)\n"


def test_readme_python_snippet_runs_on_the_embedded_model(tmp_path, monkeypatch, capsys):
    """The README's first Python block, run as written (the demo's settings stated in it: the float32
    embedded model needs a 2-byte compute dtype to fit half its size), with "./model" the embedded model."""
    import re

    import flashllm
    from flashllm.cli import demo

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert 'flashllm.load("./model"' in snippet
    model_dir, load = demo.prepare(tmp_path / "tiny-opt"), flashllm.load
    monkeypatch.setattr(flashllm, "load", lambda path, **kw: load(model_dir if path == "./model" else path, **kw))
    exec(compile(snippet, "README.md", "exec"), {})
    assert "bytes_read" in capsys.readouterr().out
