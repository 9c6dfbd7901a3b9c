"""How much context fits a memory budget, per KV type, with and without MTP / a draft model.

The estimate adds up, for one sequence:

* weights: trunk incl. embeddings and lm_head (tied embeddings counted once), the MTP module when it is on,
  a draft model when one is given; read from safetensors headers / GGUF tensor tables without loading data,
  or computed from the architecture numbers of a config.json or a preset;
* attention KV: layers x KV heads x ctx x (K bytes + V bytes per vector of the chosen formats, exact,
  from ``turbospec.kv.formats``); only full-attention layers have KV in hybrid (Gated DeltaNet) models;
* recurrent state of the Gated DeltaNet layers (conv window (kernel-1) x conv_dim + SSM HV x Dk x Dv f32),
  plus the per-position state copies a speculative chain of n_max drafts keeps for rollback;
* the MTP layer's own KV and the draft model's KV, in the draft KV types;
* activation / compute buffers for one ubatch (hidden, QKV, MLP intermediates, attention block scratch,
  logits rows x vocab x 4);
* a runtime baseline (CPU: the resident size of the Python + torch + turbospec process before a model is
  loaded; CUDA: a context estimate).

Backend ``cpu`` models turbospec's own CPU engine: weights held at ``--dtype`` (float32 by default, as
``turbospec run``) and a load phase that transiently holds the mapped checkpoint file next to the converted
weights; the peak is the larger of the load peak and the steady state at the given context. Backend ``cuda``
models a llama.cpp-style GPU run (weights at their file size, compute buffers reserved for a full ubatch of
logits, as llama.cpp reserves its worst-case graph).

Modules: `arch` (model shapes), `memory` (the byte accounting), `plan` (largest context per budget),
`units` (sizes), `render` (report text), `measure` (the measured CPU baseline). The command line is
`turbospec.cli.fit`.
"""

from turbospec.lab.fit.arch import (
    PRESETS,
    Arch,
    arch_from_config,
    arch_from_dir,
    arch_from_gguf,
    load_arch,
    st_dtype_bytes,
)
from turbospec.lab.fit.measure import measure_peak_rss, measure_runtime_overhead
from turbospec.lab.fit.memory import (
    CPU_IMPORT_OVERHEAD,
    CPU_RUNTIME_OVERHEAD,
    CPU_SERVE_OVERHEAD,
    CUDA_RUNTIME_OVERHEAD,
    Breakdown,
    Setup,
    activation_bytes,
    cpu_mmap_weights,
    estimate,
    kv_bytes_per_token,
    recurrent_bytes,
    weight_bytes,
)
from turbospec.lab.fit.plan import (
    DEFAULT_KV_TYPES,
    WEIGHT_BPW,
    fit_table,
    max_context,
    plan,
    runtime_baseline,
    weight_bpw,
)
from turbospec.lab.fit.render import format_report, render_table
from turbospec.lab.fit.units import fmt_bytes, parse_mem

__all__ = [
    "CPU_IMPORT_OVERHEAD", "CPU_RUNTIME_OVERHEAD", "CPU_SERVE_OVERHEAD", "CUDA_RUNTIME_OVERHEAD", "DEFAULT_KV_TYPES",
    "PRESETS", "WEIGHT_BPW", "Arch", "Breakdown", "Setup", "activation_bytes", "arch_from_config", "arch_from_dir",
    "arch_from_gguf", "cpu_mmap_weights", "estimate", "fit_table", "fmt_bytes", "format_report",
    "kv_bytes_per_token", "load_arch", "max_context", "measure_peak_rss", "measure_runtime_overhead",
    "parse_mem", "plan", "recurrent_bytes", "render_table", "runtime_baseline", "st_dtype_bytes",
    "weight_bpw", "weight_bytes",
]
