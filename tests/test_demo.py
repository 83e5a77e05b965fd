"""`flashllm demo` on the embedded model: shipped predictors match it and the JSON has its keys."""

import json

from flashllm.cli import main


def test_demo_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    assert main(["demo", "--json", "--max-new-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_dir"] == str(tmp_path / "tiny-opt") and out["text"]
    sparse, naive = out["stats"]["sparse"], out["stats"]["naive"]
    assert sparse["predictor"] == "lowrank" and sparse["mode"] == "sparse" and naive["mode"] == "naive"
    assert sparse["dram_bytes"] <= sparse["dram_budget"] <= 0.5 * sparse["model_bytes"]
    assert 0 < sparse["bytes_read"] < naive["bytes_read"]
