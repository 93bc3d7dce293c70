"""float32 weights laid out input-major for OpenBLAS under MLX on the CPU.

MLX's linear layers keep ``[out, in]`` weights and multiply ``x @ w.T``; OpenBLAS's
single-threaded SGEMM (as :mod:`foretell.platform.blas` runs it under MLX) is much slower
with that transposed operand at the few rows a decode step has than with ``[in, out]``
weights multiplied as they are: a 12,288 x 512 head at 4 rows 3.9 ms against 2.0, the demo's
whole decode step 21.5 ms against 14.7 at one row (docs/decisions.md, "Input-major weights
on the CPU"). So on that path every float32 linear layer keeps its weight transposed once at
load, and a tied head's embedding keeps only its transpose: a token's embedding is then a
column, gathered as cheaply as a row at a decode step's few tokens (14 ms for a 2,048-token
prefill's on the demo, ~1% of that prefill).

Each layer still answers ``weight`` in MLX's ``[out, in]`` (``[vocab, dims]``) layout, as a
view, for code that reads it. Imported only where OpenBLAS is under MLX on the CPU
(:func:`foretell.model.loading.fit_to_device`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


class _InputMajor(nn.Module):
    """A layer holding its weight transposed (``weight_t``) that still answers ``weight`` in
    MLX's layout, as a view; a ``weight`` set back in that layout (code that casts a layer's
    weight and sets it back, as mlx-lm's Gemma 3n does) is kept transposed, so the layer stays
    input-major and computes with the new value."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.weight = layer.weight

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __setattr__(self, key: str, value: object) -> None:
        if key == "weight" and isinstance(value, mx.array):
            key, value = "weight_t", mx.contiguous(value.T)
        super().__setattr__(key, value)


class InputMajorLinear(_InputMajor):
    """A linear layer holding its weight as ``[in, out]`` (``weight_t``)."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__(layer)
        if "bias" in layer:
            self.bias = layer.bias

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


class InputMajorEmbedding(_InputMajor):
    """An embedding holding its table as ``[dims, vocab]`` (``weight_t``): a tied head's."""

    def __call__(self, tokens: mx.array) -> mx.array:
        return mx.moveaxis(mx.take(self.weight_t, tokens, axis=1), 0, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def lay_out(model: nn.Module, vocab_size: int | None) -> int:
    """Replace ``model``'s float32 linear layers, and the embeddings it uses as its head, by
    input-major ones; returns how many were replaced. An embedding is taken for the head
    where its rows are the ``vocab_size`` tokens and no linear layer projects to them (a tied
    head): an embedding only looked up gains nothing from its transpose."""
    leaves = [m for _, m in model.named_modules()]
    untied = any(type(m) is nn.Linear and m.weight.shape[0] == vocab_size for m in leaves)
    replaced = 0

    def swap(layer: nn.Module) -> nn.Module:
        nonlocal replaced
        if type(layer) is nn.Linear and layer.weight.dtype == mx.float32:
            replaced += 1
            return InputMajorLinear(layer)
        if type(layer) is nn.Embedding and layer.weight.dtype == mx.float32 \
                and not untied and layer.weight.shape[0] == vocab_size:
            replaced += 1
            return InputMajorEmbedding(layer)
        return layer

    model.update_modules(tree_map(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return replaced
