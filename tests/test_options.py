"""Load options: one dataclass for API and CLI, the budget syntax, agreeing defaults, helpful errors."""

import dataclasses
import re

import pytest

import flashllm
from flashllm.budget import GiB, MiB, parse_budget
from flashllm.cli.args import load_options
from flashllm.cli.main import build_parser, main
from flashllm.modes.registry import MODES
from flashllm.options import LoadOptions


@pytest.mark.parametrize("text, value", [
    ("0.5", 0.5), ("1", 1.0), ("50%", 0.5), ("100%", 1.0), ("6GiB", 6 * GiB), ("700MiB", 700 * MiB),
    ("20M", 20 * MiB), ("1.5GB", 1_500_000_000), ("6e9", 6_000_000_000), ("123456", 123456), (" 2 gib ", 2 * GiB),
])
def test_budget_forms(text, value):
    parsed = parse_budget(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["1.5", "100", "abc", "0", "-1", "0%", "150%", "5 parsecs", "", "2KB", "nan"])
def test_budget_nonsense_is_an_error(text):
    with pytest.raises(flashllm.FlashLLMError, match="budget"):
        parse_budget(text)


def test_cli_rejects_a_bad_budget_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "somewhere", "--prompt", "x", "--dram-budget", "1.5"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "1.5" in err and "byte count" in err and "Traceback" not in err


def test_api_and_cli_defaults_agree():
    args = build_parser().parse_args(["generate", "m", "--prompt", "x"])
    assert load_options(args) == LoadOptions()
    assert LoadOptions().dram_budget is None and LoadOptions().gpu_budget is None  # unlimited in both


def test_cli_options_cover_load_options_with_help():
    gen = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    actions = {a.dest: a for a in gen._actions}
    for field in dataclasses.fields(LoadOptions):
        if field.name == "verify":  # `inspect --verify` checks everything; load verifies FFN layers on first read
            continue
        if field.name == "expert_routing":  # a Python function (benchmarks replay routing traces through it)
            continue
        if field.name == "read_ahead_precision":  # a tuning knob of the measured default (tests, benchmarks)
            continue
        assert field.name in actions, field.name
        assert actions[field.name].help and "default" in actions[field.name].help, field.name
    assert list(actions["mode"].choices) == list(MODES)
    args = build_parser().parse_args(["generate", "m", "--prompt", "x", "--mode", "sparse", "--dram-budget", "40%",
                                      "--window", "2", "--on-overflow", "error"])
    assert load_options(args) == LoadOptions(mode="sparse", dram_budget=0.4, window=2, on_overflow="error")


def test_options_are_validated_and_frozen():
    with pytest.raises(flashllm.FlashLLMError, match="mode"):
        LoadOptions(mode="turbo")
    with pytest.raises(flashllm.FlashLLMError, match="window"):
        LoadOptions(window=0)
    with pytest.raises(flashllm.FlashLLMError, match="unknown load option"):
        LoadOptions.of(dram_budgett=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoadOptions().mode = "sparse"
    assert LoadOptions(dram_budget="6GiB").dram_budget == 6 * GiB


@pytest.mark.parametrize("mode", ["dense", "naive", "hybrid", "sparse"])
def test_budget_too_small_names_the_smallest_budget_that_works(tiny_models, mode):
    """The Python API's error names the API's keywords (a caller of load() has no --flags)."""
    tiny = tiny_models("llama-relu")  # stored in float32: a 2-byte compute dtype would halve what is resident
    with pytest.raises(flashllm.FlashLLMError, match="too small") as exc:
        flashllm.load(tiny.model_dir, mode=mode, predictor="oracle", dram_budget=0.05)
    message = str(exc.value)
    assert message.startswith("dram_budget='") and "dtype='bfloat16' (halves" in message, message
    assert "--" not in message, message
    smallest = re.search(r"smallest budget that works here is dram_budget='([^']+)'", message).group(1)
    model = flashllm.load(tiny.model_dir, mode=mode, predictor="oracle", dram_budget=smallest)
    assert model.dram_bytes() <= model.dram_budget


def test_cli_budget_too_small_names_flags_in_one_line(tiny_models, capsys):
    """The same error from the CLI names its flags, in the text it has always had."""
    tiny = tiny_models("llama-relu")
    capsys.readouterr()
    assert main(["generate", str(tiny.model_dir), "--prompt", "x", "--mode", "sparse", "--predictor", "oracle",
                 "--dram-budget", "5%"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.match(r"flashllm: error: --dram-budget \S+ is too small: .+ need \S+; the smallest budget that works "
                    r"here is --dram-budget \S+ \(\d+% of the model\); lower it with --dtype bfloat16 \(halves "
                    r"resident weights and caches\) or .*--quantize-resident int4 \(", err), err
    assert "dram_budget=" not in err and "dtype=" not in err


def test_gpu_budget_off_a_gpu_is_refused_not_ignored(tiny_models, capsys):
    """A GPU budget on a CPU run would bound nothing: one line naming the option (API keyword, CLI flag)."""
    tiny = tiny_models("llama-relu")
    with pytest.raises(flashllm.FlashLLMError) as exc:
        flashllm.load(tiny.model_dir, gpu_budget=0.5)
    assert str(exc.value).startswith("gpu_budget sizes CUDA device memory, but this model runs on the CPU")
    assert "device='cuda'" in str(exc.value)
    capsys.readouterr()
    assert main(["generate", str(tiny.model_dir), "--prompt", "x", "--gpu-budget", "50%"]) == 1
    err = capsys.readouterr().err
    assert err == ("flashllm: error: --gpu-budget sizes CUDA device memory, but this model runs on the CPU, where "
                   "--dram-budget bounds all memory; drop --gpu-budget, or run on a GPU with --device cuda\n"), err


def test_budget_above_the_model_is_named_as_a_size_the_parser_accepts(tiny_models, capsys):
    """Dense float32 with its KV cache needs more than the model's own size: the smallest budget is given as
    a size (a percentage above 100% is refused by the budget parser), and the message says no share fits."""
    tiny = tiny_models("llama-relu")
    with pytest.raises(flashllm.FlashLLMError, match="too small") as exc:
        flashllm.load(tiny.model_dir, mode="dense", dram_budget=1.0)
    message = str(exc.value)
    assert exc.value.needed > flashllm.load(tiny.model_dir).model_bytes
    assert not re.search(r"\d+%", message), message  # no percentage a user could pass back
    assert "fit in no share of the model (no fraction or percentage works, only a size)" in message
    smallest = re.search(r"smallest budget that works here is dram_budget='([^']+)'", message).group(1)
    assert flashllm.load(tiny.model_dir, mode="dense", dram_budget=smallest).dram_budget >= exc.value.needed
    capsys.readouterr()
    assert main(["generate", str(tiny.model_dir), "--prompt", "x", "--mode", "dense", "--dram-budget", "100%"]) == 1
    err = capsys.readouterr().err
    smallest = re.search(r"smallest budget that works here is --dram-budget (\S+),", err).group(1)
    parse_budget(smallest)  # a form the parser accepts
    with pytest.raises(flashllm.FlashLLMError, match="give a larger budget as a size"):
        parse_budget("130%")


def test_dropped_neurons_warning_names_options_as_the_caller_passes_them(tiny_models, recwarn):
    """The once-per-model warning about predicted neurons the caches could not hold: API keywords in Python,
    flags in the CLI's one-line form."""
    from flashllm.cli import console
    from flashllm.errors import DroppedNeuronsWarning

    tiny = tiny_models("llama-relu")
    n_layers = flashllm.load(tiny.model_dir).spec.n_layers
    model = flashllm.load(tiny.model_dir, mode="sparse", predictor="oracle", cache_rows=(2,) * n_layers, context=64)
    model.logits(list(range(3, 13)), prefill=1)
    dropped = [w.message for w in recwarn if issubclass(w.category, DroppedNeuronsWarning)]
    assert len(dropped) == 1, [str(w.message) for w in recwarn]  # once per loaded model
    assert "raise dram_budget, or on_overflow='error' to refuse" in str(dropped[0]) and "--" not in str(dropped[0])
    line = console.one_line_warning(dropped[0], DroppedNeuronsWarning, "x.py", 1)
    assert line.startswith("flashllm: warning: the neuron caches could not hold every predicted neuron: ")
    assert "raise --dram-budget, or --on-overflow error to refuse" in line and line.count("\n") == 1


def test_registries_hold_exactly_the_names_options_own():
    """options.py owns the names of modes, expert policies and predictors; each registry builds exactly those."""
    from flashllm import options
    from flashllm.modes.experts import ExpertCache
    from flashllm.modes.moe import MOE_MODES
    from flashllm.modes.sparse.predictor import PREDICTORS

    assert tuple(MODES) == options.MODES and set(MOE_MODES) <= set(options.MODES)
    assert set(PREDICTORS) | {"auto"} == set(options.PREDICTORS)
    for policy in options.EXPERT_POLICIES:  # every policy name builds a cache
        ExpertCache(2, 4, 1, policy)
