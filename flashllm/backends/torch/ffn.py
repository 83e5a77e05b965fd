"""The torch backend's FFN: over resident, streamed or cached rows (dense, sparse, a float32 sum over parts of a
layer's rows), the down projection's CPU kernels, resident FFN packing, and the MoE experts' weighted sum."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flashllm.backends.torch.native import NATIVE_DTYPES
from flashllm.backends.torch.qmatrix import NativeExpert
from flashllm.backends.torch.quant import QuantRows

# How one token's down projection h[1, n] @ rows[n, d] (rows = cache rows, any row stride) runs on the CPU
# where the native kernels do not, per compute dtype (the fastest measured: docs/architecture.md, "Defaults"):
# torch's float16/bfloat16 vector-matrix `h @ rows` takes a scalar path and its matrix-vector `mv(rows.t(), h)`
# converts float16 one value at a time; "chunked" casts DOWN_CHUNK rows at a time into a cache-sized float32
# buffer (vectorized) and accumulates float32 BLAS addmv over them: the products and the float32 sum of mv,
# rounded once. float32 goes to BLAS either way. "matmul": torch's default ("plain").
DOWN_KERNEL = {"float32": "matmul", "bfloat16": "mv", "float16": "chunked"}
DOWN_CHUNK = 64  # rows per float32 piece: 64 x 4096 x 4 B = 1 MiB, about a core's L2


class TorchFFN:
    """A part of `TorchBackend` (backend.py beside it): the FFN math. Uses the backend's spec, dtype, device,
    activation, kernels chosen at load (`_row_ffn`, `down_kernel`), `linear` and timers."""

    def ffn(self, x: torch.Tensor, rows: dict[str, torch.Tensor], up_bias, gate_bias, down_bias,
            threshold: float | None = None, gate_pre: torch.Tensor | None = None, index: np.ndarray | None = None,
            acc: torch.Tensor | None = None, finish: bool = False) -> torch.Tensor:
        """FFN over the neurons whose bundle parts are `rows[part]` ([n, d] each; down rows = columns),
        or packed by `pack_ffn`; with `threshold`, neurons with |act(pre)| <= threshold contribute
        zero (calibrated sparsity); `gate_pre` [T, n]: the gate pre-activations, already computed
        from resident gate rows (then `rows` has no gate). `index`: compute only these row positions
        (biases and gate_pre stay aligned with `rows`); `acc` (from `ffn_acc`): add the rows' float32
        contributions into it and return it, or with `finish` (a layer's last rows) return the FFN's
        output from it, `ffn_result(acc, x, down_bias)`."""
        t0, gated, packed = self._tic(), self.spec.gated_ffn, "down_t" in rows
        if self._row_ffn is not None and not packed and x.shape[0] == 1:  # the output rounded in the kernel call
            y = torch.empty_like(x) if acc is None or finish else None
            out = self._row_ffn(x, rows, up_bias, gate_bias, gate_pre, self.spec.activation,
                                self.spec.activation_threshold, threshold, index,
                                acc if acc is not None else self._ffn_buffer(x), gated, y=y,
                                down_bias=None if y is None else down_bias, zero=acc is None)
            if out is not None:  # (rows of another layout, e.g. experts: torch's)
                return self._toc("ffn", t0, out if y is None else y)
        if isinstance(rows.get("up"), QuantRows):  # no kernel for this call (e.g. prefill): dequantized rows
            rows = {p: t.values(self.dtype) for p, t in rows.items()}
        if index is not None:  # the selected rows (copies), their biases and pre-activations
            idx = torch.from_numpy(np.asarray(index, dtype=np.int64)).to(self.device)
            parts = ("up", "gate", "down") if gated and gate_pre is None else ("up", "down")
            rows = {p: self.ffn_part(rows, p).index_select(0, idx) for p in parts}
            up_bias, gate_bias = (None if b is None else b.index_select(0, idx) for b in (up_bias, gate_bias))
            gate_pre, packed = None if gate_pre is None else gate_pre.index_select(1, idx), False
        if acc is not None:  # float32 contributions of the rows, without the down bias
            h = self._hidden(x, rows, up_bias, gate_bias, threshold, gate_pre, packed)
            down = self.ffn_part(rows, "down")
            if self.down_kernel == "chunked" and h.shape[0] == 1:
                self._chunked_buffers(down.shape[1])
                acc.add_(chunked_down(h, down, self._down_buf[0], self._down_buf[1], True))
            else:
                acc.add_(h.float() @ down.float())
            return self._toc("ffn", t0, self.ffn_result(acc, x, down_bias) if finish else acc)
        h = self._hidden(x, rows, up_bias, gate_bias, threshold, gate_pre, packed)
        if packed:
            return self._toc("ffn", t0, self.linear(h, rows["down_t"], down_bias))
        y = self._down(h, rows["down"])
        return self._toc("ffn", t0, y + down_bias if down_bias is not None else y)

    def ffn_index_in_place(self) -> bool:
        return self.native is not None and (self.dtype in NATIVE_DTYPES or self.native_quant())

    def ffn_acc(self, x: torch.Tensor) -> torch.Tensor:
        """A float32 accumulator [T, d_model] for `ffn(..., acc=)` calls over parts of a layer's rows."""
        return torch.zeros(x.shape[0], self.spec.d_model, dtype=torch.float32, device=x.device)

    @staticmethod
    def ffn_result(acc: torch.Tensor, x: torch.Tensor, down_bias) -> torch.Tensor:
        """The FFN output from its float32 sum: rounded once to x's dtype, then the down bias added (a new tensor:
        the one-call native FFN reuses its sum's buffer)."""
        y = acc.to(x.dtype, copy=True)
        return y + down_bias if down_bias is not None else y

    def _ffn_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """The one-call native FFN's float32 accumulator [1, d_model], made once (the kernel zeroes it)."""
        if getattr(self, "_ffn_buf", None) is None:
            self._ffn_buf = torch.empty(1, self.spec.d_model, dtype=torch.float32)
        return self._ffn_buf

    def _hidden(self, x, rows, up_bias, gate_bias, threshold, gate_pre, packed) -> torch.Tensor:
        """h [T, n]: act(gate) * up (gated) or act(up), each rounded to the compute dtype as torch does."""
        gated = self.spec.gated_ffn
        if gate_pre is not None:
            up, pre = F.linear(x, rows["up"], up_bias), gate_pre
        elif packed:  # one up(+gate) product; down as a contiguous [d, n] matrix (or int4 expert slots)
            z = self.linear(x, rows["up_gate"] if gated else rows["up"], None)
            up, pre = z.chunk(2, dim=-1) if gated else (z, z)
            up = up if up_bias is None else up + up_bias
            pre = (pre if gate_bias is None else pre + gate_bias) if gated else up
        else:
            up = F.linear(x, rows["up"], up_bias)
            pre = F.linear(x, rows["gate"], gate_bias) if gated else up
        a = self.act(pre)
        if threshold is not None:
            a = a * (a.abs() > threshold)
        return a * up if gated else a

    def _down(self, h: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """h [T, n] @ down [n, d] with the kernel DOWN_KERNEL chose for the compute dtype."""
        if self.down_kernel == "matmul":
            return h @ down
        if h.shape[0] > 1:
            return (h.float() @ down.float()).to(h.dtype)  # several tokens: BLAS in float32 (prefill)
        if self.down_kernel == "mv":
            return torch.mv(down.t(), h[0])[None]
        self._chunked_buffers(down.shape[1])
        return chunked_down(h, down, *self._down_buf)

    def _chunked_buffers(self, d: int) -> None:
        if self._down_buf is None or self._down_buf[1].shape[0] != d:
            self._down_buf = (torch.empty(DOWN_CHUNK, d), torch.empty(d))

    def pack_ffn(self, rows: dict) -> dict:
        """A resident FFN's rows packed at load (dense and hybrid modes): up and gate as one [2n, d]
        matrix, down transposed to a contiguous [d, n] matrix; every token's FFN is then two
        contiguous matrix-vector products. Same math; rows that are not plain tensors of the compute
        dtype (quantized) and the "plain" kernels keep the rows as they are."""
        if not self.tuned or not all(type(t) is torch.Tensor and t.dtype == self.dtype for t in rows.values()):
            return rows
        down = rows["down"]
        packed = {"down_t": self.resident_empty(down.shape[::-1]).copy_(down.t())}
        if self.spec.gated_ffn:
            packed["up_gate"] = torch.cat((rows["up"], rows["gate"]), out=self.resident_empty(
                (2 * len(rows["up"]), *rows["up"].shape[1:])))
        else:
            packed["up"] = self.resident_empty(rows["up"].shape).copy_(rows["up"])
        return packed

    def ffn_part(self, rows: dict, part: str):
        if part in rows:
            return rows[part]
        if part == "down":
            return rows["down_t"].t()
        return rows["up"] if "up" in rows else rows["up_gate"].chunk(2)[part == "gate"]

    def moe_experts(self, x: torch.Tensor, groups: list, acc: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts: for each (rows, token ids, float32 weights) group, weights * expert(x[tokens]) added
        to those tokens' rows of a float32 accumulator [T, d_model] (a new one when `acc` is None). Summing in
        float32 makes the result independent of how a mode splits the experts (dense: all at once; streamed:
        cached ones, then chunks read into the slots), up to float32 rounding."""
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if acc is None else acc
        if groups and isinstance(groups[0][0], NativeExpert) and self._native_experts(x, groups, acc):
            return acc
        for rows, tokens, weights in groups:
            if isinstance(rows, NativeExpert):  # (no native call for these: torch over the expert dequantized)
                rows = rows.slots.dequantized(rows.slot, self.dtype)
            idx = torch.from_numpy(tokens).to(self.device)
            out = self.ffn(x[idx], rows, None, None, None).float() * torch.from_numpy(weights).to(self.device)[:, None]
            acc[idx] += out  # a token meets an expert once; index_add_ measured ~1000x slower on CPU
        return acc

    def _native_experts(self, x: torch.Tensor, groups: list, acc: torch.Tensor) -> bool:
        """`moe_experts` over experts of one NativeExpertSlots in one native call; False where it does not apply."""
        slots = groups[0][0].slots
        if self.native is None or any(not isinstance(r, NativeExpert) or r.slots is not slots for r, _, _ in groups):
            return False
        n = len(groups)
        ids = np.fromiter((r.slot for r, _, _ in groups), dtype=np.int64, count=n)
        if x.shape[0] == 1:  # one token: one pair per expert
            start, tokens = np.arange(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64)
            weights = np.fromiter((w[0] for _, _, w in groups), dtype=np.float32, count=n)
        else:
            start = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([len(t) for _, t, _ in groups], out=start[1:])
            tokens = np.ascontiguousarray(np.concatenate([t for _, t, _ in groups]), dtype=np.int64)
            weights = np.ascontiguousarray(np.concatenate([w for _, _, w in groups]), dtype=np.float32)
        t0 = self._tic()
        done = self.native.experts(x, slots, ids, start, tokens, weights, self.spec.activation,
                                   self.spec.activation_threshold or 0.0, acc)
        self._toc("ffn", t0, acc)
        return done

    def moe_output(self, x: torch.Tensor, acc: torch.Tensor, shared: dict | None = None, shared_gate=None) -> torch.Tensor:
        """The MoE FFN's output in x's dtype: the routed experts' float32 sum `acc` plus the shared expert,
        scaled by sigmoid(shared_gate . x) if given; rounded once."""
        if shared is not None:
            out = self.ffn(x, shared, None, None, None)
            acc = acc + (torch.sigmoid(F.linear(x, shared_gate)) * out if shared_gate is not None else out).float()
        return acc.to(x.dtype)


def chunked_down(h: torch.Tensor, down: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor,
                 float32: bool = False) -> torch.Tensor:
    """h [1, n] @ down [n, d] (any row stride) as float32 BLAS over pieces of `buf`'s rows ([chunk, d] float32)
    cast from `down`, summed into `acc` [d] (float32), rounded once to h's dtype: [1, d] (`float32`: the
    sum itself, a view of `acc`)."""
    hf = h[0].float()
    acc.zero_()
    for i in range(0, down.shape[0], buf.shape[0]):
        piece = buf[:min(buf.shape[0], down.shape[0] - i)].copy_(down[i:i + buf.shape[0]])
        acc.addmv_(piece.t(), hf[i:i + len(piece)])
    return acc[None] if float32 else acc.to(h.dtype)[None]
