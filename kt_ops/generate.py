"""``kt-ops generate MODEL --prompt TEXT`` (``python -m kt_ops.generate``): the command a user runs first.

Loads a Hugging Face model directory with its routed experts packed while they load
(``from_pretrained(..., quantization_config=kt_ops.KtOpsConfig(method=...))``, the rest of
the model in ``--dtype`` on the CPU) — or a GGUF file (or a directory holding one and no
config.json) through :func:`kt_ops.from_gguf`, its experts run from the mapped file as
stored and its tokenizer read from the file (or ``--tokenizer``) — streams the greedy (or
sampled) continuation of the prompt to stdout, and prints prefill and decode tokens/s to
stderr at the end. Exit status 2 for a bad argument or a model it cannot load, 1 when
generation fails.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

DTYPES = ("bfloat16", "float16", "float32")
# check_row_lengths' suggestion (kt_ops.gguf_types), repeated in the command line's syntax.
_GGUF_SUGGESTION = re.compile(r"gguf_type=\('(\w+)', '(\w+)', '(\w+)'\)")


def gguf_type_arg(value: str) -> str | tuple[str, str, str]:
    """``--gguf-type``: one type for every matrix (``Q4_K``) or ``GATE,UP,DOWN``
    (``Q4_K,Q4_K,Q6_K``, as llama.cpp's Q4_K_M files store a layer)."""
    parts = [part.strip() for part in value.split(",")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) != 3 or not all(parts):
        raise argparse.ArgumentTypeError(
            f"takes one GGUF type or three, GATE,UP,DOWN (e.g. Q4_K,Q4_K,Q6_K); got {value!r}")
    return parts[0], parts[1], parts[2]


def build_parser(prog: str = "python -m kt_ops.generate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Generate text with a model whose experts run on kt_ops.")
    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face model directory (config, tokenizer, weights), or a GGUF file (or a "
                             "directory holding one and no config.json)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default="native",
                        help="the experts' kt_ops method (BF16, AMXINT8, AMXINT4, ...); default native: as the "
                             "checkpoint stores them (FP8/INT4/MXFP4 read in place, float packed as BF16)")
    parser.add_argument("--group-size", type=int, default=None, help="INT4 k-group (32, 64, 128)")
    parser.add_argument("--gguf-type", default=None, type=gguf_type_arg,
                        help="LLAMAFILE (implied when --method is not given): the GGUF type of every matrix "
                             "(e.g. Q4_K) or GATE,UP,DOWN (e.g. Q4_K,Q4_K,Q6_K)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the rest of the model's dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch's (and kt_ops') threads")
    parser.add_argument("--sample", action="store_true", help="sample (temperature 0.7) instead of greedy")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--tokenizer", default=None,
                        help="a Hugging Face tokenizer directory (default: MODEL's own; a GGUF's is read from the "
                             "file)")
    return parser


def gguf_model(model: str) -> Path | None:
    """The GGUF model ``model`` names (a ``.gguf`` file, or a directory with ``*.gguf`` files
    and no ``config.json``), else None (a Hugging Face directory)."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf")):
        return path
    return None


def _count(n: int, noun: str) -> str:
    """``"1 thread"``, ``"2 threads"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _has_tokenizer_files(directory: Path) -> bool:
    """Whether ``directory`` holds any file a Hugging Face tokenizer is read from (its
    configuration, vocabulary or model)."""
    return any(entry.name.startswith(("tokenizer", "vocab", "spiece", "merges")) or entry.suffix == ".tiktoken"
               for entry in directory.iterdir())


def _load_gguf(args: argparse.Namespace, path: Path, dtype: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a GGUF model: kt_ops.from_gguf, and the tokenizer the file
    carries (or ``--tokenizer``'s). UsageError for options that do not apply, or a file
    transformers cannot read."""
    import transformers

    import kt_ops
    from kt_ops.gguf_loader import gguf_files, read_gguf_config

    if args.method.lower() not in ("native", "llamafile") or args.gguf_type is not None or args.group_size is not None:
        raise UsageError("a GGUF model's experts run as the file stores them (method LLAMAFILE): --method, "
                         "--gguf-type and --group-size do not apply")
    try:
        file = gguf_files(path)[0]
        read_gguf_config(path)  # a file that is no GGUF MoE model says so (not "no tokenizer ... pass --tokenizer")
        if args.tokenizer is not None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        else:
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            except Exception as error:  # transformers raises several kinds for a GGUF without a tokenizer
                raise UsageError(f"{file}: no tokenizer transformers can read in this GGUF ({type(error).__name__}: "
                                 f"{error}); pass --tokenizer DIR (a Hugging Face tokenizer directory)") from None
        model = kt_ops.from_gguf(path, dtype=dtype).eval()
    except (OSError, ValueError) as error:
        raise UsageError(f"{args.model}: {error}") from None
    return model, tokenizer


class _Timing:
    """A streamer that prints decoded text as it comes and notes when each token arrived."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import TextStreamer

        self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True
        self.text.put(value)

    def end(self) -> None:
        self.text.end()


def run(args: argparse.Namespace) -> int:
    import torch

    import kt_ops
    from kt_ops._optional import require_transformers

    try:
        transformers = require_transformers("generate")  # "PROG: error: generate needs ..."
    except ImportError as error:
        raise UsageError(str(error)) from None

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.group_size is not None and args.group_size < 1:  # 0 read as 128, -32 as 4294967264 further down
        raise UsageError(f"--group-size must be 32, 64 or 128, got {args.group_size}")
    if args.threads is not None:
        if not 1 <= args.threads <= kt_ops.cpu.max_threads():
            raise UsageError(f"--threads must be 1 ... {kt_ops.cpu.max_threads()} (16 per CPU), got {args.threads}")
        torch.set_num_threads(args.threads)
    # --gguf-type alone means the GGUF method (the default, native, takes no type).
    native = args.method.lower() == "native"  # as _load_gguf and KtOpsConfig read it: "Native" too
    method = "LLAMAFILE" if args.gguf_type is not None and native else args.method
    pack: dict[str, Any] = {"method": method}
    if args.group_size is not None:
        pack["group_size"] = args.group_size
    if args.gguf_type is not None:
        pack["gguf_type"] = args.gguf_type
    local = Path(args.model).expanduser()
    if not local.exists() and (local.is_absolute() or args.model.startswith((".", "~"))):
        # a path, not a hub id: transformers would answer "Repo id must use alphanumeric chars"
        raise UsageError(f"{args.model}: no such file or directory")
    if args.tokenizer is not None:
        tokenizer_path = Path(args.tokenizer).expanduser()
        if not tokenizer_path.exists() and (tokenizer_path.is_absolute() or args.tokenizer.startswith((".", "~"))):
            raise UsageError(f"--tokenizer {args.tokenizer}: no such directory")  # else "Repo id must use ..."
        if tokenizer_path.exists() and not tokenizer_path.is_dir():  # else "Repo id must be in the form ..."
            raise UsageError(f"--tokenizer {args.tokenizer}: not a directory (a Hugging Face tokenizer directory)")
    from kt_ops.converted import is_converted

    if local.is_dir() and is_converted(local):  # else: transformers' error about missing expert tensors
        raise UsageError(f"{args.model}: a directory written by kt-ops convert holds the packed experts only (for "
                         "KTMoEWrapper(weight_path=...)); generate loads the model's Hugging Face checkpoint or a "
                         "GGUF file")
    gguf_path = gguf_model(args.model)
    if gguf_path is None and local.is_file():  # else transformers: "the config file ... is not a valid JSON file"
        raise UsageError(f"{args.model}: not a .gguf file; generate loads a GGUF file or a model directory "
                         "(config.json and its weights)")
    if gguf_path is None and local.is_dir() and not (local / "config.json").is_file():  # else a tokenizer error
        raise UsageError(f"{args.model}: a directory without config.json or *.gguf files; generate loads a GGUF file "
                         "or a model directory (config.json and its weights)")
    if gguf_path is not None:
        method = "LLAMAFILE"
        started = time.perf_counter()  # the tokenizer comes from the same file: timed with it
        model, tokenizer = _load_gguf(args, gguf_path, getattr(torch, args.dtype))
    else:
        source = Path(args.tokenizer or args.model).expanduser()
        if source.is_dir() and not _has_tokenizer_files(source):  # else "You need to have sentencepiece or ..."
            raise UsageError(f"{source}: no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model, "
                             "vocab.json ...); pass --tokenizer DIR (a Hugging Face tokenizer directory)")
        try:
            config = kt_ops.KtOpsConfig(**pack)
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        except (OSError, ValueError) as error:
            raise UsageError(str(error)) from None
        started = time.perf_counter()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                args.model, dtype=getattr(torch, args.dtype), quantization_config=config).eval()
        except (OSError, ValueError) as error:
            suggestion = _GGUF_SUGGESTION.search(str(error))
            hint = f" (on the command line: --gguf-type {','.join(suggestion.groups())})" if suggestion else ""
            raise UsageError(f"{args.model}: {error}{hint}") from None
        except RuntimeError as error:  # transformers: tensors whose sizes do not fit the config
            raise UsageError(f"{args.model}: cannot load the weights: {_load_problems(error, args.model)}") from None
    loaded = time.perf_counter()
    chat = args.chat and bool(getattr(tokenizer, "chat_template", None))
    if args.chat and not chat:
        print("note: the tokenizer has no chat template; --chat is ignored, the prompt goes in as it is",
              file=sys.stderr)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # v5: a dict anyway
    else:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0 and not args.prompt.strip():
        raise UsageError("--prompt is empty and this tokenizer adds no start token: give a prompt")
    if ids.shape[1] == 0:  # e.g. a directory without tokenizer files: transformers builds an empty one
        raise UsageError(f"the prompt encodes to no tokens with {type(tokenizer).__name__} ({len(tokenizer)} tokens in "
                         f"its vocabulary; does {args.tokenizer or args.model} hold tokenizer files?): pass "
                         "--tokenizer DIR")
    streamer = _Timing(tokenizer)
    sampling = {"do_sample": True, "temperature": 0.7} if args.sample else {"do_sample": False}
    begin = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = int(out.shape[1] - ids.shape[1])
    times = streamer.times
    prefill = (times[0] - begin) if times else float("nan")
    decode = (f"decode {(len(times) - 1) / (times[-1] - times[0]):.2f} tokens/s" if len(times) > 1
              else "no decode step to time")  # one new token: prefill only (was "decode nan tokens/s")
    print(file=sys.stderr)
    methods = getattr(getattr(model.config, "quantization_config", None), "packed_methods", None) or [method.upper()]
    print(f"kt_ops {'/'.join(methods)}: loaded in {loaded - started:.1f} s; prompt {_count(ids.shape[1], 'token')}, "
          f"prefill {ids.shape[1] / prefill:.1f} tokens/s ({prefill * 1e3:.0f} ms to the first token); "
          f"{_count(new, 'new token')}, {decode}; {_count(torch.get_num_threads(), 'thread')}, CPU variant "
          f"{kt_ops.cpu_variant()}", file=sys.stderr)
    return 0


def _load_problems(error: RuntimeError, model: str) -> str:
    """What ``from_pretrained``'s ``RuntimeError`` was about: each tensor whose size does not
    fit the model that config.json describes, with both sizes, from transformers' loading
    report (found in the traceback); else the error's own text."""
    info, frame = None, error.__traceback__
    while frame is not None:
        info = frame.tb_frame.f_locals.get("loading_info", info)
        frame = frame.tb_next
    problems = [f"{key} is {list(ckpt)} in the checkpoint but {list(model)} in the model its config.json describes"
                for key, ckpt, model in sorted(getattr(info, "mismatched_keys", None) or ())]
    for key, text in sorted((getattr(info, "conversion_errors", None) or {}).items()):
        said = [line for line in str(text).splitlines()  # a traceback (its frames indented), then what it said
                if line.strip() and not line[0].isspace() and not line.startswith("Traceback")]
        problems.append(f"{key}: " + " ".join(dict.fromkeys(said)))
    if getattr(info, "conversion_errors", None):
        problems += _odd_expert_shapes(model)
    return "; ".join(problems) if problems else " ".join(str(error).split())


def _odd_expert_shapes(model: str) -> list[str]:
    """Each routed-expert tensor of the checkpoint in ``model`` whose shape differs from
    expert 0's of the same matrix and layer (read from the safetensors headers only)."""
    try:
        from kt_ops.hf_checkpoint import HfCheckpoint

        checkpoint = HfCheckpoint(model)
        odd = []
        for layer in sorted(checkpoint.moe_layers()):
            where = checkpoint.layer(layer)
            if where.convention == "fused":
                continue
            for m in range(3):
                first = checkpoint._shape(where.key(m, 0))
                odd += [f"{where.key(m, e)} is {list(checkpoint._shape(where.key(m, e)))}, expert 0's {list(first)}"
                        for e in range(1, where.num_experts) if checkpoint._shape(where.key(m, e)) != first]
        return odd
    except Exception:  # noqa: BLE001 - only a hint: transformers' own message stands
        return []


class UsageError(Exception):
    """A bad argument or a model that cannot be loaded (exit status 2)."""


def main(argv: Sequence[str] | None = None, prog: str = "python -m kt_ops.generate") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # Ctrl-C: exit status 130 and one line, no traceback
    from kt_ops.cli import run_program

    sys.exit(run_program(main, "python -m kt_ops.generate"))
