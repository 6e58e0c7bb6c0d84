"""Converts a Hugging Face MoE checkpoint's routed experts to packed INT8/INT4/FP8/MXFP4 CPU weights.

    python -m kt_ops.convert --input-path DIR --input-type bf16|fp16|fp8|int4|mxfp4 --output DIR \\
        --quant-method int8|int4|fp8|fp8_perchannel|mxfp8|rawint4|gptq_int4|awq_int4|mxfp4 [--group-size 128] \\
        [--threadpool-count N] [--no-merge-safetensor] [--resume-layer L] [--layers START-END|L]

(``scripts/convert_cpu_weights.py`` is the same program.) One layer at a time: its
experts are read (an FP8 input dequantized with its scales: 128 x 128 blocks, per channel
or MXFP8), quantized by :func:`kt_ops.pack_experts`, except that an FP8 input written as
its own FP8 method is re-tiled in place (:func:`kt_ops.pack_fp8_experts`: its bytes kept) and an
INT4 checkpoint (``--input-type int4``: RAWINT4, GPTQ or AWQ tensors) converts only to its
own method, its nibbles copied (:mod:`kt_ops.hf_int4`), and an MXFP4 checkpoint (``--input-type mxfp4``:
gpt-oss or DeepSeek-V4-Flash) only to ``--quant-method mxfp4``, its codes kept and its
activation and biases in the packed headers (:mod:`kt_ops.hf_mxfp4`), written to ``layer-{L:05d}.safetensors`` (atomically) and
verified — the file re-read and compared byte for byte, and one expert's output through
the kernel compared with the fp32 reference on the source weights (a layer that fails is
deleted, so neither a rerun nor ``--resume-layer`` takes it for written). At the end the layer
files are merged into ``model-0000i-of-0000N.safetensors`` shards (unless
``--no-merge-safetensor``), ``model.safetensors.index.json``, ``kt_ops_manifest.json``
and the source ``config.json`` are written; every file goes to disk under a temporary name
and is renamed, so a crash at any point loses at most the layer being written
(kt_ops/convert_merge.py). ``--resume-layer L`` keeps the layers below L (in layer files
or merged shards) and continues from L (a finished conversion so converted again keeps its manifest, and
loads as before, until the new files are in place); a new conversion that fails before its first layer
is done removes what it wrote (its manifest, the output directory if it made it), so a
rerun starts afresh. A run holds an exclusive lock on the output directory (``flock``, released
by the OS when the run ends, killed or not): a second run on the same ``--output`` meanwhile
is refused (exit 2) instead of interleaving its writes with the first's. The output may not be, contain or lie inside the input directory. See kt_ops/converted.py for the
format. Exit status 2 for a bad argument or path (found before anything is written: the
input is not a checkpoint, ``--layers`` matches no layer, ``--input-type`` is not what the
tensors hold, ``--threadpool-count`` does not split I into parts the format takes, the
output holds another conversion or overlaps the input, ...), 1 when a
conversion step fails or a file cannot be read or written; the last stderr line says why.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kt_ops import reference
from kt_ops.convert_merge import (index_layer_files, layer_sources, merge_layers, missing_layers, save_durably,
                                  write_text_durably)
from kt_ops.converted import INDEX, MANIFEST, Manifest, layer_file, layer_key
from kt_ops.cpu import max_threads
from kt_ops.formats import GROUPED_FORMATS, default_group_size, format_for_method, format_info
from kt_ops.hf_checkpoint import HfCheckpoint, config_layer_count, read_config_json, whole_number, with_text_config
from kt_ops.hf_int4 import Int4Experts, int4_method, load_int4_experts
from kt_ops.hf_int8 import is_int8_layer
from kt_ops.hf_mxfp4 import MXFP4_GROUP, Mxfp4Experts, load_mxfp4_experts, mxfp4_layers, pack_mxfp4_parts
from kt_ops.inspection import layer_ranges
from kt_ops.ops import moe_forward
from kt_ops.packed import PackedExperts
from kt_ops.parts import FP8_KIND_METHODS, activate_parts, pack_fp8_parts, pack_int4_parts, pack_parts

METHODS = {"int8": "AMXINT8", "int4": "AMXINT4", "fp8": "FP8", "fp8_perchannel": "FP8_PERCHANNEL", "mxfp8": "MXFP8",
           "rawint4": "RAWINT4", "gptq_int4": "GPTQ_INT4", "awq_int4": "AWQ_INT4", "mxfp4": "MXFP4"}
# --input-type -> the stored dtype of the expert weights ("int4": an INT4 checkpoint's own tensors;
# "mxfp4": an MXFP4 checkpoint's, gpt-oss or DeepSeek-V4-Flash, kt_ops/hf_mxfp4.py).
INPUT_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "int4": None, "mxfp4": None}
MAX_SHARD_BYTES = 4 << 30
# Verification bound: one expert through the kernel vs the fp32 reference on the source
# weights (quantization error included: int8 ~3%, int4 ~15-20%, e4m3 ~3-5% on Gaussian
# weights; an FP8 input kept in place: the bf16 activations only).
VERIFY_BOUND = {"int8": 0.1, "int4": 0.45, "fp8": 0.1, "fp8_perchannel": 0.1, "mxfp8": 0.1, "rawint4": 0.45,
                "gptq_int4": 0.45, "awq_int4": 0.45, "mxfp4": 0.45}
# An INT4 checkpoint kept in place: the kernel vs the oracle on the checkpoint's own weights.
VERIFY_IN_PLACE = 0.1


class ConversionError(Exception):
    """A conversion step failed; the message says which layer and why."""


class UsageError(ConversionError):
    """A bad argument or path, found before anything was written (exit status 2)."""


def build_parser(prog: str = "python -m kt_ops.convert") -> argparse.ArgumentParser:
    """The converter's options; ``prog`` names the command in usage lines (``kt-ops convert``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-path", required=True, help="Hugging Face model directory (*.safetensors)")
    parser.add_argument("--input-type", required=True, choices=sorted(INPUT_TYPES))
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--quant-method", required=True, choices=sorted(METHODS))
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4 k-group for online quantization (32, 64, 128; default 128, rawint4 32)")
    parser.add_argument("--threadpool-count", type=int, default=1,
                        help="split each expert's intermediate dimension in N parts (KTMoEWrapper threadpool_count)")
    parser.add_argument("--cpuinfer-threads", type=int, default=None, help="kernel threads = torch's intra-op threads (default: torch's, the physical cores)")
    parser.add_argument("--no-merge-safetensor", action="store_true", help="keep one file per layer")
    parser.add_argument("--resume-layer", type=int, default=None, help="continue from this layer")
    parser.add_argument("--layers", default=None, help="only layers START-END (inclusive), or one layer")
    return parser


def layer_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    parts = text.split("-")
    try:
        if len(parts) > 2:
            raise ValueError(text)
        start, end = int(parts[0]), int(parts[-1])  # one layer: START = END
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected START-END or one layer, e.g. 0-47 or 5") from None
    if start < 0 or end < start:
        raise UsageError(f"--layers {text!r}: need 0 <= START <= END")
    return start, end


def progress_bar(total: int) -> tqdm:
    """One stderr line: the layer being converted, a bar, layers done, layers/s, ETA."""
    return tqdm(total=total, desc="converting", unit=" layers", file=sys.stderr,
                bar_format="{desc} |{bar:30}| {n_fmt}/{total_fmt} layers  {rate_fmt}  ETA {remaining}")


def config_count(config: dict, keys: tuple[str, ...]) -> int | None:
    """The first of config.json's ``keys`` that is set (not null, 0 or "") as a positive int
    (a whole float such as ``128.0`` or a numeric string taken); None when none is set.
    ``ValueError`` naming the key for any other value (``-1``, ``1.5``, ``"abc"``, ``true``):
    truncated or negative, it converted the wrong experts or failed later naming nothing."""
    for key in keys:
        value = config.get(key)
        if not value:
            continue
        count = whole_number(value)
        if count is None or count < 1:
            raise ValueError(f"{key} {value!r} is not a positive whole number")
        return count
    return None


def model_sizes(checkpoint: HfCheckpoint, config: dict, first: int) -> tuple[int, int, int]:
    """(E, H, I) from config.json, falling back to the first layer's tensors; ``ValueError``
    naming the key for a config.json value that is no count (:func:`config_count`)."""
    where = checkpoint.layer(first)
    experts = config_count(config, ("n_routed_experts", "num_experts", "num_local_experts")) or where.num_experts
    if experts < where.num_experts:  # converted as config.json says, but not silently: a router of the file's size
        print(f"note: config.json gives {experts} routed experts but layer {first} of the checkpoint holds "
              f"{where.num_experts}; converting experts 0-{experts - 1} only", file=sys.stderr)
    hidden = config_count(config, ("hidden_size",))
    inter = config_count(config, ("moe_intermediate_size", "intermediate_size"))
    if (hidden is None or inter is None) and where.suffix != "weight":
        raise UsageError(f"{checkpoint.path}/config.json must give hidden_size and moe_intermediate_size for an "
                         "INT4 checkpoint (its packed tensors do not show them)")
    if hidden is None or inter is None:
        try:
            shape = checkpoint.tensor_info(where.key(2))[1]
        except KeyError as error:  # the sizes come from this tensor: a usage error, naming it
            raise UsageError(f"--input-path: {error.args[0]}") from None
        hidden, inter = shape[-2], shape[-1]
    return experts, int(hidden), int(inter)


def verify_layer(path: Path, layer: int, parts: list[PackedExperts], gate: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, bound: float, swiglu_limit: float = 0.0, swiglu_alpha: float = 0.0,
                 biases: tuple | None = None) -> None:
    """Re-reads the layer file and compares it with what was packed, then checks one
    expert's kernel output against the fp32 reference on the source weights (with the
    layer's activation and biases, where the parts carry them)."""
    with safe_open(os.fspath(path), framework="pt") as handle:
        for part, packed in enumerate(parts):
            stored = handle.get_tensor(layer_key(layer, part))
            PackedExperts(stored)  # header and checksum
            if not torch.equal(stored, packed.data):
                raise ConversionError(f"layer {layer}: {path.name} part {part} differs from the packed weights")
    E, H = gate.shape[0], gate.shape[2]
    expert = layer % E
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(4, H, generator=g)
    ids = torch.full((4, 1), expert, dtype=torch.int32)
    weights = torch.ones(4, 1)
    out = sum(moe_forward(x, ids, weights, packed) for packed in parts)
    one = None if biases is None else tuple(None if b is None else b[expert:expert + 1] for b in biases)
    ref = reference.moe_forward(x, torch.zeros_like(ids), weights, gate[expert:expert + 1],
                                up[expert:expert + 1], down[expert:expert + 1], swiglu_limit=swiglu_limit,
                                swiglu_alpha=swiglu_alpha, biases=one)
    err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    if not err <= bound:
        raise ConversionError(f"layer {layer}: expert {expert} through the kernel is {err:.3g} from the reference "
                              f"(bound {bound}); the written weights are wrong")


def mxfp4_sizes(config: dict) -> tuple[int, int, int]:
    """(E, H, I) of an MXFP4 checkpoint from config.json (gpt-oss: num_local_experts,
    hidden_size, intermediate_size; DeepSeek-V4: n_routed_experts, moe_intermediate_size); ``ValueError``
    naming the key for a value that is no count (:func:`config_count`)."""
    experts = config_count(config, ("n_routed_experts", "num_local_experts", "num_experts"))
    hidden = config_count(config, ("hidden_size",))
    inter = config_count(config, ("moe_intermediate_size", "intermediate_size"))
    if experts is None or hidden is None or inter is None:
        raise UsageError("config.json must give the expert count, hidden_size and the experts' intermediate size "
                         "for an MXFP4 checkpoint")
    return int(experts), int(hidden), int(inter)


def mxfp4_weights(experts: Mxfp4Experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MXFP4 layer's weights as fp32 ``[E, N, K]``, decoded in plain torch from its GGUF
    blocks (the verification's reference weights)."""
    return tuple(reference.dequantize_mxfp4(m, m.shape[-1] // 17 * MXFP4_GROUP)
                 for m in (experts.gate, experts.up, experts.down))


def int4_weights(experts: Int4Experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An INT4 layer's weights as fp32 ``[E, N, K]``, unpacked in plain torch from what
    :func:`load_int4_experts` read (the verification's reference weights)."""
    out = []
    for m, nibbles in enumerate((experts.gate, experts.up, experts.down)):
        q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(*nibbles.shape[:-1], -1).float()
        scale = experts.scales[m].repeat_interleave(experts.group_size, dim=-1)
        if experts.minimums is None:
            out.append(scale * (q - 8))
        else:
            out.append(scale * q + experts.minimums[m].repeat_interleave(experts.group_size, dim=-1))
    return out[0], out[1], out[2]


def foreign_model_files(out: Path) -> list[str]:
    """The files of directory ``out`` a conversion writes over (``config.json``, the
    safetensors index, ``*.safetensors``) when ``out`` holds no kt_ops conversion (no
    manifest: they belong to someone else, e.g. another model); empty otherwise."""
    if not out.is_dir() or (out / MANIFEST).is_file():
        return []
    return sorted(p.name for p in out.iterdir()
                  if p.is_file() and (p.name in ("config.json", INDEX) or p.suffix == ".safetensors"))


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[bool]:
    """Creates ``out`` (and its parents) if need be and holds an exclusive ``flock`` on it
    until the block ends; yields whether this call created it, which is removed again, if
    empty, when the block raises a :class:`UsageError`. ``UsageError`` naming ``out`` when
    another run holds the lock. The OS releases a lock when its process ends, so a killed
    run never leaves one behind. A filesystem without ``flock`` (some network mounts) runs
    unlocked, with a note on stderr."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"--output {out} is being written by another conversion run (it holds the directory's "
                             "lock); wait for it to finish or choose another --output") from None
        except OSError as error:
            print(f"note: --output {out}: cannot lock it ({error.strerror or error}); make sure no other "
                  "conversion writes there at the same time", file=sys.stderr)
        try:
            yield created
        except UsageError:
            if created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            raise
    finally:
        os.close(fd)  # releases the lock


def convert(args: argparse.Namespace) -> Path:
    with contextlib.ExitStack() as stack:
        return _convert(args, stack)


def _convert(args: argparse.Namespace, stack: contextlib.ExitStack) -> Path:
    source = Path(args.input_path)
    out = Path(args.output)
    method = METHODS[args.quant_method]
    fmt = format_for_method(method)
    sizes = format_info(fmt).group_sizes
    if args.group_size is not None and not sizes:  # kt-kernel's converter ignores it too: say so
        print(f"note: --group-size {args.group_size} does not apply to {args.quant_method} (no k-groups: "
              f"{'one scale per row' if fmt in ('int8', 'fp8_perchannel') else 'its own fixed blocks'}); ignored",
              file=sys.stderr)
    if args.group_size is None:
        args.group_size = default_group_size(method)
    if args.threadpool_count < 1:
        raise UsageError(f"--threadpool-count must be >= 1, got {args.threadpool_count}")
    if args.cpuinfer_threads is not None and not 1 <= args.cpuinfer_threads <= max_threads():
        raise UsageError(f"--cpuinfer-threads must be 1 ... {max_threads()} (16 per CPU), got {args.cpuinfer_threads}")
    if args.resume_layer is not None and args.resume_layer < 0:
        raise UsageError(f"--resume-layer must be a layer index >= 0, got {args.resume_layer}")
    if sizes and args.group_size not in sizes:
        raise UsageError(f"--group-size {args.group_size}: {fmt} takes {', '.join(map(str, sizes))}")
    if not source.is_dir():
        raise UsageError(f"--input-path {source}: {'not a directory' if source.exists() else 'no such directory'}")
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise UsageError(f"--output {out} is, contains or lies inside --input-path {source}; "
                         "write the conversion to a separate directory")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {out} exists and is not a directory")
    foreign = foreign_model_files(out)
    if foreign:
        raise UsageError(f"--output {out} holds another model's files ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}) and no kt_ops conversion; converting there would "
                         "overwrite them: choose a new or empty directory")
    mxfp4_input = args.input_type == "mxfp4"
    if mxfp4_input and args.quant_method != "mxfp4":
        raise UsageError(f"--input-type mxfp4 converts only to --quant-method mxfp4 (its codes kept), not "
                         f"{args.quant_method}")
    try:
        checkpoint = HfCheckpoint(source)
        mx_layers = mxfp4_layers(checkpoint)
        if mx_layers and not mxfp4_input:
            raise UsageError(f"--input-path {source} holds MXFP4 experts: use --input-type mxfp4 --quant-method mxfp4")
        moe_layers = mx_layers if mxfp4_input else sorted(checkpoint.moe_layers())
        if not moe_layers:
            raise UsageError(f"--input-path {source}: no routed-expert tensors found"
                             + (" in the MXFP4 layouts (gpt-oss, DeepSeek-V4-Flash)" if mxfp4_input else ""))
        bounds = layer_range(args.layers)
        layers = [L for L in moe_layers if bounds is None or bounds[0] <= L <= bounds[1]]
        if not layers:
            raise UsageError(f"--layers {args.layers}: no layer with experts there (layers with experts: "
                             f"{layer_ranges(moe_layers)})")
        int4 = {layer: None if mxfp4_input else int4_method(checkpoint, layer) for layer in layers}
        int8 = [layer for layer in layers
                if not mxfp4_input and int4[layer] is None and is_int8_layer(checkpoint, layer)]
        if int8:
            raise UsageError(f"--input-path {source}: layer {int8[0]} holds INT8 experts (int8 levels with per-row "
                             "scales, W8A8), which KTMoEWrapper(method='AMXINT8', weight_path=...) and "
                             "KtOpsConfig(method='native') read in place as they are; the converter does not take them")
        stored = {layer: "MXFP4" if mxfp4_input else int4[layer] or checkpoint.dtype(layer) for layer in layers}
    except (FileNotFoundError, KeyError, ValueError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise UsageError(f"--input-path: {message}") from None
    want = INPUT_TYPES[args.input_type]
    wrong = [] if mxfp4_input else [layer for layer in layers if (int4[layer] is not None) != (want is None)
                                    or (want is not None and stored[layer] != want)]
    if wrong:
        raise UsageError(f"--input-type {args.input_type}, but layer {wrong[0]}'s tensors are {stored[wrong[0]]}")
    in_place = want is None and not mxfp4_input  # an INT4 checkpoint's nibbles
    if in_place and any(int4[layer] != method for layer in layers):
        held = next(int4[layer] for layer in layers if int4[layer] != method)
        raise UsageError(f"--quant-method {args.quant_method}: the checkpoint holds {held} experts, which convert only "
                         f"to their own method (--quant-method {held.lower()})")
    config_file = source / "config.json"
    try:
        config = with_text_config(read_config_json(source))
        E, H, I = mxfp4_sizes(config) if mxfp4_input else model_sizes(checkpoint, config, layers[0])
        num_layers = config_layer_count(config, source)  # null: not given, as for the sizes
        if num_layers is None:
            num_layers = moe_layers[-1] + 1
    except (TypeError, ValueError) as error:  # not JSON, or a size that is not a number
        raise UsageError(f"--input-path: {error}" if str(config_file) in str(error) else
                         f"--input-path: {config_file}: {error}") from None
    if I % args.threadpool_count:
        raise UsageError(f"--threadpool-count {args.threadpool_count} must divide moe_intermediate_size {I}")
    part_size = I // args.threadpool_count
    if fmt == "mxfp4" and part_size % MXFP4_GROUP:
        raise UsageError(f"--threadpool-count {args.threadpool_count} splits moe_intermediate_size {I} into parts of "
                         f"{part_size}; mxfp4 needs parts of a multiple of {MXFP4_GROUP}")
    grouped = fmt in GROUPED_FORMATS  # int4, int4_asym; mxfp4 (its group fixed at 32)
    if grouped and not in_place and (H % args.group_size or I % args.group_size):
        raise UsageError(f"--group-size {args.group_size} must divide hidden_size {H} and moe_intermediate_size {I}")
    if grouped and not in_place and part_size % args.group_size:
        raise UsageError(f"--threadpool-count {args.threadpool_count} splits moe_intermediate_size {I} into parts of "
                         f"{part_size}, which --group-size {args.group_size} does not divide")
    group = args.group_size if grouped else 0
    pack_args = {"group_size": args.group_size} if grouped else {}
    # A checkpoint's own INT4 or FP8 bytes decide the format and group (INT4) and which
    # splits work: probed on expert 0 of the first layer before anything is written.
    fp8_in_place = not in_place and not mxfp4_input and fmt in FP8_KIND_METHODS and \
        checkpoint.fp8_kind(layers[0]) == fmt
    if in_place or fp8_in_place:
        try:
            if in_place:
                probe = pack_int4_parts(load_int4_experts(checkpoint, layers[0], [0], H, I, method),
                                        args.threadpool_count)[0]
                fmt, group = probe.format, probe.group_size
            else:
                pack_fp8_parts(checkpoint.load_fp8_experts(layers[0], [0], H, I), args.threadpool_count)
        except (KeyError, ValueError) as error:
            message = str(error.args[0] if error.args else error)
            raise UsageError(message if message.startswith("threadpool_count") else f"--input-path: {message}") from None
    if args.cpuinfer_threads is not None:
        from kt_ops.cpu import set_num_threads

        set_num_threads(args.cpuinfer_threads)
    manifest = Manifest(args.quant_method, fmt, group, num_layers,
                        tuple(layers), E, H, I, args.threadpool_count, False,
                        {"path": os.fspath(source.resolve()), "input_type": args.input_type,
                         "model_type": config.get("model_type")})
    # From here to the end no other run may look at or write the directory.
    created = stack.enter_context(output_lock(out))
    if (out / MANIFEST).is_file():
        try:
            old = Manifest.read(out)
        except (OSError, ValueError) as error:  # damaged, or another format version: nothing written yet
            raise UsageError(f"--output {out}: {error}; choose another --output") from None
        settings = ("format", "group_size", "num_experts", "hidden_size", "intermediate_size", "threadpool_count")
        changed = [s for s in settings if getattr(old, s) != getattr(manifest, s)]
        # The layers kept must come from the same model: another checkpoint of the same sizes
        # would leave a directory mixing two models' experts under one manifest.
        before = {k: old.source.get(k) for k in ("path", "input_type")}
        other_source = before["path"] is not None and before != {k: manifest.source[k] for k in before}
        if args.resume_layer is None:
            kind = "a finished conversion" if old.complete else "an unfinished conversion"
            if changed or other_source:  # no --resume-layer to suggest: it would be refused below
                made = (f"different {', '.join(changed)}" if changed else
                        f"--input-path {before['path']} (--input-type {before['input_type']})")
                raise UsageError(f"--output {out} already holds {kind} made with {made}, which this run cannot "
                                 "resume; choose another --output")
            on_disk = layer_sources(out, layers, args.threadpool_count)
            todo_first = next((L for L in layers if L not in on_disk), None)
            state = kind + (
                f" (layers before {todo_first} written: continue with --resume-layer {todo_first})"
                if todo_first is not None and todo_first != layers[0] else
                f" (every layer written: finish it with --resume-layer {layers[-1] + 1})"
                if todo_first is None and not old.complete else "")
            raise UsageError(f"--output {out} already holds {state}; use --resume-layer L or another --output")
        if changed:
            raise UsageError(f"--output {out}: cannot resume, the earlier run used different {', '.join(changed)}")
        dropped = sorted(layer_sources(out, [L for L in old.layers if L not in layers], old.threadpool_count))
        if dropped:  # the merge would rewrite the shards without them: converted layers silently lost
            raise UsageError(f"--output {out}: the earlier run converted layer(s) {', '.join(map(str, dropped))}, which "
                             f"--layers {args.layers} leaves out; resuming would drop them from the directory: give "
                             f"--layers covering them (e.g. {min(old.layers[0], layers[0])}-"
                             f"{max(old.layers[-1], layers[-1])}) or another --output")
        if other_source:
            raise UsageError(f"--output {out}: cannot resume, the earlier run converted --input-path {before['path']} "
                             f"(--input-type {before['input_type']}), not {manifest.source['path']} "
                             f"(--input-type {args.input_type}); its layers would be mixed with this model's")
    todo = [L for L in layers if args.resume_layer is None or L >= args.resume_layer]
    kept = [L for L in layers if L not in todo]
    found = layer_sources(out, kept, args.threadpool_count) if kept else {}
    missing = [L for L in kept if L not in found]
    if missing:
        raise UsageError(f"--resume-layer {args.resume_layer}: {missing_layers(out, missing)}")
    fresh = not (out / MANIFEST).is_file()
    if fresh or not old.complete:  # a finished conversion's manifest stays until its files are replaced: a run
        manifest.write(out)        # interrupted before that (Ctrl-C) leaves it loading as it did
    done: list[int] = []
    try:
        _convert_layers(args, checkpoint, out, todo, layers, E, H, I, method, fmt, group, in_place, mxfp4_input,
                        pack_args, done)
    except BaseException:
        if fresh and todo and not done:  # a rerun starts clean, not with "already holds a conversion"
            _forget_failed_start(out, todo[0], created)
        raise
    if args.no_merge_safetensor:
        keys = index_layer_files(out, layers, args.threadpool_count)
    else:
        keys = merge_layers(out, layers, args.threadpool_count, MAX_SHARD_BYTES)
    if config_file.is_file():  # under a temporary name too: a crash mid-copy leaves no truncated config.json
        write_text_durably(out / "config.json", config_file.read_text(encoding="utf-8"))
    Manifest(**{**manifest.__dict__, "complete": True}).write(out)
    return out


def _forget_failed_start(out: Path, first: int, created: bool) -> None:
    """Removes what a fresh conversion that failed on its first layer wrote: the manifest,
    that layer's file, and ``out`` itself when this run created it and it is empty."""
    (out / MANIFEST).unlink(missing_ok=True)
    (out / layer_file(first)).unlink(missing_ok=True)
    if created and not any(out.iterdir()):
        out.rmdir()


def _convert_layers(args: argparse.Namespace, checkpoint: HfCheckpoint, out: Path, todo: list[int], layers: list[int],
                    E: int, H: int, I: int, method: str, fmt: str, group: int, in_place: bool, mxfp4_input: bool,
                    pack_args: dict, done: list[int]) -> None:
    """Converts, writes and verifies each layer of ``todo`` (one layer file each), appending
    each finished layer to ``done``; a layer file that fails verification is deleted."""
    with progress_bar(len(todo)) as progress:
        for layer in todo:
            progress.set_description_str(f"layer {layer}")
            bound = VERIFY_BOUND[args.quant_method]
            activation: tuple = (0.0, 0.0, None)
            if mxfp4_input:  # an MXFP4 checkpoint's own codes, with its activation and biases
                mx = load_mxfp4_experts(checkpoint, layer, range(E), H, I)
                activation = (mx.swiglu_limit, mx.swiglu_alpha, mx.biases)
                parts = activate_parts(pack_mxfp4_parts(mx, args.threadpool_count), *activation)
                gate, up, down = mxfp4_weights(mx)
                bound = VERIFY_IN_PLACE
            elif in_place:  # an INT4 checkpoint's own nibbles
                experts = load_int4_experts(checkpoint, layer, range(E), H, I, method)
                parts = pack_int4_parts(experts, args.threadpool_count)
                if (parts[0].format, parts[0].group_size) != (fmt, group):
                    raise ConversionError(f"layer {layer} is {parts[0].format} in groups of {parts[0].group_size}; "
                                          f"layer {layers[0]} was {fmt} in groups of {group} (one format per model)")
                gate, up, down = int4_weights(experts)
                bound = VERIFY_IN_PLACE
            else:
                gate, up, down = checkpoint.load_experts(layer, range(E), H, I)
                if fmt in FP8_KIND_METHODS and checkpoint.fp8_kind(layer) == fmt:  # the checkpoint's own bytes
                    parts = pack_fp8_parts(checkpoint.load_fp8_experts(layer, range(E), H, I), args.threadpool_count)
                else:
                    parts = pack_parts(gate, up, down, method, args.threadpool_count, **pack_args)
            path = out / layer_file(layer)
            tensors = {layer_key(layer, p): packed.data for p, packed in enumerate(parts)}
            save_durably(tensors, path)
            try:
                verify_layer(path, layer, parts, gate, up, down, bound, *activation)
            except BaseException:  # not written: a rerun's hint and --resume-layer would keep the wrong file
                path.unlink(missing_ok=True)
                raise
            del gate, up, down, parts, tensors
            done.append(layer)
            progress.update()


def main(argv: list[str] | None = None, prog: str = "python -m kt_ops.convert") -> int:
    """Runs the converter on ``argv`` (default ``sys.argv[1:]``); returns the exit status:
    0 done, 2 a bad argument or path (argparse's own errors raise ``SystemExit(2)``),
    1 a failed conversion step. ``prog`` names the command in messages."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        out = convert(args)
    except UsageError as error:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except (ConversionError, KeyError, ValueError, OSError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # Ctrl-C: exit status 130 and one line, no traceback
    from kt_ops.cli import run_program

    sys.exit(run_program(main, "python -m kt_ops.convert"))
