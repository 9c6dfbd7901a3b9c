"""Export a trained TrunkWithMTP to a Hugging Face directory (bf16 safetensors incl. ``mtp.*``)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from .tokenizer import EOT, IM_END


def export_model(model, tok_dir: str, out_dir: str, meta: dict | None = None, dtype=torch.bfloat16) -> None:
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config.to_dict()
    for k in ("_attn_implementation", "_attn_implementation_autoset", "transformers_version",
              "_name_or_path", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    cfg["architectures"] = ["Qwen3_5ForCausalLM" if model.arch == "qwen3_5_text" else "Qwen3ForCausalLM"]
    cfg["mtp_num_hidden_layers"] = len(model.mtp.layers)
    cfg["torch_dtype"] = "bfloat16"
    cfg["use_cache"] = True
    cfg["rms_norm_convention"] = "zero_centered (1+w)" if model.arch == "qwen3_5_text" else "plain (w)"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.export_state_dict().items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, fn), os.path.join(out_dir, fn))
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    ids = {v["content"]: int(k) for k, v in tcfg["added_tokens_decoder"].items()}
    gen = {"eos_token_id": [ids[EOT], ids[IM_END]], "pad_token_id": ids[EOT], "do_sample": False,
           "max_new_tokens": 128}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    if meta is not None:
        keep = {k: v for k, v in meta.items() if k not in ("history",)}
        with open(os.path.join(out_dir, "training_summary.json"), "w") as f:
            json.dump(keep, f, indent=1, default=str)
