"""GridSample's gradient (``F.grid_sample``: spatial transformers, deformable attention's
pure-PyTorch path, optical-flow warps), bilinear over a 4-D image.

Each output reads four corners of the image with weights from the sampling position. The
image's gradient adds ``g * weight`` back into each corner: one ScatterElements with
``reduction="add"`` over the flattened spatial axis, the four corners side by side (a
corner outside the image has weight 0 under ``padding_mode="zeros"`` and is sent to
position 0). The grid's gradient is the weights' slope times the corner values,
``g * (w_y0 (v01 - v00) + w_y1 (v11 - v10))`` for x, summed over channels, times the
scale from the normalised grid to pixels; under ``padding_mode="border"`` it is 0 where the
position was clamped, as torch's. The arithmetic is written from the operator's
definition, so the results agree with torch's to float rounding (``tests/
test_gradients_nn.py``); ``nearest``, ``cubic``, ``reflection`` and images of other rank
are refused, naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from memcc.errors import GradientError
from memcc.frontend.gradients.registry import GradContext, register
from memcc.frontend.gradients.shape_ops import Grads
from memcc.graph import TensorInfo, attr, node_label, text_attr


@register("GridSample")
def _grid_sample_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    x, grid = node.input[0], node.input[1]
    mode = text_attr(node, "mode", "bilinear")
    padding = text_attr(node, "padding_mode", "zeros")
    x_info = ctx.info(x)
    if mode not in ("bilinear", "linear") or padding not in ("zeros", "border") \
            or len(x_info.shape) != 4:
        raise GradientError(
            f"{node_label(node)}: memcc differentiates GridSample with mode bilinear/linear, "
            f"padding_mode zeros or border, over a 4-D image; this one is mode={mode}, "
            f"padding_mode={padding}, rank {len(x_info.shape)}")
    if gouts[0] is None:
        return [None, None]
    s = _Sampling(ctx, node, padding == "border")
    out: Grads = [None, None]
    if ctx.needs_grad(x):
        out[0] = s.image_grad(gouts[0])
    if ctx.needs_grad(grid):
        out[1] = s.grid_grad(x, gouts[0])
    return out


class _Sampling:
    """The four corners' flat indices, weights and validity for every output position,
    emitted once and shared by the two gradients."""

    def __init__(self, ctx: GradContext, node: onnx.NodeProto, border: bool) -> None:
        self.ctx, self.node, self.e = ctx, node, ctx.emit
        self.n, self.c, self.h, self.w = ctx.info(node.input[0]).shape
        self.dtype = ctx.info(node.input[0]).dtype
        self.positions = int(np.prod(ctx.info(node.input[1]).shape[1:3]))
        align = bool(attr(node, "align_corners", 0))
        flat = self.e.reshape(node.input[1], [self.n, self.positions, 2])
        gx, gy = self.e.op("Split", [flat, self.e.ints([1, 1])], outputs=2, axis=2, info=[
            TensorInfo(self.dtype, (self.n, self.positions, 1))] * 2)
        self.x = self._axis(gx, self.w, align, border)
        self.y = self._axis(gy, self.h, align, border)
        self.corners = [self._corner(yk, xk) for yk in (0, 1) for xk in (0, 1)]

    def _const(self, value: float) -> str:
        return self.e.scalar(value, self.dtype)

    def _axis(self, g: str, size: int, align: bool, border: bool) -> dict:
        """Pixel position along one axis: its floor, the weights of the two neighbours,
        the slope d(pixel)/d(grid), and (border) where clamping zeroes it."""
        e = self.e
        scale = (size - 1) / 2.0 if align else size / 2.0
        # (g + 1) / 2 * (size - 1) with align_corners, ((g + 1) * size - 1) / 2 without
        pix = e.add(e.mul(g, self._const(scale)), self._const((size - 1) / 2.0))
        slope = self._const(scale)
        if border:
            inside = self._bool("And", self._cmp("Greater", pix, 0.0),
                                self._cmp("Less", pix, float(size - 1)))
            slope = e.mul(e.cast(inside, self.dtype), slope)
            pix = e.op("Clip", [pix, self._const(0.0), self._const(float(size - 1))],
                       info=self.ctx.info(pix))
        lo = e.unary("Floor", pix)
        w1 = e.sub(pix, lo)
        return {"lo": lo, "w": (e.sub(self._const(1.0), w1), w1), "slope": slope}

    def _cmp(self, op: str, a: str, value: float) -> str:
        return self.e.op(op, [a, self._const(value)],
                         info=TensorInfo(TensorProto.BOOL, self.ctx.info(a).shape))

    def _bool(self, op: str, a: str, b: str) -> str:
        return self.e.op(op, [a, b], info=TensorInfo(TensorProto.BOOL, self.ctx.info(a).shape))

    def _corner(self, dy: int, dx: int) -> dict:
        """One corner: flat index [N, C, P] (0 where outside), weight times validity."""
        e = self.e
        yi = e.add(self.y["lo"], self._const(float(dy)))
        xi = e.add(self.x["lo"], self._const(float(dx)))
        valid = self._bool("And", self._bool("And", self._cmp("GreaterOrEqual", xi, 0.0),
                                             self._cmp("Less", xi, float(self.w))),
                           self._bool("And", self._cmp("GreaterOrEqual", yi, 0.0),
                                      self._cmp("Less", yi, float(self.h))))
        # the flat index in int64: a float32 one is exact only up to 2**24 pixels
        row, col = e.cast(yi, TensorProto.INT64), e.cast(xi, TensorProto.INT64)
        flat = e.add(e.mul(row, e.scalar(self.w, TensorProto.INT64)), col)
        flat = e.op("Where", [valid, flat, e.scalar(0, TensorProto.INT64)],
                    info=self.ctx.info(flat))
        index = e.expand(e.reshape(flat, [self.n, 1, self.positions]),
                         [self.n, self.c, self.positions])
        weight = e.mul(e.mul(self.y["w"][dy], self.x["w"][dx]), e.cast(valid, self.dtype))
        return {"index": index, "weight": e.reshape(weight, [self.n, 1, self.positions]),
                "valid": e.reshape(e.cast(valid, self.dtype), [self.n, 1, self.positions])}

    def image_grad(self, g: str) -> str:
        e = self.e
        gf = e.reshape(g, [self.n, self.c, self.positions])
        idx = e.op("Concat", [k["index"] for k in self.corners], axis=2,
                   info=TensorInfo(TensorProto.INT64, (self.n, self.c, 4 * self.positions)))
        upd = e.op("Concat", [e.mul(gf, k["weight"]) for k in self.corners], axis=2,
                   info=TensorInfo(self.dtype, (self.n, self.c, 4 * self.positions)))
        zeros = e.zeros([self.n, self.c, self.h * self.w], self.dtype)
        gx = e.op("ScatterElements", [zeros, idx, upd], axis=2, reduction="add",
                  info=TensorInfo(self.dtype, (self.n, self.c, self.h * self.w)))
        return e.reshape(gx, [self.n, self.c, self.h, self.w])

    def grid_grad(self, x: str, g: str) -> str:
        e = self.e
        xf = e.reshape(x, [self.n, self.c, self.h * self.w])
        gf = e.reshape(g, [self.n, self.c, self.positions])
        v = [e.mul(e.op("GatherElements", [xf, k["index"]], axis=2,
                        info=TensorInfo(self.dtype, (self.n, self.c, self.positions))),
                   k["valid"]) for k in self.corners]            # v00, v01, v10, v11
        wy0, wy1 = (e.reshape(w, [self.n, 1, self.positions]) for w in self.y["w"])
        wx0, wx1 = (e.reshape(w, [self.n, 1, self.positions]) for w in self.x["w"])
        d_x = e.add(e.mul(wy0, e.sub(v[1], v[0])), e.mul(wy1, e.sub(v[3], v[2])))
        d_y = e.add(e.mul(wx0, e.sub(v[2], v[0])), e.mul(wx1, e.sub(v[3], v[1])))
        parts = []
        for d, axis in ((d_x, self.x), (d_y, self.y)):
            summed = e.reduce_sum(e.mul(gf, d), [1], keepdims=False,
                                  info=TensorInfo(self.dtype, (self.n, self.positions)))
            slope = axis["slope"]
            if self.ctx.info(slope).shape:   # border: per position
                slope = e.reshape(slope, [self.n, self.positions])
            parts.append(e.reshape(e.mul(summed, slope), [self.n, self.positions, 1]))
        both = e.op("Concat", parts, axis=2,
                    info=TensorInfo(self.dtype, (self.n, self.positions, 2)))
        return e.reshape(both, list(self.ctx.info(self.node.input[1]).shape))
