"""flashllm's benchmarks, one package run from the repository root: `python -m bench SUITE [COMMAND] [ARGS]`.

Each suite is a module (one command) or a subpackage (one module per command); docs/benchmarks.md says what
each measures and what it found. Results are appended to bench/results/<suite>.jsonl; `python -m bench report`
renders them as markdown.
"""

from __future__ import annotations

# suite -> module (a one-command suite) or {command: module}; the first command of a suite is listed first
SUITES: dict[str, str | dict[str, str]] = {
    "models": {"make": "bench.models.make_model", "corpus": "bench.models.stdlib_corpus",
               "trace": "bench.models.activation_trace", "routing": "bench.models.routing_trace",
               "train-dense": "bench.models.train_dense", "train-moe": "bench.models.train_moe"},
    "io": {"throughput": "bench.io.throughput", "pipeline": "bench.io.pipeline", "runtime": "bench.io.runtime",
           "lookahead": "bench.io.lookahead", "order": "bench.io.neuron_order",
           "reproducible": "bench.io.reproducible"},
    "compute": {"roofline": "bench.compute.roofline", "dtype": "bench.compute.dtype",
                "overhead": "bench.compute.cpu_overhead", "matvec-ab": "bench.compute.matvec_ab",
                "attention-ab": "bench.compute.attention_ab",
                "qkernels": "bench.compute.qkernels"},
    "quant": {"bytes": "bench.quant.flash_bytes", "quality": "bench.quant.quality", "error": "bench.quant.error",
              "compute": "bench.quant.compute", "resident": "bench.quant.resident",
              "load-peak": "bench.quant.load_peak", "table3": "bench.quant.table3"},
    "moe": {"run": "bench.moe.run", "quality": "bench.moe.quality", "kernels": "bench.moe.expert_kernels",
            "overhead": "bench.moe.overhead"},
    "peers": {"run": "bench.peers.run", "report": "bench.peers.report", "gguf": "bench.peers.gguf_convert",
              "gguf-moe": "bench.peers.gguf_write", "accelerate": "bench.peers.accelerate_decode"},
    "paper": {"tables": "bench.paper.tables", "all": "bench.paper.run", "overlap": "bench.paper.overlap"},
    "plan": "bench.plan",
    "batch": "bench.batch",
    "speculative": "bench.speculative",
    "sparsity": "bench.sparsity",
    "convert": "bench.convert",
}


def invocation(module: str) -> str:
    """`SUITE [COMMAND]` of a bench module, as typed after `python -m bench`."""
    for suite, entry in SUITES.items():
        if entry == module:
            return suite
        if isinstance(entry, dict):
            for command, mod in entry.items():
                if mod == module:
                    return f"{suite} {command}"
    raise KeyError(f"{module} is not a bench command")
