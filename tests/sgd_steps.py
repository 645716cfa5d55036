"""A few plain SGD steps in torch and in memcc's step, for tests that hold one to the other.

The tests of what the dynamo exporter folded (``test_folded_constants``,
``test_held_broadcasts``) train a module for a few steps in both: a difference that one
step hides (a constant trained as a parameter moves only from the second step on) shows in
the losses and the parameters after several.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
from threads import run_at_threads

from memcc.graph import Graph


def torch_sgd_steps(module: torch.nn.Module, inputs: Mapping[str, torch.Tensor], steps: int,
                    lr: float) -> tuple[list[float], dict[str, np.ndarray]]:
    """The losses of ``steps`` SGD steps of a copy of ``module`` (which returns its loss) on
    ``inputs``, and its state after them (parameters and the buffers its forward writes),
    by ``state_dict`` name."""
    m = copy.deepcopy(module)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = m(**inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().numpy().copy() for n, p in m.state_dict().items()}


def memcc_sgd_steps(step: Graph, feeds: Mapping[str, np.ndarray], steps: int, threads: int
                    ) -> tuple[list[float], dict[str, np.ndarray]]:
    """The losses of ``steps`` runs of the training step ``step`` at ``threads`` intra-op
    threads (each run twice, bit for bit alike), and the trained state after them, by the
    step's parameter names."""
    losses: list[float] = []
    state: dict[str, np.ndarray] = {}
    for _ in range(steps):
        out = run_at_threads(step, {**feeds, **state}, threads=(threads,))[threads]
        losses.append(float(out["loss"]))
        state = {k[:-4]: v for k, v in out.items() if k.endswith(".new")}
    return losses, state
