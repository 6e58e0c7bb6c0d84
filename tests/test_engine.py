"""The worker engine: torch's threads by default (one pool, one thread count), kt_ops'
own pools on request, determinism across thread counts, concurrent callers, and no
spinning while idle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing


@pytest.fixture
def restore_threads():
    previous = kt_ops.get_num_threads()
    yield
    kt_ops.set_num_threads(previous)


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_set_and_get(restore_threads) -> None:
    """kt_ops' thread count is torch's: setting either sets both."""
    assert kt_ops.thread_source().startswith("torch intra-op threads")
    for n in (1, 2, 3):
        kt_ops.set_num_threads(n)
        assert kt_ops.get_num_threads() == n == torch.get_num_threads()
    torch.set_num_threads(2)
    assert kt_ops.get_num_threads() == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            kt_ops.set_num_threads(bad)


def test_absurd_thread_counts_are_refused(restore_threads) -> None:
    """torch's OpenMP pool segfaults when it cannot start the threads it is given (50000 on a
    2-core VM): kt_ops refuses more than 16 per CPU (at least 1024) before torch sees them, in
    Python and in the extension, and the count stays what it was."""
    limit = kt_ops.cpu.max_threads()
    assert limit == max(1024, 16 * os.sysconf("SC_NPROCESSORS_CONF"))
    kt_ops.set_num_threads(2)
    kt_ops.set_num_threads(np.int64(3))  # as torch.set_num_threads takes it
    assert kt_ops.get_num_threads() == 3
    kt_ops.set_num_threads(2)
    for bad in (limit + 1, 10**6, 2**31, np.int64(2**40)):  # 2**31 was pybind's TypeError
        with pytest.raises(ValueError, match=f"at most {limit}"):
            kt_ops.set_num_threads(bad)
        if bad < 2**31:  # what pybind can pass as an int
            with pytest.raises(ValueError, match=f"num_threads must be 1 ... {limit}"):
                kt_ops._native._C.set_num_threads(bad)
    assert kt_ops.get_num_threads() == 2 == torch.get_num_threads()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_for_really_runs_in_parallel(restore_threads, threads: int) -> None:
    """Jobs that wait for each other finish only if `threads` threads run them at once
    (an extension built without OpenMP would run torch's parallel_for serially: 1)."""
    from kt_ops._native import _C

    kt_ops.set_num_threads(threads)
    assert len(set(_C._engine_thread_ids(threads))) == threads
    assert len(set(_C._engine_thread_ids(1))) == 1


def test_kernels_run_on_torchs_threads(restore_threads) -> None:
    """One pool: the engine's jobs run on the very threads of torch's parallel_for; once
    torch has run a parallel op on 3 threads, kt_ops' kernels start no thread of their own;
    the process maps one OpenMP runtime (the extension's libgomp resolves to torch's copy).
    Own pools or a second libgomp fail here."""
    from kt_ops._native import _C

    kt_ops.set_num_threads(3)
    assert sorted(_C._engine_thread_ids(3)) == sorted(_C._torch_thread_ids(3))
    a = torch.randn(512, 512)
    torch.mm(a, a)  # torch's threads exist now
    experts = make_experts(8, 200, 136)
    ids, weights = random_routing(40, 8, 3)
    x = torch.randn(40, 200).bfloat16()
    before = task_count()
    for _ in range(3):
        kt_ops.moe_forward(x, ids, weights, experts.packed)
        torch.mm(a, a)
    assert task_count() == before
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_same_bits_for_any_thread_count(restore_threads) -> None:
    """Each output element is computed by one job, whichever thread runs it."""
    experts = make_experts(8, 200, 136)
    ids, weights = random_routing(70, 8, 3)
    x = torch.randn(70, 200).bfloat16()
    outputs = []
    for n in (1, 2, 3):
        kt_ops.set_num_threads(n)
        outputs.append(kt_ops.moe_forward(x, ids, weights, experts.packed))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("method", ["BF16", "AMXINT8", "AMXINT4", "FP8", "Q4_0"])
def test_down_jobs_wait_for_their_experts_gate_up(restore_threads, method: str) -> None:
    """Gate/up, the intermediate rows' preparation and down run as one parallel region, an
    expert's down jobs waiting only for its own gate/up jobs (csrc/cpu/kernels/
    expert_readiness.h): calls routed to 1-3 experts, whose down jobs start while other
    experts' gate/up jobs still run, give the one-thread bits on 2 and 3 threads (3 on a
    2-core machine: a waiting thread must not hold up the one it waits for), call after call.
    Q4_0 (GGUF keeps the phases, with a barrier between them) checks the other path."""
    experts = make_experts(4, 256, 384, seed=3)
    kwargs = {"method": "LLAMAFILE", "gguf_type": method} if method == "Q4_0" else {"method": method}
    packed = kt_ops.pack_experts(experts.gate, experts.up, experts.down, **kwargs)
    g = torch.Generator().manual_seed(5)
    cases = []
    for tokens, top_k in ((1, 1), (1, 2), (2, 3), (9, 2)):
        ids = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(tokens)])
        cases.append((torch.randn(tokens, 256, generator=g).bfloat16(), ids, torch.rand(tokens, top_k, generator=g)))
    kt_ops.set_num_threads(1)
    expected = [kt_ops.moe_forward(x, ids, w, packed) for x, ids, w in cases]
    for threads in (2, 3):
        kt_ops.set_num_threads(threads)
        for _ in range(25):
            for (x, ids, w), ref in zip(cases, expected):
                out = kt_ops.moe_forward(x, ids, w, packed)
                assert torch.equal(out, ref), f"{method}, {threads} threads, ids {ids.tolist()}"


def test_concurrent_callers_get_their_own_results() -> None:
    experts = make_experts(6, 96, 64)
    cases = []
    for seed in range(4):
        ids, weights = random_routing(5 + 7 * seed, 6, 2, seed=seed)
        x = torch.randn(5 + 7 * seed, 96)
        cases.append((x, ids, weights, kt_ops.moe_forward(x, ids, weights, experts.packed)))
    failures = []

    def worker(index: int) -> None:
        x, ids, weights, expected = cases[index]
        for _ in range(30):
            if not torch.equal(kt_ops.moe_forward(x, ids, weights, experts.packed), expected):
                failures.append(index)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.parametrize("threads", [1, 2])
def test_no_oversubscription(restore_threads, threads: int) -> None:
    """While a call runs, CPU time stays within threads x wall time (with one thread this
    proves no helper runs; with two on a 2-core machine the bound is physical, and
    test_one_thread_means_no_helpers counts the threads); once it returns, helpers stop
    spinning: well under 10% of a core over the next 300 ms."""
    kt_ops.set_num_threads(threads)
    experts = make_experts(16, 512, 384)
    ids, weights = random_routing(64, 16, 4)
    x = torch.randn(64, 512).bfloat16()
    kt_ops.moe_forward(x, ids, weights, experts.packed)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(10):
        kt_ops.moe_forward(x, ids, weights, experts.packed)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert cpu <= threads * wall * 1.1 + 0.01, f"{cpu:.3f} s CPU in {wall:.3f} s wall on {threads} thread(s)"
    time.sleep(0.05)  # past the spin window (torch's OpenMP threads spin a few ms at most)
    idle0 = time.process_time()
    time.sleep(0.3)
    idle = time.process_time() - idle0
    assert idle < 0.03, f"{idle:.3f} s of CPU burnt while idle"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_num_threads_environment_variable() -> None:
    result = run_python("import torch, kt_ops; print(kt_ops.get_num_threads(), torch.get_num_threads())",
                        KT_OPS_NUM_THREADS="3")
    assert result.returncode == 0 and result.stdout.strip() == "3 3", result.stderr
    result = run_python("import kt_ops; kt_ops.get_num_threads()", KT_OPS_NUM_THREADS="many")
    assert result.returncode != 0 and "KT_OPS_NUM_THREADS must be a positive integer" in result.stderr


@pytest.mark.slow
def test_environment_integers_out_of_range_are_refused() -> None:
    """A count beyond int is an error naming the variable, not its value modulo 2**32:
    KT_OPS_NUMA_SIMULATE=4294967298 simulated 2 nodes and KT_OPS_NUM_THREADS=4294967298
    ran 2 threads, silently (counts above 65536 and spins above 10 s are refused); 2147483648 failed in torch's set_num_threads ("Expected
    positive number of threads"), naming neither the variable nor the value."""
    code = "import kt_ops; print(kt_ops.get_num_threads(), len(kt_ops.numa.topology().nodes))"
    for name in ("KT_OPS_NUMA_SIMULATE", "KT_OPS_NUM_THREADS"):
        # 60000 threads: accepted before, and torch's pool segfaulted starting them
        for value in ("4294967298", "2147483648", "99999999999999999999") + (("60000",) if "THREADS" in name else ()):
            result = run_python(code, **{name: value})
            assert result.returncode != 0 and name in result.stderr, (name, value, result.stdout, result.stderr[-500:])


@pytest.mark.slow
def test_thread_pool_environment_variable() -> None:
    result = run_python("import kt_ops", KT_OPS_THREAD_POOL="mine")
    assert result.returncode != 0 and "KT_OPS_THREAD_POOL must be 'torch'" in result.stderr


OWN_POOLS = """
import os, torch, kt_ops
assert kt_ops.thread_source() == "kt_ops (own pinned pools)", kt_ops.thread_source()
tasks = lambda: len(os.listdir("/proc/self/task"))
kt_ops.set_num_threads(1)
one = tasks()
kt_ops.set_num_threads(3)
assert tasks() - one == 2, "own pools: the caller plus 2 helpers"
torch.set_num_threads(1)
print(kt_ops.get_num_threads())
"""
POOL_AGNOSTIC = "same_bits or concurrent or no_oversubscription or forked or really_runs"


@pytest.mark.slow
def test_own_pools_on_request() -> None:
    """KT_OPS_THREAD_POOL=own: kt_ops' own pinned helpers with their own thread count, and
    this file's pool-agnostic tests pass on them."""
    result = run_python(OWN_POOLS, KT_OPS_THREAD_POOL="own")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3", "own pools keep their own count"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             POOL_AGNOSTIC], env={**os.environ, "KT_OPS_THREAD_POOL": "own"}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


OWN_POOL_THREAD_LIMIT = """
import resource, kt_ops
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))  # room for ~30 8 MiB stacks
kt_ops.set_num_threads(2)
try:
    kt_ops.set_num_threads(200)
except RuntimeError as error:
    print("refused:", error)
import torch
x, ids, w = torch.randn(5, 64), torch.zeros(5, 1, dtype=torch.int64), torch.ones(5, 1)
g, u, d = torch.randn(1, 32, 64), torch.randn(1, 32, 64), torch.randn(1, 64, 32)
out = kt_ops.moe_forward(x, ids, w, kt_ops.pack_experts(g, u, d, method="BF16"))
print(f"still {kt_ops.get_num_threads()} threads:", "ok" if torch.isfinite(out).all() else "bad")
"""


@pytest.mark.slow
def test_own_pools_thread_creation_failure_is_an_error() -> None:
    """KT_OPS_THREAD_POOL=own: a pool the OS cannot start every helper of (KT_OPS_NUM_THREADS
    or set_num_threads beyond the process's thread or memory limits) is an exception, not an
    abort ("terminate called without an active exception", exit code -6: the helpers already
    started were not joined); the count stays what it was and the kernels still run."""
    result = run_python(OWN_POOL_THREAD_LIMIT, KT_OPS_THREAD_POOL="own")
    assert result.returncode == 0, (result.returncode, result.stderr[-500:])
    assert result.stdout.startswith("refused: kt_ops could not start helper thread "), result.stdout
    assert result.stdout.splitlines()[-1] == "still 2 threads: ok", result.stdout


OWN_POOL_BACKWARD = """
import torch, kt_ops
kt_ops.set_num_threads(2)
g = torch.Generator().manual_seed(0)
gate, up, down = (torch.randn(8, 64, 64, generator=g).bfloat16() for _ in range(3))
packed = kt_ops.pack_experts(gate, up, down)
for _ in range(3):
    x = torch.randn(7, 64, generator=g, requires_grad=True)
    w = torch.rand(7, 2, generator=g, requires_grad=True)
    kt_ops.moe_forward(x, torch.randint(0, 8, (7, 2), generator=g), w, packed).sum().backward()
print("done")
"""


@pytest.mark.slow
def test_own_pools_run_the_backward() -> None:
    """KT_OPS_THREAD_POOL=own: the backward's expert jobs decode weight rows with a nested
    parallel_for, which must run inline on whichever thread runs the job (as on torch's
    team); on a helper it waited for the engine's lock, held by the outer parallel_for
    waiting for that helper (hung in every run)."""
    try:
        result = subprocess.run([sys.executable, "-c", OWN_POOL_BACKWARD], env={**os.environ, "KT_OPS_THREAD_POOL": "own"},
                                capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the backward hung on kt_ops' own pools")
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]


def test_forked_child_can_run_kernels() -> None:
    """After fork() only the forking thread exists: the engine must not wait forever for
    threads the child does not have (its own helpers, or torch's OpenMP threads, whose next
    region hangs in a child), and keeps the thread count."""
    code = """
import os, signal, torch, kt_ops
kt_ops.set_num_threads(2)
g = torch.randn(4, 16, 32).bfloat16()
packed = kt_ops.pack_experts(g, g, g.transpose(1, 2).contiguous())
x, ids, w = torch.randn(5, 32), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
expected = kt_ops.moe_forward(x, ids, w, packed)
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    ok = torch.equal(kt_ops.moe_forward(x, ids, w, packed), expected) and kt_ops.get_num_threads() == 2
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0", "forked child hung or computed a different result"


def static_tls_bytes(library: str) -> int:
    """Bytes of the ELF PT_TLS segment (its memory size) of a 64-bit little-endian library."""
    import struct

    with open(library, "rb") as f:
        header = f.read(64)
        assert header[:4] == b"\x7fELF" and header[4] == 2 and header[5] == 1, library
        phoff, = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            entry = f.read(phentsize)
            p_type, = struct.unpack_from("<I", entry, 0)
            if p_type == 7:  # PT_TLS
                return struct.unpack_from("<Q", entry, 0x28)[0]
    return 0


def test_threads_entering_kt_ops_get_little_static_tls() -> None:
    """Every thread that runs kt_ops code (engine workers, torch's intra-op threads, each
    caller) gets the library's whole static TLS block allocated and zeroed: per-thread
    kernel buffers are heap memory allocated on a thread's first use (engine/scratch.h
    thread_buffer), not `thread_local` arrays, which made the block 3.26 MB per thread
    (~0.4 GB resident on a 128-thread server) until 2026-11-27; today ~10 KB."""
    from kt_ops import _C

    assert static_tls_bytes(_C.__file__) <= 64 << 10
