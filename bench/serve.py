"""`flashllm serve` under load: N clients x M streamed completions, continuous batching against one at a time.

For each mode (dense; sparse at 50% of the model) two servers run the embedded model side by side, with
the same settings but `--max-batch B` and `--max-batch 1`. Before the load, every prompt is sent alone
(one request at a time) to each server: those texts are the reference. Then, for each client count
(1, 4, 16, alternating between the two servers), each client sends M streamed requests one after another
(temperature 0, `stream_options.include_usage`) through the official openai client with its default
retries (2, with backoff). Reported per server and client count: aggregate completion tokens/s over the
wall time, p50/p95 request latency, p50/p95 time to first token, failed requests (after retries), texts
equal to the prompt's alone text, and the server's RSS before and after the load.

    flock /tmp/flashllm-bench.lock python -m bench serve [--clients 1,4,16] [--requests 6] [--tokens 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.batch import text_prompts
from bench.harness import command_line

MODES = {"dense": ["--mode", "dense", "--dtype", "bfloat16", "--context", "64"],
         # 16 KV caches fit the 50% budget at context 64 with int8 KV (the batch's caches count against it)
         "sparse": ["--mode", "sparse", "--dram-budget", "50%", "--dtype", "bfloat16", "--context", "64",
                    "--kv-bits", "8"]}


class Server:
    """`flashllm serve` in a subprocess on a free loopback port."""

    def __init__(self, model_dir: Path, args: list[str], log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "serve", str(model_dir), "--port", "0",
                                      "--model-name", "m", *args], stderr=subprocess.PIPE, stdout=self.log, text=True)
        banner = self.proc.stderr.readline()
        found = re.search(r":(\d+)/v1", banner)
        if not found:
            raise SystemExit(f"bench serve: the server did not start: {banner}{self.proc.stderr.read()[-2000:]}")
        self.port = int(found.group(1))
        threading.Thread(target=lambda: [self.log.write(line) for line in self.proc.stderr], daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.wait_ready()

    def wait_ready(self) -> None:
        import urllib.request

        for _ in range(600):
            try:
                with urllib.request.urlopen(self.url.replace("/v1", "/health"), timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("bench serve: the server did not answer /health")

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc.stderr.close()
        self.log.close()


def one_request(client, prompt: str, tokens: int) -> dict:
    """Stream one completion: its text, completion tokens, latency and time to first token (or its error)."""
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    try:
        for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 (a failed request is a result here, whatever its kind)
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": usage or 0, "latency": end - t0, "ttft": (first or end) - t0}


def run_level(server: Server, prompts: list[str], clients: int, requests: int, tokens: int) -> dict:
    """`clients` clients, each sending `requests` streamed completions one after another."""
    import openai

    def client_run(i: int) -> list[tuple[str, dict]]:
        client = openai.OpenAI(base_url=server.url, api_key="none", timeout=300)  # default retries: 2
        return [(p, one_request(client, p, tokens))
                for p in (prompts[(i * requests + j) % len(prompts)] for j in range(requests))]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client_run, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    ok = [(p, r) for p, r in done if "error" not in r]
    lat, ttft = [r["latency"] for _, r in ok], [r["ttft"] for _, r in ok]
    return {"clients": clients, "requests": len(done), "failed": len(done) - len(ok),
            "errors": sorted({r["error"] for _, r in done if "error" in r})[:3],
            "tokens": sum(r["tokens"] for _, r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for _, r in ok) / wall,
            "p50_s": float(np.percentile(lat, 50)) if lat else None, "p95_s": float(np.percentile(lat, 95)) if lat else None,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p95_s": float(np.percentile(ttft, 95)) if ttft else None, "texts": ok}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,16", help="client counts (default 1,4,16)")
    p.add_argument("--requests", type=int, default=6, help="streamed requests per client (default 6)")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--max-batch", type=int, default=16, help="the batching server's --max-batch (default 16)")
    p.add_argument("--modes", default="dense,sparse", help="modes (default dense,sparse)")
    args = p.parse_args(argv)
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SystemExit("bench serve needs the openai client (its default retries are part of the test): "
                         "pip install openai") from None
    from flashllm.embedded import prepare

    load_start = os.getloadavg()[0]
    model_dir = prepare()
    import flashllm

    tok = flashllm.load(model_dir).tokenizer
    prompts = [t for t in text_prompts(64) if len(tok.encode(t)) <= 64 - args.tokens - 4][:16]
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashllm-serve-bench-") as tmp:
        for mode in args.modes.split(","):
            servers = {b: Server(model_dir, MODES[mode] + ["--max-batch", str(b)], Path(tmp) / f"{mode}-{b}.log")
                       for b in (args.max_batch, 1)}
            try:
                alone = {b: {q: one_request(openai_client(s), q, args.tokens).get("text") for q in prompts}
                         for b, s in servers.items()}
                rss0 = {b: s.rss() for b, s in servers.items()}
                for clients in levels:
                    for b, s in servers.items():
                        r = run_level(s, prompts, clients, args.requests, args.tokens)
                        r["same_as_alone"] = sum(text["text"] == alone[b][q] for q, text in r.pop("texts"))
                        rows.append({"mode": mode, "max_batch": b, **r})
                        print(row_text(rows[-1]), file=sys.stderr, flush=True)
                for row in rows:
                    if row["mode"] == mode:
                        row["rss_before"], row["rss_after"] = rss0[row["max_batch"]], servers[row["max_batch"]].rss()
                cross = sum(alone[args.max_batch][q] == alone[1][q] for q in prompts)
                rows.append({"mode": mode, "alone_texts_equal_across_servers": cross, "prompts": len(prompts)})
            finally:
                for s in servers.values():
                    s.stop()
    result = {"command": command_line("bench.serve", argv), "rows": rows, "load_start": load_start,
              "load_end": os.getloadavg()[0], "speedup": speedups(rows, args.max_batch)}
    print(table(result))
    return result


def openai_client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="none", timeout=300)


def speedups(rows: list[dict], batch: int) -> dict:
    """Aggregate tokens/s with batching over one at a time, per mode and client count."""
    by = {(r["mode"], r["max_batch"], r["clients"]): r["tokens_per_s"] for r in rows if "clients" in r}
    return {f"{m} x{c}": by[m, batch, c] / by[m, 1, c] for (m, b, c) in by if b == batch and by.get((m, 1, c))}


def row_text(r: dict) -> str:
    def s(x):
        return "-" if x is None else f"{x:.2f}"

    return (f"| {r['mode']} | {r['max_batch']} | {r['clients']} | {r['requests']} | {r['failed']} | "
            f"{r['tokens_per_s']:.1f} | {s(r['p50_s'])} / {s(r['p95_s'])} | {s(r['ttft_p50_s'])} / {s(r['ttft_p95_s'])} | "
            f"{r['same_as_alone']}/{r['requests'] - r['failed']} |")


def table(result: dict) -> str:
    lines = ["| mode | --max-batch | clients | requests | failed | tokens/s | latency p50 / p95 (s) | "
             "first token p50 / p95 (s) | same text as alone |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [row_text(r) for r in result["rows"] if "clients" in r]
    for r in result["rows"]:
        if "clients" in r and r["clients"] == max(x.get("clients", 0) for x in result["rows"]):
            lines.append(f"\nRSS of the {r['mode']} server (--max-batch {r['max_batch']}): "
                         f"{r['rss_before'] / 2**20:.1f} MiB before the load, {r['rss_after'] / 2**20:.1f} MiB after")
    lines += [f"{r['mode']}: alone texts equal between the two servers for {r['alone_texts_equal_across_servers']}"
              f"/{r['prompts']} prompts" for r in result["rows"] if "prompts" in r]
    lines.append("speedup (tokens/s, batching / one at a time): " +
                 ", ".join(f"{k} {v:.2f}x" for k, v in result["speedup"].items()))
    lines.append(f"load average {result['load_start']:.1f} at the start, {result['load_end']:.1f} at the end; "
                 f"{result['command']}")
    return "\n".join(lines)
