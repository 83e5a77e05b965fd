"""The runtime model: load a model directory, run the per-token path, generate text."""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from flashllm.format import manifest as fmt
from flashllm.modes.registry import MODES
from flashllm.budget import budget_bytes, return_freed_memory, too_small
from flashllm.text.chat_template import ChatTemplate
from flashllm.errors import DroppedNeuronsWarning, FlashLLMError, OptionsError
from flashllm.modes.moe import MOE_MODES
from flashllm.io.ffn_reader import LayerChecksums
from flashllm.hooks import Hooks
from flashllm.generate import Generation, TextStream, eos_token_ids, generate_batch, generate_tokens
from flashllm.options import LoadOptions, Speculation
from flashllm.modes.context import ModeContext
from flashllm.format.safetensors_io import SafetensorsFile
from flashllm.modes.sparse.activation_sparsity import read_sparsity
from flashllm.speculative import draft_source, generate_speculative
from flashllm.stats import TokenCost, summarize
from flashllm.text.tokenizer import Tokenizer

DEFAULT_CONTEXT = 4096


def make_backend(name: str, spec, device: str, dtype: str | None, storage_dtype, context: int,
                 quantized_ffn: bool = False, kv_bits: int = 16, kernels: str = "tuned", threads: int | None = None):
    if name == "torch":
        from flashllm.backends.torch.backend import TorchBackend
        return TorchBackend(spec, device, dtype, storage_dtype, context, quantized_ffn, kv_bits, kernels, threads)
    if name == "mlx":
        try:
            from flashllm.backends.mlx.backend import MLXBackend
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("mlx"):
                raise
            raise FlashLLMError("backend 'mlx': MLX is not installed; in the flashllm checkout, install it with "
                                "`pip install -e \".[mlx]\" --config-settings editable_mode=strict` (mlx on macOS, mlx[cpu] on "
                                "Linux) or use --backend torch") from None
        return MLXBackend(spec, device, dtype, storage_dtype, context, quantized_ffn, kv_bits)
    raise FlashLLMError(f"backend {name!r}: expected torch or mlx")


class Model:
    """A loaded model. `logits`, `generate` and `stream` run the same per-token path."""

    def __init__(self, model_dir: str | Path, options: LoadOptions | None = None, **changes):
        """`options` (see LoadOptions; keyword `changes` override single fields). On a GPU, weights,
        KV and caches count against `gpu_budget` and host staging against `dram_budget`."""
        self.options = opts = LoadOptions.of(options, **changes)
        if opts.dram_budget is not None:
            return_freed_memory()
        self.manifest = fmt.read_manifest(model_dir, verify=opts.verify)
        self.spec, self.layout, self.mode = self.manifest.spec, self.manifest.layout, opts.mode
        self.context = min(opts.context or DEFAULT_CONTEXT, self.spec.context_limit)
        self.backend = make_backend(opts.backend, self.spec, opts.device, opts.dtype, self.manifest.dtype, self.context,
                                    self.manifest.data.get("quantization", "none") != "none", opts.kv_bits, opts.kernels,
                                    opts.compute_threads)
        if opts.gpu_budget is not None and not self.backend.on_gpu:  # nothing would read it: refused, not ignored
            where = "MLX (its GPU shares DRAM)" if opts.backend == "mlx" else \
                "the CPU" if (opts.device or "cpu") == "cpu" else f"device {opts.device}"
            raise OptionsError(f"{{gpu_budget}} sizes CUDA device memory, but this model runs on {where}, where "
                               f"{{dram_budget}} bounds all memory; drop {{gpu_budget}}, or run on a GPU with "
                               f"{{device=cuda}}")
        self.backend.set_sequences(opts.batch_size)  # before the modes: every KV cache counts against the budget
        self._tokenizer = None
        self._chat_template = None
        self._warned_overflow = False
        self.hooks = Hooks()  # observers of the per-token path (see hooks.py)
        self.checksums = LayerChecksums(self.manifest.path("ffn"), self.layout, self.manifest.data["ffn"].get("layer_sha256"))
        self._costs: list[TokenCost] = []
        self._prompts = 1  # how many of _costs are prompts (batch mode: one per sequence)
        self.last_generation = Generation()
        self.last_generations: list[Generation] = []  # generate_batch: one per prompt
        self._load_resident(skip_layers=opts.mode == "naive")
        self.backend.fuse_resident()  # after quantizing: quantized q/k/v stay as they are
        self.model_bytes = sum(e["size"] for k, e in self.manifest.data["files"].items() if k in ("resident", "ffn"))
        self.dram_budget = budget_bytes(opts.dram_budget, self.model_bytes)
        self.gpu_budget = budget_bytes(opts.gpu_budget, self.model_bytes)
        table = MOE_MODES if self.spec.is_moe else MODES  # MoE: the router is the exact predictor
        if opts.mode not in table:
            raise FlashLLMError(f"mode {opts.mode!r} is not supported for this {self.spec.family} model "
                                f"(expected one of {', '.join(table)})")
        self.draft_model = self._load_draft_model(opts.speculative)
        self.mode_context = ModeContext(self.manifest, self.backend, opts, self._cache_budget(),
                                        self.model_bytes, self.hooks, self.checksums, read_sparsity(self.manifest))
        try:
            self.mode_impl = table[opts.mode](self.mode_context)
        finally:
            self.mode_context.close()
        host, _ = self.memory()
        if self.backend.on_gpu and self.dram_budget is not None and host > self.dram_budget:
            raise too_small(self.dram_budget, host, "the host staging buffers", self.model_bytes, [])

    # -- loading -------------------------------------------------------------------------------
    def _load_draft_model(self, speculation: Speculation | None) -> "Model | None":
        """The resident draft model of `speculation` (dense, the same backend and context), or None."""
        if speculation is None or not isinstance(speculation.draft, str) or speculation.lookup:
            return None
        opts = self.options.replace(mode="dense", dram_budget=None, gpu_budget=None, speculative=None,
                                    predictor="auto", cache_rows=None, batch_size=1, context=self.context)
        draft = Model(speculation.draft, opts)
        if draft.spec.vocab_size != self.spec.vocab_size:
            raise FlashLLMError(f"draft model {speculation.draft}: its vocabulary has {draft.spec.vocab_size} tokens, "
                                f"the model's {self.spec.vocab_size}; a draft model needs the same tokenizer")
        return draft

    def _cache_budget(self) -> int | None:
        """The budget that sizes the mode's caches: the device's (GPU) or DRAM's, less a draft model's memory."""
        budget = self.gpu_budget if self.backend.on_gpu else self.dram_budget
        if budget is None or self.draft_model is None:
            return budget
        draft = sum(self.draft_model.memory()) if self.backend.on_gpu else self.draft_model.dram_bytes()
        if draft >= budget:
            raise too_small(budget, draft, "the draft model", self.model_bytes, [])
        return budget - draft

    def _load_resident(self, skip_layers: bool) -> None:
        """Resident tensors into the backend, one at a time, quantized as read with --quantize-resident
        (naive mode: only those outside the layers; it reads each layer's as it runs)."""
        path = self.manifest.path("resident")
        st, quantize = SafetensorsFile(path), self.options.quantize_resident
        for name, shape in fmt.resident_shapes(self.spec).items():
            if name not in st.entries:
                raise FlashLLMError(f"{path}: tensor {name!r} is missing")
            if st.shape(name) != shape:
                raise FlashLLMError(f"{path}: tensor {name!r} has shape {st.shape(name)}, expected {shape}")
            if not (skip_layers and name.startswith("layers.")):
                self.backend.put_bytes(name, st.read_bytes(name), st.dtype(name), shape, quantize)

    def compute_row_bytes(self) -> int:
        """DRAM one cached neuron costs (for sizing a budget): its bundle in the compute dtype plus biases."""
        return self.mode_context.row_bytes()

    # -- the per-token path --------------------------------------------------------------------
    def forward(self, ids: list[int], pos, slot=0, verify: bool = False) -> np.ndarray:
        """Logits [len(ids), vocab] for `ids` at positions pos.. of the sequence whose KV cache is `slot`
        (it holds 0..pos-1); or, batch decode (`pos` and `slot` lists), ids[i] at position pos[i] of
        sequence slot[i]: every layer's weights are then obtained once for all of them. `verify`: the ids
        are a speculative verification (the last token and drafts), decoded together like one token."""
        batch = not isinstance(pos, int)
        end = max(pos) + 1 if batch else pos + len(ids)
        if end > self.context:
            raise FlashLLMError(f"{end} tokens exceed the context of {self.context}")
        cost, t0 = TokenCost(tokens=len(ids), batch=len(ids) if batch else 1, verify=verify), time.perf_counter()
        B, s = self.backend, self.spec
        x = B.embed(ids, pos)
        if pos == 0:
            self.mode_impl.reset()
        for layer in range(s.n_layers):
            self.mode_impl.before_layer(layer, cost)
            if s.parallel_attn:  # attention and FFN both read the block's input
                attn, h = B.attention(layer, x, pos, slot)
                f_in = B.norm(f"layers.{layer}.ffn_norm", x) if s.ffn_norm else h
                x = x + attn + self._ffn(layer, f_in, cost, x)
            elif s.post_norms:  # Gemma 2/3: each sublayer's output is normed before its residual add
                attn, _ = B.attention(layer, x, pos, slot)
                x = x + B.norm(f"layers.{layer}.post_attn_norm", attn)
                y = self._ffn(layer, B.norm(f"layers.{layer}.ffn_norm", x), cost, x)
                x = x + B.norm(f"layers.{layer}.post_ffn_norm", y)
            else:
                x, f_in = B.attention_residual(layer, x, pos, slot)
                x = x + self._ffn(layer, f_in, cost, x)
            self.mode_impl.after_layer(layer)
        logits = B.logits(x)
        cost.total_ms = (time.perf_counter() - t0) * 1e3
        cost.compute_ms = cost.total_ms - cost.io_ms - cost.mem_ms - cost.predictor_ms
        self._costs.append(cost)
        if cost.neurons_dropped and not self._warned_overflow:
            self._warned_overflow = True
            share = f"{cost.dropped_mass / cost.predicted_mass:.1%}" if cost.predicted_mass > 0 else "an unknown share"
            warnings.warn(DroppedNeuronsWarning(
                f"the neuron caches could not hold every predicted neuron: {cost.neurons_dropped} dropped on this "
                f"token (lowest scores first; {share} of the predicted score mass); raise "
                f"{{{self.mode_context.budget_field}}}, or {{on_overflow=error}} to refuse (shown once; the stats "
                f"report the per-token average)"), stacklevel=2)
        return logits

    def step(self, ids: list[int], pos, slot=0) -> tuple[np.ndarray, TokenCost]:
        """`forward`, returning its cost rather than keeping it for `stats` (a scheduler that interleaves
        sequences keeps each one's own costs)."""
        logits = self.forward(ids, pos, slot)
        return logits, self._costs.pop()

    def _ffn(self, layer: int, x, cost, residual):
        """The FFN of `layer` on its input `x`, computed by the mode (the only part that differs between
        modes); the mode also sees the residual stream it was normed from (to predict the next layer)."""
        self.mode_impl.before_ffn(layer, residual, cost)
        self.hooks.emit("ffn_input", layer, x)
        y = self.mode_impl.ffn(layer, x, cost)
        self.hooks.emit("ffn_output", layer, y)
        return y

    # -- public API ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.manifest.root, self.spec.bos_token_id)
        return self._tokenizer

    @property
    def stats(self) -> dict:
        return self.stats_of(self._costs, self._prompts)

    def stats_of(self, costs: list[TokenCost], prompts: int = 1) -> dict:
        """The stats dict (see `stats`) of the forwards whose costs are `costs` (the first `prompts` are prompts)."""
        extra = {"mode": self.mode, "backend": self.backend.name, "kernels": self.backend.kernels(),
                 "device": str(self.backend.device),
                 "dram_budget": self.dram_budget, "gpu_budget": self.gpu_budget, "model_bytes": self.model_bytes,
                 "gpu_bytes": self.memory()[1] if self.backend.on_gpu else 0, "quantization": self.quantization()}
        extra.update(self.mode_impl.describe())
        if self.draft_model is not None:
            extra["draft_model_bytes"] = sum(self.draft_model.memory())
        return summarize(costs, self.dram_bytes(), extra, prompts)

    def quantization(self) -> dict:
        """What is held quantized: FFN bundles (as stored), resident matrices and the KV cache (as loaded)."""
        q = getattr(self.layout, "quant", None)
        return {"ffn": f"{q.name} {q.scheme} g{q.group_size}" if q else "none",
                "resident": self.options.quantize_resident, "kv_bits": self.options.kv_bits}

    @property
    def token_stats(self) -> list[dict]:
        """Per-forward costs of the last call: the prompt first, then each decode token."""
        return [dataclasses.asdict(c) for c in self._costs]

    def memory(self) -> tuple[int, int]:
        """(host bytes, device bytes) held: read buffers; resident weights, KV, caches, predictors; a draft model's."""
        host, device = self.mode_impl.host_bytes(), self.backend.nbytes() + self.mode_impl.device_bytes()
        if self.draft_model is not None:
            draft_host, draft_device = self.draft_model.memory()
            host, device = host + draft_host, device + draft_device
        return host, device

    def clear_stats(self) -> None:
        """Forget the per-forward costs recorded so far (a draft model's, between drafts)."""
        self._costs, self._prompts = [], 1

    def charged(self, host: int, device: int) -> int:
        """The bytes of (host, device) charged to the budget that sizes the caches."""
        return self.mode_context.charged(host, device)

    @property
    def predictor(self):
        """The sparse modes' predictor (None in the other modes)."""
        return self.mode_impl.predictor

    def dram_bytes(self) -> int:
        """DRAM held by the runtime (on a GPU: only the host buffers; the rest is `gpu_bytes`)."""
        host, device = self.memory()
        return host if self.backend.on_gpu else host + device

    def logits(self, token_ids, prefill: int | None = None) -> np.ndarray:
        """[len, vocab] float32 logits: the first `prefill` ids as one prompt, the rest one at a time."""
        ids = [int(t) for t in token_ids]
        prefill = len(ids) if prefill is None else prefill
        if not 1 <= prefill <= len(ids):
            raise FlashLLMError(f"prefill {prefill}: expected 1..{len(ids)}")
        if len(ids) > self.context:
            raise FlashLLMError(f"{len(ids)} tokens exceed the context of {self.context}")
        self._costs, self._prompts = [], 1
        rows = [self.forward(ids[:prefill], 0)]
        rows += [self.forward([t], prefill + i) for i, t in enumerate(ids[prefill:])]
        return np.concatenate(rows, axis=0)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int | None = 0, speculative=None) -> Iterator[int]:
        """Yield new token ids; `last_generation` records them and why generation stopped. `speculative`
        (Speculation.of: True, "prompt-lookup", ...; False: off; None: the load option) drafts tokens and
        verifies them several per forward pass (same tokens when greedy; the same distribution when sampling)."""
        self._costs, self._prompts = [], 1
        self.last_generation = Generation()
        speculation = self.options.speculative if speculative is None else Speculation.of(speculative)
        eos = eos_token_ids(self.spec, self.manifest.root)
        if speculation is None:
            yield from generate_tokens(self.forward, list(prompt_ids), self.context, max_new_tokens, temperature,
                                       top_p, seed, eos, self.last_generation)
            return
        loaded = self.options.speculative
        drafter = draft_source(speculation, self.draft_model if loaded and loaded.draft == speculation.draft else None)
        yield from generate_speculative(self.forward, drafter, speculation.num_draft_tokens, list(prompt_ids),
                                        self.context, max_new_tokens, temperature, top_p, seed, eos,
                                        self.last_generation, self._verified(speculation), speculation.adaptive)

    def _verified(self, speculation: Speculation):
        """Records each verification in its forward's cost and lets the mode update its window after it."""
        def record(drafted: int, accepted: int, produced: int, draft_ms: float) -> None:
            cost = self._costs[-1]
            cost.drafted, cost.accepted, cost.produced, cost.draft_ms = drafted, accepted, produced, draft_ms
            cost.total_ms += draft_ms
            self.mode_impl.keep_verified(accepted + 1, speculation.window_policy)
        return record

    @property
    def last_stop_reason(self) -> str | None:
        """Why the last generation ended: eos, stop (a stop string), length (max_new_tokens) or context."""
        return self.last_generation.stop_reason

    def stream_tokens(self, prompt: str | list[int], max_new_tokens: int = 32, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = 0, stop: str | Iterable[str] = (),
                      speculative=None) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) for every generated token, then (None, the text held back to the
        end) if any; a piece is empty while text is held back (an incomplete UTF-8 character, a possible
        stop string). `prompt` is text or token ids; the text ends just before the first of the `stop`
        strings, which ends generation. Stopping the iteration between tokens stops generation. `speculative`:
        see `generate_ids`."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        text = TextStream(self.tokenizer, ids, [stop] if isinstance(stop, str) else stop)
        tokens = self.generate_ids(ids, max_new_tokens, temperature, top_p, seed, speculative)
        for token in tokens:
            piece = text.add(token)
            if text.stopped:
                tokens.close()
                self.last_generation.stop_reason = "stop"
            yield token, piece
            if text.stopped:
                break
        if piece := text.flush():
            yield None, piece
        self.last_generation.text = text.text

    def stream(self, prompt: str | list[int], max_new_tokens: int = 32, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = 0, stop: str | Iterable[str] = (),
               speculative=None) -> Iterator[str]:
        """Yield text pieces as tokens are generated (never splitting a UTF-8 character); see `stream_tokens`."""
        for _, piece in self.stream_tokens(prompt, max_new_tokens, temperature, top_p, seed, stop, speculative):
            if piece:
                yield piece

    def generate(self, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = 0, stop: str | Iterable[str] = (), speculative=None) -> str:
        """The generated text (see `stream`); `last_stop_reason` says why it ended."""
        return "".join(self.stream(prompt, max_new_tokens, temperature, top_p, seed, stop, speculative))

    def generate_batch_ids(self, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0,
                           top_p: float = 1.0, seed: int | None = 0, stop_when=None) -> list[list[int]]:
        """The new token ids for several token-id prompts decoded together (no tokenizer needed); see
        `generate_batch`. `stop_when(i, token)`, if given, returns True to end sequence i there."""
        if not 1 <= len(prompts) <= len(self.backend.kvs):
            raise FlashLLMError(f"{len(prompts)} prompts, but the model was loaded for batches of up to "
                                f"{len(self.backend.kvs)} (load with batch_size={max(len(prompts), 1)})")
        ids = [[int(t) for t in p] for p in prompts]
        self._costs, self._prompts = [], len(ids)
        self.last_generations = runs = [Generation() for _ in ids]
        for i, token in generate_batch(self.forward, ids, self.context, max_new_tokens, temperature, top_p, seed,
                                       eos_token_ids(self.spec, self.manifest.root), runs):
            if stop_when is not None and stop_when(i, token):
                runs[i].stop_reason = "stop"
        return [run.token_ids for run in runs]

    def generate_batch(self, prompts: list[str | list[int]], max_new_tokens: int = 32, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = 0, stop: str | Iterable[str] = ()) -> list[str]:
        """The texts generated for several prompts decoded together (load with batch_size >= their
        number): each step obtains every layer's weights once for all of them (sparse: the union of their
        predicted neurons). Each text is what `generate` gives for its prompt alone (greedy, with an exact
        predictor); `last_generations` holds each one's ids and stop reason, `stats` the whole batch's."""
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        stops = [stop] if isinstance(stop, str) else list(stop)
        streams = [TextStream(self.tokenizer, p, stops) for p in ids]

        def stopped(i: int, token: int) -> bool:
            streams[i].add(token)
            return streams[i].stopped

        self.generate_batch_ids(ids, max_new_tokens, temperature, top_p, seed, stop_when=stopped)
        for text, run in zip(streams, self.last_generations):
            text.flush()
            run.text = text.text
        return [run.text for run in self.last_generations]

    # -- chat ----------------------------------------------------------------------------------
    @property
    def chat_template(self) -> ChatTemplate:
        """What `chat` renders messages with: the checkpoint's template unless set to another
        (a ChatTemplate, a Jinja file path or "plain"); a model without one is a clear error."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.resolve(self.manifest.root)
        return self._chat_template

    @chat_template.setter
    def chat_template(self, choice: "ChatTemplate | str | None") -> None:
        self._chat_template = choice if choice is None or isinstance(choice, ChatTemplate) else \
            ChatTemplate.resolve(self.manifest.root, str(choice))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The prompt token ids for `messages`, ending where the assistant's reply begins."""
        template = self.chat_template
        return self.tokenizer.encode(template.render(messages), special=template.add_special_tokens)

    def stream_chat(self, messages: list[dict], max_new_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int | None = 0, stop: str | list[str] = (),
                    speculative=None) -> Iterator[str]:
        """Yield the assistant's reply to `messages` as text pieces (see `stream`)."""
        stop = [stop] if isinstance(stop, str) else list(stop)
        return self.stream(self.chat_ids(messages), max_new_tokens, temperature, top_p, seed,
                           stop=stop + list(self.chat_template.stop), speculative=speculative)

    def chat(self, messages: list[dict], max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = 0, stop: str | list[str] = (), speculative=None) -> str:
        """The assistant's reply to `messages` ([{"role": "user", "content": "..."}, ...])."""
        return "".join(self.stream_chat(messages, max_new_tokens, temperature, top_p, seed, stop, speculative))
