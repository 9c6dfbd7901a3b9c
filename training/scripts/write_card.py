"""Write the model card (models/turbospec-tiny/README.md) from the training summary and eval results.

    python -m training.scripts.write_card --model models/turbospec-tiny --eval runs/tiny/eval.json
"""

import argparse
import json
import os

from training.induction_init import lookback_distances
from training.train import DEFAULT_CURRICULUM, parse_args

SPLIT_DIGITS = (" (`--split-digits`: every digit is its own token, as in Llama and Qwen2, so a number is spelled"
                " the same way wherever it occurs; the held-out code / prose / retrieval texts are 2.5% / 0.9% / 2.5% more tokens than with merged digits)")


def _load(path):
    with open(path) as fh:
        return json.load(fh)


def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def f3(x):
    return "n/a" if x is None else f"{x:.3f}"


def _shares(c) -> str:
    names = ["retrieval", "repeat", "symbols"]
    parts = [f"{n} {v:.0%}" for n, v in zip(names, c[3:6]) if v or n == "retrieval"]
    if len(c) > 6:
        parts.append(f"N={c[6]}")
    return f" ({', '.join(parts)})" if parts else ""


def _command(args: dict, run: str) -> str:
    """The training command: every option that differs from its default."""
    defaults = vars(parse_args([]))
    out = ["python -m training", f"--run {run}"]
    for k, v in args.items():
        if k in ("run", "export", "no_progress", "threads") or defaults.get(k) == v or v in (None, False):
            continue
        flag = "--" + k.replace("_", "-")
        out.append(flag if v is True else f"{flag} '{v}'" if k == "curriculum" else f"{flag} {v}")
    return " ".join(out + [f"--export {run}/export"])


def _copy_line(cp: dict | None) -> str:
    if not cp:
        return ""
    return (f"In-context copying (a held-out code window of {cp['window_tokens']} tokens, then the same window again; "
            f"{cp['windows']} windows): top-1 {cp['first_copy_top1']:.3f} on the first copy, "
            f"**{cp['second_copy_top1']:.3f} on the second** (a model that copies is near 1.0 there).\n\n")


def _gdn_row(cfg) -> str:
    return (f"| Gated DeltaNet | {cfg.get('linear_num_key_heads', '-')} K heads / {cfg.get('linear_num_value_heads', '-')} "
            f"V heads x {cfg.get('linear_key_head_dim', '-')} dims, conv kernel {cfg.get('linear_conv_kernel_dim', '-')} |\n")


def _planted_row(p: dict, frozen: bool) -> str:
    sets = [p.get("offsets") or list(range(p.get("context", 1))), *p.get("more_offsets", [])]
    dists = lookback_distances(*sets)
    heads = "a previous-token head" if dists == [1] else f"look-back heads at distance {', '.join(map(str, dists))}"

    def matched(offsets):
        return ", ".join(["the current token" if o == 0 else f"the token {o} back" for o in offsets])

    inductions = " and ".join(f"an induction head matching {matched(o)} on the {p['k'] // 2 * len(o)} slowest rotary "
                              "pairs" for o in sets)
    return (f"| initialisation | planted induction circuit in layers 0-1 (`training/induction_init.py`: "
            f"{heads}, {inductions}, k={p['k']}, "
            f"alpha={p['alpha']}, gamma={p['gamma']}, q/k norm x{p['qk_norm_scale']}, embedding shift {p['embed_shift']}, "
            f"other output projections zero)"
            f"{', layers 0-1 held fixed for the whole run (`--freeze-circuit`)' if frozen else ''}; "
            f"everything else normal init (std 0.02) |\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/turbospec-tiny")
    ap.add_argument("--eval", default="runs/tiny/eval.json")
    ap.add_argument("--note", default="", help="extra line for the training table (e.g. a continuation)")
    ap.add_argument("--meta", default="runs/tiny/train_meta.json", help="training meta with loss history")
    ap.add_argument("--extra-eval", default=None, help="optional second eval json (e.g. 8K retrieval)")
    ap.add_argument("--retrieval-limit", type=int, default=20, help="retrieval cases per length in the eval")
    ap.add_argument("--run", default="runs/tiny", help="run directory named in the training command")
    ap.add_argument("--machine", default="2 CPU cores, 2 torch threads",
                    help="how the training machine was used (shared? niced?)")
    ap.add_argument("--python-verdict", default="partly -- judged by eye, see samples",
                    help="by-eye verdict on the greedy code samples; starts with 'yes' to count as a pass")
    a = ap.parse_args()
    cfg = _load(os.path.join(a.model, "config.json"))
    meta = _load(os.path.join(a.model, "training_summary.json"))
    ev = _load(a.eval) if os.path.exists(a.eval) else {}
    if a.extra_eval and os.path.exists(a.extra_eval):
        ex = _load(a.extra_eval)
        ev.setdefault("retrieval", {}).update(ex.get("retrieval", {}))
    args = meta.get("args", {})
    c = meta.get("corpus", {})
    hybrid = cfg["model_type"] == "qwen3_5_text"
    lt = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    pattern = " ".join("A" if t == "full_attention" else "D" for t in lt)
    size_mb = os.path.getsize(os.path.join(a.model, "model.safetensors")) / 2**20
    r = ev.get("retrieval", {})

    def racc(L):
        v = r.get(str(L))
        return "not run" if not v else f"{pct(v['accuracy'])} ({v['n']} cases)"

    code, prose = ev.get("code", {}), ev.get("prose", {})
    acc_c, acc_p = ev.get("accept_code", {}), ev.get("accept_prose", {})
    r2 = r.get("2048", {}).get("accuracy")
    mtp_c = code.get("mtp_agreement_teacher_forced")
    bar = [
        ("retrieval accuracy >= 90% at 2K", r2 is not None and r2 >= 0.9, pct(r2)),
        ("MTP top-1 agreement >= 0.6 on held-out code (teacher-forced)", mtp_c is not None and mtp_c >= 0.6, f3(mtp_c)),
        ("(extra, not part of the bar) MTP acceptance on self-generated code continuations >= 0.6",
         acc_c.get("acceptance") is not None and acc_c["acceptance"] >= 0.6, f3(acc_c.get("acceptance"))),
    ]
    py = ev.get("python")
    measured = "" if not py else (
        f" (measured on {py['prompts']} greedy continuations of {py['gen_tokens']} tokens from the middle of held-out "
        f"files, `training/pylike.py`: {pct(py['model']['parse_rate'])} of {py['model']['lines']} lines parse as "
        f"Python -- the files' real continuations {pct(py['real']['parse_rate'])}; "
        f"{pct(py['model']['repeat_rate'])} repeat an earlier line -- real {pct(py['real']['repeat_rate'])})")
    bar.append(("greedy continuations of held-out code look like Python (judged by eye)",
                a.python_verdict.lower().startswith("yes"), a.python_verdict + measured))
    cur = json.loads(args["curriculum"]) if args.get("curriculum") else DEFAULT_CURRICULUM
    cur_text = ", ".join(f"{c[0]:g}: {c[1]}x{c[2]}" + _shares(c) for c in cur)
    command = _command(args, a.run)
    planted = meta.get("induction_init")
    samples = (py or {}).get("samples", [])[:4] or acc_c.get("samples", [])[:3]
    fam = {}
    for L, v in r.items():
        for k, x in v.get("by_family", {}).items():
            fam.setdefault(k, {})[L] = x
    fam_rows = "\n".join(f"| {k} | " + " | ".join(pct(v.get(L)) if L in v else "" for L in sorted(r, key=int)) + " |"
                         for k, v in sorted(fam.items()))
    if os.path.exists(a.meta):
        full = _load(a.meta)
        hist = full.get("history", [])
        if hist:
            meta["last_lm_loss"] = sum(h["lm_loss"] for h in hist[-5:]) / len(hist[-5:])
            meta["last_mtp_loss"] = sum(h["mtp_loss"] for h in hist[-5:]) / len(hist[-5:])
            meta["last_lm_loss"] = round(meta["last_lm_loss"], 3)
            meta["last_mtp_loss"] = round(meta["last_mtp_loss"], 3)
    note_row = f"| note | {a.note} |\n" if a.note else ""
    text = f"""---
license: other
library_name: transformers
pipeline_tag: text-generation
tags: [turbospec, mtp, {cfg['model_type']}, tiny, cpu]
---

# turbospec-tiny

A tiny {'Qwen3.5-style hybrid (`qwen3_5_text`: Gated DeltaNet + gated full attention, 3:1, partial rotary)' if hybrid else 'dense `qwen3`'}
language model with a **native MTP (multi-token prediction) head** under the Qwen3.5 weight names, trained from
scratch by turbospec on 2 CPU cores, on Python standard-library code and the Python documentation.
It exists so that turbospec runs with one command without a model hub, and so that MTP drafting, KV-cache
quantization and long-context retrieval can be measured on a *trained* model. It is not a useful assistant.

## Architecture

| | |
|---|---|
| model_type / class | `{cfg['model_type']}` / `{cfg['architectures'][0]}` |
| layers | {cfg['num_hidden_layers']} (`{pattern}`; {'D = Gated DeltaNet, A = gated full attention' if hybrid else 'A = attention'}) |
| hidden / intermediate | {cfg['hidden_size']} / {cfg['intermediate_size']} |
| attention | {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}{', output gate (q_proj is 2x wide)' if hybrid else ''} |
| RoPE | theta {cfg.get('rope_parameters', {}).get('rope_theta')}, partial_rotary_factor {cfg.get('rope_parameters', {}).get('partial_rotary_factor', 1.0)} |
{_gdn_row(cfg) if hybrid else ''}| vocab | {cfg['vocab_size']} (byte-level BPE{', one token per digit' if args.get('split_digits') else ''}), tied input/output embeddings |
| MTP | `mtp_num_hidden_layers: {cfg.get('mtp_num_hidden_layers')}` |
| parameters | {meta.get('params', 0)/1e6:.2f}M total incl. embeddings and MTP; trunk {meta.get('trunk_params', 0)/1e6:.2f}M; MTP {(meta.get('params', 0) - meta.get('trunk_params', 0))/1e6:.2f}M |
| context | trained up to 4096 tokens (max_position_embeddings {cfg['max_position_embeddings']}) |
| file | `model.safetensors`, bfloat16, {size_mb:.1f} MiB |

**RMSNorm convention:** {'zero-centred, y = x / rms(x) * (1 + w) (weights stored around 0), as in Qwen3.5' if hybrid else 'plain, y = x / rms(x) * w, as in Qwen3'};
the `mtp.*` norms (`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`, and the norms inside
`mtp.layers.0`) use **the same convention as the trunk**.

### MTP module

Tensors: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding.weight` [H], `mtp.pre_fc_norm_hidden.weight` [H],
`mtp.layers.0.*` (one full-attention decoder layer with exactly the trunk attention layers' names:
`input_layernorm`, `self_attn.{{q_proj,k_proj,v_proj,o_proj,q_norm,k_norm}}`, `post_attention_layernorm`,
`mlp.{{gate_proj,up_proj,down_proj}}`), `mtp.norm.weight` [H]. Embeddings and lm_head are shared with the trunk (tied).

Forward (predicts x_(t+2)): `h_t` = trunk hidden state at position t **after** the final norm;
`u = mtp.fc(concat([pre_fc_norm_embedding(embed(x_(t+1))), pre_fc_norm_hidden(h_t)]))` (embedding first);
`u = mtp.layers.0(u)` (causal self-attention over the MTP sequence, its own KV cache, RoPE position t -- the
position of h_t, as in vLLM); `logits = lm_head(mtp.norm(u))`. transformers ignores the `mtp.*` tensors
when loading with `AutoModelForCausalLM` (a warning lists them as unused); turbospec loads them.

## Training data and split

* **code**: the Python {args.get('code_dir') or '3.11'} standard library of the training interpreter (`*.py`, test suites,
  `idlelib/idle_test`, `turtledemo` and site-packages skipped): {c.get('train_code_files')} training files
  ({c.get('train_code_chars', 0)/1e6:.1f}M chars), {c.get('heldout_code_files')} held-out files.
* **prose**: the reStructuredText `_sources` of the Python 3.11 documentation (Debian `python3.11-doc`):
  {c.get('train_prose_files')} training files ({c.get('train_prose_chars', 0)/1e6:.1f}M chars), {c.get('heldout_prose_files')} held-out files.
* **held-out split**: a file is held out iff `sha1("<kind>:<relative path>")` mod 100 < 6 (about 6% of the files
  of each kind); held-out files are never used for training nor for the tokenizer.
  `turbospec/data/eval/` ships held-out code (`code.jsonl`), prose (`prose.jsonl`) and retrieval cases built
  only from held-out filler (`retrieval.jsonl`: 40 x 1K, 40 x 2K, 24 x 4K, 10 x 8K tokens).
* **retrieval documents** (synthetic, generated on the fly from training-file filler): a fact stated once at a
  random depth -- passkey, a person's secret number, an account balance, a project budget, an `ACCESS_CODE = ...`
  assignment -- in real filler text (number-dense variants add distractor lines such as
  `Account 17 balance: 4,512,330` and revenue / line-item rows), then `Question: ...` / `Answer:` with the fact
  repeated. A share of the training *sequences* set by the curriculum below contains one ({meta.get('retrieval_docs')} documents,
  of 1/4 to 1 of the sequence length); the synthetic lines themselves (needle, distractors, question, answer) are a few percent of the tokens
  seen, the rest of those sequences is real filler. Answer tokens get loss weight {args.get('answer_weight')}.
* tokens available for training: {meta.get('train_tokens_available')}.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training split, vocab {cfg['vocab_size']}{SPLIT_DIGITS if args.get('split_digits') else ''}; special tokens
`<|endoftext|>` (eos, pad), `<|im_start|>`, `<|im_end|>`; ChatML chat template in `tokenizer_config.json`;
`generation_config.json` stops on `<|endoftext|>` and `<|im_end|>`.

## Training

| | |
|---|---|
| command | `{command}` (then copied to `models/turbospec-tiny`) |
{_planted_row(planted, bool(args.get('freeze_circuit'))) if planted else ''}
| objective | next-token LM loss + {args.get('mtp_weight')} x MTP loss (token t+2), MTP trained jointly from the start |
| optimizer | AdamW (beta 0.9/0.95, eps 1e-8, weight decay {args.get('weight_decay')} on matrices except embeddings), grad clip 1.0 |
| schedule | peak LR {args.get('lr')}, {args.get('warmup_steps')} warmup steps, cosine to {args.get('min_lr_frac')} x peak over the wall-clock budget |
| curriculum (progress: seq_len x batch, shares of sequences: retrieval document / repeated real-text window / random-symbol copy episodes over the N most frequent tokens) | {cur_text} |
| precision | float32 (bf16 autocast was far slower on this CPU: no AVX-512 BF16), exported in bfloat16 |
| seed | {args.get('seed')} |
| steps / tokens seen | {meta.get('step')} / {meta.get('tokens'):,} |
| training wall time | {meta.get('elapsed_s', 0)/60:.1f} min (step time; {a.machine}) |
{note_row}| final train loss (mean of the last 5 logged steps, weighted) | LM {meta.get('last_lm_loss', 'n/a')}, MTP {meta.get('last_mtp_loss', 'n/a')} |

## Evaluation (held-out)

`python -m training.evaluate models/turbospec-tiny --max-tokens 12000 --accept-prompts 4 --accept-tokens 48
--retrieval-limit {a.retrieval_limit} --lengths 1024,2048,4096` (the first 12K tokens of each held-out kind, 4 x 48 generated tokens
per kind for acceptance, {a.retrieval_limit} retrieval cases per length; raw results in `eval.json`).

| metric | code | prose |
|---|---|---|
| perplexity (windows of 2048) | {code.get('ppl', float('nan')):.2f} | {prose.get('ppl', float('nan')):.2f} |
| tokens evaluated | {code.get('tokens')} | {prose.get('tokens')} |
| base top-1 accuracy vs text | {pct(code.get('base_top1_vs_text'))} | {pct(prose.get('base_top1_vs_text'))} |
| MTP top-1 agreement with the base's greedy token two ahead (teacher-forced) | {f3(code.get('mtp_agreement_teacher_forced'))} | {f3(prose.get('mtp_agreement_teacher_forced'))} |
| MTP acceptance on the base's own greedy continuations (K=1) | {f3(acc_c.get('acceptance'))} ({acc_c.get('drafts')} drafts) | {f3(acc_p.get('acceptance'))} ({acc_p.get('drafts')} drafts) |
| MTP top-1 accuracy vs the text token two ahead | {pct(code.get('mtp_top1_vs_text'))} | {pct(prose.get('mtp_top1_vs_text'))} |

{_copy_line(ev.get("copy"))}Retrieval accuracy (greedy decoding reproduces the answer sentence, which contains the value; checked teacher-forced in one pass per case; value-token accuracy in `eval.json`): 1K {racc(1024)}, 2K {racc(2048)}, 4K {racc(4096)}, 8K {racc(8192)}.

| family | """ + " | ".join(f"{int(L)//1024}K" for L in sorted(r, key=int)) + """ |
|---|""" + "---|" * len(r) + f"""
{fam_rows}

### Quality bar

""" + "\n".join(f"* {'PASS' if ok else 'FAIL'} -- {name}: {val}" for name, ok, val in bar) + """

### Greedy continuations of held-out code (prompt tail, then continuation)

""" + "\n\n".join(f"```python\n# ...{s['prompt_tail']}\n# ---- model ----\n{s['continuation']}\n```" for s in samples) + f"""

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/turbospec-tiny")
model = AutoModelForCausalLM.from_pretrained("models/turbospec-tiny")   # mtp.* tensors are ignored here
ids = tok("def fibonacci(n):\\n", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))
```

## Limitations

Trained for about {meta.get('elapsed_s', 0)/60:.0f} minutes on a 2-core CPU ({meta.get('tokens'):,} tokens): the
model is badly under-trained; it produces Python-flavoured text, not correct programs; it knows nothing beyond
its corpus; it is not instruction-tuned (the chat template only defines the format). Use it to measure
speculative-decoding and KV-cache machinery, not for quality.
"""
    with open(os.path.join(a.model, "README.md"), "w") as f:
        f.write(text)
    print("wrote", os.path.join(a.model, "README.md"))


if __name__ == "__main__":
    main()
