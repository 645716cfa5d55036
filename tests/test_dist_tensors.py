"""A data-parallel rank's buffers cross between torch and ORT through DLPack, where they lie
(``memcc.dist.tensors``), and ranks are placed on devices and process groups
(``memcc.dist.placement``, ``memcc.dist.comm.backend_for``)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from memcc.dist.comm import backend_for
from memcc.dist.placement import Placement, place_rank
from memcc.errors import InputError
from memcc.graph import Graph

torch = pytest.importorskip("torch")


def _graph() -> Graph:
    """z = x + y (float32, 0-d y broadcast), m = z > 0 (bool), k = n + n (int64)."""
    nodes = [helper.make_node("Add", ["x", "y"], ["z"]),
             helper.make_node("Greater", ["z", "zero"], ["m"]),
             helper.make_node("Add", ["n", "n"], ["k"])]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("n", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("m", TensorProto.BOOL, [2, 3]),
         helper.make_tensor_value_info("k", TensorProto.INT64, [4])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    return Graph.from_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_orts_outputs_are_written_into_the_ranks_tensors_without_copies():
    from memcc.dist.bound import BoundGraph, flat_arrays
    from memcc.dist.tensors import RankDevice

    graph = _graph()
    views, flats = flat_arrays(["x", "z"], graph.info, extra=2)
    views["x"].copy_(torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]]))
    dev = RankDevice()
    y = dev.copy_of(np.array(0.5, np.float32))   # 0-d stays 0-d
    n = dev.copy_of(np.arange(4, dtype=np.int64))
    m = dev.zeros((2, 3), np.bool_)
    assert y.shape == () and m.dtype == torch.bool
    bound = BoundGraph(graph, {**views, "y": y, "n": n, "m": m}, source="t")
    bound.run()
    want = np.array([[-0.5, 2.5, -2.5], [4.5, -4.5, 6.5]], np.float32)
    # The bucket's own memory holds the output: ORT wrote it through DLPack.
    np.testing.assert_array_equal(flats[np.dtype(np.float32)][6:12].numpy(), want.ravel())
    np.testing.assert_array_equal(m.numpy(), want > 0)
    np.testing.assert_array_equal(bound.outputs["k"].numpy(), 2 * np.arange(4))
    # A second run sees what torch wrote in between (the same memory again).
    views["x"].mul_(2)
    bound.run()
    np.testing.assert_array_equal(views["z"].numpy(), 2 * want - 0.5)
    # Host views of CPU tensors are views, not copies.
    assert np.shares_memory(dev.host(views["z"]), flats[np.dtype(np.float32)].numpy())


def test_a_transient_bool_output_comes_back_as_a_bool_tensor():
    from memcc.dist.bound import BoundGraph, Unbound
    from memcc.dist.tensors import RankDevice

    graph = _graph()
    dev = RankDevice()
    bufs = {"x": dev.copy_of(np.ones((2, 3), np.float32)),
            "y": dev.copy_of(np.array(-2.0, np.float32)),
            "n": dev.copy_of(np.arange(4, dtype=np.int64))}
    bound = BoundGraph(graph, bufs, source="t", unbound=Unbound(transient={"m", "z"}))
    bound.run()
    m = bound.transient_outputs["m"]
    assert m.dtype == torch.bool and not bool(m.any())
    np.testing.assert_array_equal(bound.transient_outputs["z"].numpy(), -np.ones((2, 3)))
    bound.release()
    assert bound.transient_outputs == {}


@pytest.mark.parametrize("provider,local_world,gpus,want", [
    ("cpu", 2, 0, (Placement("cpu", 0, 1), "gloo")),
    ("cuda", 2, 2, (Placement("cuda", 1, 1), "nccl")),      # a GPU each: NCCL
    ("cuda", 2, 1, (Placement("cuda", 0, 1), "gloo")),      # two ranks share GPU 0
    ("cuda", 4, 2, (Placement("cuda", 1, 1), "gloo")),
])
def test_ranks_are_dealt_to_gpus_and_share_one_only_over_gloo(provider, local_world, gpus,
                                                              want):
    place, sharing = place_rank(provider, local_world - 1, local_world, gpus, 1)
    assert (place, backend_for(place.kind, sharing)) == want
    if place.on_gpu:
        assert place.session_settings().cuda_options == {"device_id": str(place.gpu)}


def test_cuda_ranks_without_a_gpu_are_refused_with_what_to_do():
    with pytest.raises(InputError, match="sees no GPU.*--provider cpu"):
        place_rank("cuda", 0, 2, 0, None)



def test_zero2_on_a_shared_gpu_is_refused_before_any_rank_starts(monkeypatch, tmp_path):
    from memcc.dist import launch
    from memcc.dist.train import DistOptions
    from memcc.trainer import TrainOptions

    monkeypatch.setattr(launch, "resolve_provider", lambda p: "cuda")
    monkeypatch.setattr(launch, "_gpus", lambda p: 1)
    opts = TrainOptions(step=tmp_path / "s.onnx", data=tmp_path / "d.npz", provider="cuda")
    with pytest.raises(InputError, match="--zero 2 with --provider cuda and 2 ranks on 1"):
        launch._check_placement(DistOptions(opts, 2, zero=2), 2)
    launch._check_placement(DistOptions(opts, 2, zero=1), 2)   # ZeRO-1 shares it over gloo


def test_a_cpu_rank_keeps_its_heap_between_steps_and_a_gpu_rank_leaves_it(monkeypatch,
                                                                         tmp_path):
    """``_join`` (spawned and torchrun ranks alike) keeps a CPU rank's freed step buffers
    in glibc's heap (``backend.memory.keep_heap_between_steps``: 1.45x -> 1.77x one rank,
    docs/DATA_PARALLEL.md); a rank on a GPU allocates through its arena and is left as
    it is."""
    import torch

    from memcc.dist import launch
    from memcc.dist.train import DistOptions
    from memcc.trainer import TrainOptions

    kept: list[bool] = []
    monkeypatch.setattr(launch, "keep_heap_between_steps", lambda: kept.append(True))
    monkeypatch.setattr(launch, "Comm", lambda *a: a)       # no process group here
    threads = torch.get_num_threads()
    try:
        for provider, gpus in (("cpu", 0), ("cuda", 2)):
            monkeypatch.setattr(launch, "resolve_provider", lambda p, _p=provider: _p)
            monkeypatch.setattr(launch, "_gpus", lambda p, _g=gpus: _g)
            opts = TrainOptions(step=tmp_path / "s.onnx", data=tmp_path / "d.npz",
                                provider=provider, threads=1)
            _, place = launch._join(DistOptions(opts, 2, zero=1), 0, 0, 2)
            assert place.on_gpu == (provider == "cuda")
            assert kept == [True], provider      # once: for the CPU rank only
    finally:
        torch.set_num_threads(threads)
