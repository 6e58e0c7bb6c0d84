"""``python -m kt_ops.bench --model-step``: the op inside a model step, next to torch's work.

A decoder layer alternates torch work (attention, norms: torch's intra-op threads) with
the MoE block. If the two run on different thread pools, each pool's threads spin for the
cores while the other one works, and the step costs more than its parts. Per row this
mode times, interleaved round by round (medians over rounds, the machine's speed drifts):

- ``torch``: an attention-sized block of torch work alone, four ``[T, H] x [H, H]``
  ``F.linear`` (H = 2048, the shapes' hidden size; one set of weights per layer, cycled)
  in the dtype torch is fast in here (bf16, or fp32 without native bf16: see
  :mod:`kt_ops.bench.torch_dtype`);
- ``kt``: ``kt_ops.moe_forward`` alone (the layers are cycled, so the activated experts'
  weights come from DRAM as in a model);
- ``step``: one torch block followed by one MoE call, as a model step runs them;

and prints ``step / (torch + kt)`` (the median over rounds of each round's ratio, so the
drift between rounds cancels): 1.00 means the op costs inside a model what it costs
alone. The target (issue 16) is <= 1.10 with default settings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kt_ops
from kt_ops.bench.runner import SHAPES, Shape, make_layers, random_routing

ATTENTION_PROJECTIONS = 4  # q, k, v, o


@dataclass
class StepRow:
    shape: str
    method: str
    tokens: int
    torch_us: float  # median, torch block alone
    kt_us: float  # median, MoE call alone
    step_us: float  # median, torch block then MoE call
    ratio: float  # median over rounds of step / (torch + kt), each round's three side by side

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _median_us(call: Callable[[int], object], calls: int, offset: int) -> float:
    seconds = []
    for i in range(calls):
        start = time.perf_counter()
        call(offset + i)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e6


def measure_step(shape: Shape | str, method: str, tokens: int, rounds: int = 7, calls: int = 10,
                 layers: int = 3, torch_dtype: torch.dtype = torch.bfloat16) -> StepRow:
    """One row; ``rounds`` x (torch alone, kt alone, step), ``calls`` timed calls each.
    ``shape``: a :class:`Shape` or a name of ``SHAPES``; the torch block is ``[tokens,
    hidden] x [hidden, hidden]`` in ``torch_dtype`` (the MoE call's input stays bf16)."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    packed = [layer.packed for layer in make_layers(shape, method, layers)]
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=generator).to(torch.bfloat16)
    torch_x = x.to(torch_dtype)
    # One set of projections per layer, as a model has: the torch block's weights (32 MiB
    # a layer, the size of a last-level cache) come from DRAM alone as inside a step.
    projections = [
        [(torch.randn(shape.hidden, shape.hidden, generator=generator) * 0.02).to(torch_dtype)
         for _ in range(ATTENTION_PROJECTIONS)]
        for _ in range(layers)
    ]
    routing = [random_routing(shape, tokens, generator) for _ in range(layers)]

    def attention(i: int) -> torch.Tensor:
        h = torch_x
        for w in projections[i % layers]:
            h = F.linear(h, w)
        return h

    def moe(i: int) -> torch.Tensor:
        ids, weights = routing[i % layers]
        return kt_ops.moe_forward(x, ids, weights, packed[i % layers])

    def step(i: int) -> torch.Tensor:
        attention(i)
        return moe(i)

    for call in (attention, moe, step):  # warm-up: code, scratch, thread start
        for i in range(3):
            call(i)
    torch_us, kt_us, step_us = [], [], []
    for r in range(rounds):
        torch_us.append(_median_us(attention, calls, r * calls))
        kt_us.append(_median_us(moe, calls, r * calls))
        step_us.append(_median_us(step, calls, r * calls))
    ratios = [s / (t + k) for t, k, s in zip(torch_us, kt_us, step_us)]
    return StepRow(shape.name, method, tokens, statistics.median(torch_us), statistics.median(kt_us),
                   statistics.median(step_us), statistics.median(ratios))


def format_steps(rows: list[StepRow]) -> str:
    width = max([7, *(len(r.method) for r in rows)])
    header = f"{'shape':5} {'method':{width}} {'tokens':>6} {'torch us':>9} {'kt us':>9} {'step us':>9} {'step/(torch+kt)':>16}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.shape:5} {r.method:{width}} {r.tokens:>6} {r.torch_us:>9.0f} {r.kt_us:>9.0f} {r.step_us:>9.0f} "
                     f"{r.ratio:>15.2f}x")
    return "\n".join(lines)
