"""`flashllm inspect`: validate a model directory and describe it (thin CLI over flashllm/format/manifest.py)."""

from __future__ import annotations

import json

from flashllm.cli.args import add_model_dir


def add_parser(sub) -> None:
    i = sub.add_parser("inspect", help="describe a model directory", description="Validate a model directory "
                       "(sizes; checksums of the files load checks, up to 256 MiB each, or of all with --verify) and "
                       "describe it.")
    add_model_dir(i)
    i.add_argument("--verify", action="store_true", help="checksum every file (reads the whole model) "
                   "(default: off)")
    i.add_argument("--json", action="store_true", help="print one JSON object (default: off)")
    i.set_defaults(func=command)


def command(args) -> None:
    from flashllm.format import manifest as fmt
    from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_META, verify_predictor_files
    from flashllm.modes.sparse.activation_sparsity import read_sparsity

    manifest = fmt.read_manifest(args.model_dir, verify=True if args.verify else None)  # None: what load checks
    sparsity = read_sparsity(manifest)
    data = manifest.data
    sizes = {key: entry["size"] for key, entry in data["files"].items()}
    trained = {name: path.stat().st_size for name in (PREDICTOR_META, PREDICTOR_FILE)
               if (path := manifest.root / name).is_file()}
    if trained:  # trained beside the model: listed, and checked as a sparse load with them checks them (in full)
        verify_predictor_files(manifest)
    sizes.update(trained)
    info = {"model_dir": str(manifest.root), "format_version": data["format_version"], "dtype": data["dtype"],
            "quantization": data.get("quantization", "none"), **({"quantization_params": data["ffn"]["quantization"]}
                                                                  if manifest.layout.quant else {}),
            "spec": data["spec"], "files": sizes, "bundle_bytes": manifest.layout.bundle_bytes,
            "bundle_stride": manifest.layout.stride, "checksums_verified": "all" if args.verify else
            f"files up to {fmt.VERIFY_AUTO_LIMIT >> 20} MiB" + (f", {PREDICTOR_FILE}" if trained else ""),
            "neuron_order": data.get("neuron_order"), "source": data.get("source"),
            **({"activation_sparsity": sparsity.to_stats()} if sparsity else {})}
    if args.json:
        print(json.dumps(info))
        return
    s = manifest.spec
    print(f"{manifest.root}: {s.family}, {s.n_layers} layers, d_model {s.d_model}, FFN {s.d_ffn} "
          f"({s.activation}{', gated' if s.gated_ffn else ''}), heads {s.n_heads}/{s.n_kv_heads} kv, "
          f"vocab {s.vocab_size}, context {s.context_limit}, {data['dtype']}")
    if s.is_moe:
        print(f"experts: {s.n_experts} of {s.d_ffn} neurons, top-{s.top_k} per token"
              f"{f', shared expert of {s.d_shared_expert}' if s.d_shared_expert else ''}")
    q = manifest.layout.quant
    print(f"bundle: {'+'.join(manifest.layout.parts)} = {manifest.layout.bundle_bytes} bytes, "
          f"stride {manifest.layout.stride}" + (f", {q.name} {q.scheme} groups of {q.group_size}" if q else ""))
    for key, size in sizes.items():
        print(f"  {data['files'][key]['path'] if key in data['files'] else key:<28} {size / 2**20:10.2f} MiB")
    print("checksums verified: " + info["checksums_verified"])
    print(describe_source(data.get("source") or {}))
    if not s.is_moe:
        print(describe_order(info["neuron_order"], manifest.root))
    if sparsity:
        print(sparsity.describe(s.activation))


def describe_source(source: dict) -> str:
    """inspect's line on what the model was converted from (an HF checkpoint or a GGUF file, and the Hub repo)."""
    if not source:
        return "converted from: (not recorded)"
    kind = "GGUF file" if source.get("format") == "gguf" else "HF checkpoint"
    what = ", ".join(str(x) for x in (source.get("architecture") or source.get("model_type"), source.get("file_type"),
                                      source.get("name")) if x)
    repo = f" = {source['repo']}@{source.get('revision', 'main')}" if source.get("repo") else ""
    line = f"converted from: {kind} {source.get('path', '?')}{repo}" + (f" ({what})" if what else "")
    exact = (source.get("conversion") or {}).get("exact") or {}
    if exact:
        line += "; FFN blocks kept exactly: " + ", ".join(f"{n:,} {q} values" for q, n in sorted(exact.items()))
    return line


def describe_order(order: dict | None, root) -> str:
    """inspect's line on how ffn.bin orders each layer's neurons (fewer reads per sparse token when neurons
    loaded together are neighbours), and how to order it where it is not."""
    if not order:
        return (f"FFN neuron order: as converted (`flashllm predictors order {root} --data TEXT` stores neurons "
                "loaded on the same token side by side: fewer reads per sparse token)")
    how = order.get("source", "")
    if "tokens" in order:
        how = f"{order['tokens']} tokens of {order.get('data', '?')}, {how}"
    if "runs_per_token_before" in order:
        how += (f"; reads per token there {order['runs_per_token_before']} -> {order['runs_per_token_after']} "
                "(no gap filling)")
    return f"FFN neuron order: {order.get('method', '?')} ({how})"
