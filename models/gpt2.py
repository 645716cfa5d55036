"""GPT-2 decoder: attention score tensors [B, H, T, T] dominate activation memory."""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto

from models._builder import GraphBuilder, batch_dim, logits_output, metadata
from models._layers import attention_core, dense, gelu_tanh, layer_norm, merge_heads, split_heads


def build(batch: int = 2, seq_len: int = 16, vocab_size: int = 96, width: int = 32,
          depth: int = 2, heads: int = 4, n_positions: int | None = None,
          tie_embeddings: bool = True, seed: int = 0, dynamic_batch: bool = False
          ) -> onnx.ModelProto:
    """HF ``GPT2LMHeadModel`` without dropout: token (``wte``) + position (``wpe``) embeddings
    by Gather, ``depth`` pre-LN blocks (LayerNormalization, fused ``c_attn`` MatMul+Add, Split
    into q/k/v, Reshape/Transpose to heads, q k^T / sqrt(d), causal mask by Where with a
    constant bool lower-triangular mask, Softmax, context, ``c_proj``; LayerNormalization and
    an MLP with GPT-2's tanh GELU written with Pow/Tanh), residual Adds, final ``ln_f`` and
    the LM head MatMul (tied to ``wte`` through a Transpose when ``tie_embeddings``).
    Init as GPT-2: normal(0.02), residual projections scaled by 1/sqrt(2*depth).

    Options: ``batch``, ``seq_len``, ``vocab_size``, ``width`` (n_embd), ``depth``
    (n_layer), ``heads`` (n_head), ``n_positions`` (default seq_len), ``tie_embeddings``,
    ``seed``, ``dynamic_batch``. Input ``input_ids`` int64 [batch, seq_len] in
    [0, vocab_size); output ``logits`` [batch, seq_len, vocab_size].
    Real size (GPT-2 small, 124M): ``width=768, depth=12, heads=12, vocab_size=50257,
    seq_len=1024``; medium: ``width=1024, depth=24, heads=16``.
    """
    if width % heads:
        raise ValueError(f"width {width} must be divisible by heads {heads}")
    n_positions = n_positions or seq_len
    if n_positions < seq_len:
        raise ValueError(f"n_positions {n_positions} < seq_len {seq_len}")
    options = dict(batch=batch, seq_len=seq_len, vocab_size=vocab_size, width=width,
                   depth=depth, heads=heads, n_positions=n_positions,
                   tie_embeddings=tie_embeddings, seed=seed)
    b = GraphBuilder("gpt2", seed)
    n = batch_dim(batch, dynamic_batch)
    ids = b.input("input_ids", TensorProto.INT64, [n, seq_len])
    wte = b.normal("wte.weight", [vocab_size, width], 0.02)
    wpe = b.normal("wpe.weight", [n_positions, width], 0.01)
    tok = b.op("Gather", [wte, ids], name="wte", axis=0)
    pos = b.op("Gather", [wpe, b.ints(range(seq_len))], name="wpe", axis=0)
    x = b.op("Add", [tok, pos], name="embed")
    proj_std = 0.02 / math.sqrt(2 * depth)
    for i in range(depth):
        x = _block(b, x, f"h.{i}", width, heads, seq_len, proj_std)
    x = layer_norm(b, x, "ln_f", width, 1e-5)
    if tie_embeddings:
        head = b.op("Transpose", [wte], name="lm_head.tied", perm=[1, 0])
    else:
        head = b.normal("lm_head.weight", [width, vocab_size], 0.02)
    x = b.op("MatMul", [x, head], name="lm_head")
    logits_output(b, x, [n, seq_len, vocab_size])
    return b.model(build.__doc__ or "", metadata("gpt2", options, vocab_size=vocab_size,
                                                 num_classes=vocab_size))


def _block(b: GraphBuilder, x: str, name: str, width: int, heads: int, seq_len: int,
           proj_std: float) -> str:
    h = layer_norm(b, x, f"{name}.ln_1", width, 1e-5)
    x = b.op("Add", [x, _attention(b, h, f"{name}.attn", width, heads, seq_len, proj_std)],
             name=f"{name}.res_attn")
    h = layer_norm(b, x, f"{name}.ln_2", width, 1e-5)
    h = dense(b, h, f"{name}.mlp.c_fc", width, 4 * width, 0.02)
    h = gelu_tanh(b, h, f"{name}.mlp.act")
    h = dense(b, h, f"{name}.mlp.c_proj", 4 * width, width, proj_std)
    return b.op("Add", [x, h], name=f"{name}.res_mlp")


def _attention(b: GraphBuilder, x: str, name: str, width: int, heads: int, seq_len: int,
               proj_std: float) -> str:
    d = width // heads
    qkv = dense(b, x, f"{name}.c_attn", width, 3 * width, 0.02)
    q, k, v = b.op_multi("Split", [qkv, b.ints([width] * 3)], outputs=[
        f"{name}.q", f"{name}.k", f"{name}.v"], axis=2)
    q = split_heads(b, q, f"{name}.q_heads", heads, d)
    k = split_heads(b, k, f"{name}.k_heads", heads, d, perm=(0, 2, 3, 1))
    v = split_heads(b, v, f"{name}.v_heads", heads, d)
    ctx = attention_core(b, q, k, v, name, d, causal_len=seq_len)
    ctx = merge_heads(b, ctx, f"{name}.merge", width)
    return dense(b, ctx, f"{name}.c_proj", width, width, proj_std)

