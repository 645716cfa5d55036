"""BERT encoder for sequence classification: padding mask input, post-LN blocks, Erf GELU."""

from __future__ import annotations

import onnx
from onnx import TensorProto

from models._builder import GraphBuilder, batch_dim, logits_output, metadata
from models._layers import attention_core, dense, gelu_erf, layer_norm, merge_heads, split_heads


def build(batch: int = 2, seq_len: int = 16, vocab_size: int = 96, width: int = 32,
          depth: int = 2, heads: int = 4, num_labels: int = 3, type_vocab_size: int = 2,
          max_positions: int | None = None, token_type_input: bool = False, seed: int = 0,
          dynamic_batch: bool = False) -> onnx.ModelProto:
    """HF ``BertForSequenceClassification`` without dropout: word + position + token-type
    embeddings (Gather, Add) and LayerNormalization; ``depth`` post-LN encoder layers (q/k/v
    MatMul+Add, heads by Reshape/Transpose, q k^T / sqrt(d) plus the additive mask
    (1 - mask) * -10000 built from the int64 ``attention_mask`` with Unsqueeze/Cast/Sub/Mul,
    Softmax, output dense, residual, LayerNorm; intermediate dense with Erf GELU, output
    dense, residual, LayerNorm); the pooler (Dense + Tanh) on the first token (Gather) and the
    classifier. Init as BERT: normal(0.02), LayerNorm eps 1e-12.

    Options: ``batch``, ``seq_len``, ``vocab_size``, ``width`` (hidden_size), ``depth``
    (num_hidden_layers), ``heads`` (num_attention_heads), ``num_labels``,
    ``type_vocab_size``, ``max_positions`` (default seq_len), ``token_type_input`` (add an
    int64 input ``token_type_ids``; otherwise all tokens use type 0), ``seed``,
    ``dynamic_batch``. Inputs ``input_ids`` int64 [batch, seq_len] in [0, vocab_size) and
    ``attention_mask`` int64 [batch, seq_len] (1 = token, 0 = padding); output ``logits``
    [batch, num_labels]. Real size (BERT-base, 110M): ``width=768, depth=12, heads=12,
    vocab_size=30522, seq_len=512``.
    """
    if width % heads:
        raise ValueError(f"width {width} must be divisible by heads {heads}")
    max_positions = max_positions or seq_len
    options = dict(batch=batch, seq_len=seq_len, vocab_size=vocab_size, width=width,
                   depth=depth, heads=heads, num_labels=num_labels,
                   type_vocab_size=type_vocab_size, max_positions=max_positions,
                   token_type_input=token_type_input, seed=seed)
    b = GraphBuilder("bert", seed)
    n = batch_dim(batch, dynamic_batch)
    ids = b.input("input_ids", TensorProto.INT64, [n, seq_len])
    mask = b.input("attention_mask", TensorProto.INT64, [n, seq_len])
    types = (b.input("token_type_ids", TensorProto.INT64, [n, seq_len]) if token_type_input
             else b.ints([[0] * seq_len]))
    x = _embeddings(b, ids, types, vocab_size, type_vocab_size, max_positions, seq_len, width)
    additive = _additive_mask(b, mask)
    for i in range(depth):
        x = _layer(b, x, f"encoder.layer.{i}", width, heads, additive)
    first = b.op("Gather", [x, b.const(0, dtype="int64")], name="first_token", axis=1)
    pooled = b.op("Tanh", [dense(b, first, "pooler.dense", width, width, 0.02)], name="pooler")
    x = dense(b, pooled, "classifier", width, num_labels, 0.02)
    logits_output(b, x, [n, num_labels])
    return b.model(build.__doc__ or "", metadata("bert", options, vocab_size=vocab_size,
                                                 num_classes=num_labels))


def _embeddings(b: GraphBuilder, ids: str, types: str, vocab: int, type_vocab: int,
                max_positions: int, seq_len: int, width: int) -> str:
    word = b.normal("embeddings.word_embeddings.weight", [vocab, width], 0.02)
    pos = b.normal("embeddings.position_embeddings.weight", [max_positions, width], 0.02)
    typ = b.normal("embeddings.token_type_embeddings.weight", [type_vocab, width], 0.02)
    x = b.op("Gather", [word, ids], name="embeddings.word", axis=0)
    p = b.op("Gather", [pos, b.ints(range(seq_len))], name="embeddings.position", axis=0)
    t = b.op("Gather", [typ, types], name="embeddings.token_type", axis=0)
    x = b.op("Add", [x, p], name="embeddings.add_pos")
    x = b.op("Add", [x, t], name="embeddings.add_type")
    return layer_norm(b, x, "embeddings.LayerNorm", width, 1e-12)


def _additive_mask(b: GraphBuilder, mask: str) -> str:
    """[B, T] int64 (1 keep, 0 pad) -> [B, 1, 1, T] float: 0 where kept, -10000 where padded."""
    m = b.op("Unsqueeze", [mask, b.ints([1, 2])], name="mask.unsqueeze")
    m = b.op("Cast", [m], name="mask.float", to=TensorProto.FLOAT)
    m = b.op("Sub", [b.scalar(1.0), m], name="mask.invert")
    return b.op("Mul", [m, b.scalar(-10000.0)], name="mask.additive")


def _layer(b: GraphBuilder, x: str, name: str, width: int, heads: int, additive: str) -> str:
    d = width // heads
    att = f"{name}.attention"
    q = split_heads(b, dense(b, x, f"{att}.self.query", width, width, 0.02), f"{att}.q", heads,
                    d)
    k = split_heads(b, dense(b, x, f"{att}.self.key", width, width, 0.02), f"{att}.k", heads, d,
                    perm=(0, 2, 3, 1))
    v = split_heads(b, dense(b, x, f"{att}.self.value", width, width, 0.02), f"{att}.v", heads,
                    d)
    ctx = merge_heads(b, attention_core(b, q, k, v, f"{att}.self", d, additive_mask=additive),
                      f"{att}.merge", width)
    h = dense(b, ctx, f"{att}.output.dense", width, width, 0.02)
    x = layer_norm(b, b.op("Add", [h, x], name=f"{att}.residual"), f"{att}.output.LayerNorm",
                   width, 1e-12)
    h = gelu_erf(b, dense(b, x, f"{name}.intermediate.dense", width, 4 * width, 0.02),
                 f"{name}.intermediate.act")
    h = dense(b, h, f"{name}.output.dense", 4 * width, width, 0.02)
    return layer_norm(b, b.op("Add", [h, x], name=f"{name}.residual"),
                      f"{name}.output.LayerNorm", width, 1e-12)
