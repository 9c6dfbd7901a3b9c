"""Evaluate an exported bundled model on the shipped held-out texts.

    python -m training.evaluate models/turbospec-tiny --out runs/tiny/eval.json

Metrics
* held-out perplexity on code.jsonl / prose.jsonl (non-overlapping windows of --window tokens);
* MTP agreement, teacher-forced: on held-out text, for every position t the MTP module gets h_t and the true
  next token x_{t+1}; its argmax is compared with the base model's own greedy token at t+1 (two steps ahead of h_t);
* MTP acceptance, self-generated: the base model greedily continues held-out prompts; over the generated
  tokens the MTP draft (from h_t and the accepted greedy x_{t+1}) is compared with the base's next greedy
  token -- exactly the per-draft acceptance of greedy MTP speculative decoding with one draft token;
* Python-likeness: greedy continuations from the middle of held-out code files -- share of their lines that
  parse as Python (alone or as a fragment of a larger statement) and that repeat an earlier line, beside the same
  for the files' real continuations (:mod:`training.pylike`);
* in-context copying: a held-out code window followed by the same window again; top-1 accuracy on the second
  copy vs the first (a model with a copying mechanism -- induction heads -- is near 1.0 on the second copy;
  retrieval needs that mechanism);
* retrieval accuracy per context length: greedy decoding of retrieval.jsonl prompts reproduces the answer
  sentence (which contains the value), checked in one teacher-forced forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from safetensors.torch import load_file

from .evaldata import default_eval_dir, load_jsonl
from .model import TrunkWithMTP
from .pylike import python_likeness
from .tokenizer import load_tokenizer, token_span


def load_exported(model_dir: str) -> TrunkWithMTP:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    cfg._attn_implementation = "sdpa"
    arch = "qwen3_5_text" if cfg.model_type == "qwen3_5_text" else "qwen3"
    model = TrunkWithMTP(cfg, arch, mtp_layers=int(getattr(cfg, "mtp_num_hidden_layers", 1) or 1))
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    lm_sd = {k: v.float() for k, v in sd.items() if not k.startswith("mtp.")}
    mtp_sd = {k[4:]: v.float() for k, v in sd.items() if k.startswith("mtp.")}
    missing, unexpected = model.lm.load_state_dict(lm_sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"bad checkpoint: missing={missing} unexpected={unexpected}")
    model.mtp.load_state_dict(mtp_sd, strict=True)
    model.lm.tie_weights()
    model.eval()
    return model


@torch.no_grad()
def forward_hidden(model, ids: torch.Tensor):
    out = model.lm.model(input_ids=ids, use_cache=False)
    h = out.last_hidden_state
    return h, model.lm.lm_head(h).float()


@torch.no_grad()
def text_metrics(model, tok, texts: list[str], window: int = 2048, max_tokens: int | None = None) -> dict:
    nll, n, agree, n_agree, mtp_true, base_true = 0.0, 0, 0, 0, 0, 0
    total = 0
    for t in texts:
        ids = tok.encode(t).ids
        for s in range(0, len(ids) - 2, window):
            chunk = ids[s:s + window + 1]
            if len(chunk) < 3:
                continue
            x = torch.tensor([chunk])
            h, logits = forward_hidden(model, x)
            lp = torch.log_softmax(logits[0, :-1], -1)
            tgt = x[0, 1:]
            nll -= lp.gather(1, tgt[:, None]).sum().item()
            n += len(tgt)
            greedy = logits[0].argmax(-1)  # greedy[t] = base prediction for x_{t+1}
            T = x.shape[1]
            m = model.mtp_logits(h[:, :T - 2], x[:, 1:T - 1]).float()[0].argmax(-1)  # predicts x_{t+2}
            agree += (m == greedy[1:T - 1]).sum().item()
            mtp_true += (m == x[0, 2:]).sum().item()
            base_true += (greedy[:-1] == tgt).sum().item()
            n_agree += T - 2
            total += len(chunk)
            if max_tokens and total >= max_tokens:
                break
        if max_tokens and total >= max_tokens:
            break
    return {"tokens": n, "ppl": float(torch.tensor(nll / max(n, 1)).exp()), "nll": nll / max(n, 1),
            "mtp_agreement_teacher_forced": agree / max(n_agree, 1), "mtp_top1_vs_text": mtp_true / max(n_agree, 1),
            "base_top1_vs_text": base_true / max(n, 1)}


@torch.no_grad()
def greedy_generate(model, ids: list[int], max_new: int, stop_ids=()) -> list[int]:
    x = torch.tensor([ids])
    out = model.lm.generate(x, max_new_tokens=max_new, do_sample=False, eos_token_id=list(stop_ids) or None,
                            pad_token_id=stop_ids[0] if stop_ids else 0)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def self_acceptance(model, tok, texts: list[str], n_prompts: int, prompt_tokens: int, gen_tokens: int) -> dict:
    acc, n = 0, 0
    samples = []
    for t in texts[:n_prompts]:
        ids = tok.encode(t).ids[:prompt_tokens]
        gen = greedy_generate(model, ids, gen_tokens)
        full = torch.tensor([ids + gen])
        h, logits = forward_hidden(model, full)
        greedy = logits[0].argmax(-1)
        P, T = len(ids), full.shape[1]
        # MTP element t: (h_t, x_{t+1}) -> predicts x_{t+2}; over generated tokens t+1 in [P, T-1)
        m = model.mtp_logits(h[:, P - 1:T - 2], full[:, P:T - 1]).float()[0].argmax(-1)
        target = greedy[P:T - 1]
        acc += (m == target).sum().item()
        n += len(target)
        samples.append({"prompt_tail": tok.decode(ids[-40:]), "continuation": tok.decode(gen)})
    return {"acceptance": acc / max(n, 1), "drafts": n, "samples": samples}


@torch.no_grad()
def code_likeness(model, tok, texts: list[str], n_prompts: int = 24, prompt_tokens: int = 192,
                  gen_tokens: int = 64) -> dict:
    """Greedy continuations from the middle of held-out files vs the files' real continuations: share of lines
    that parse as Python and share that repeat an earlier line (:mod:`training.pylike`)."""
    model_out, real_out, samples = [], [], []
    for t in texts[:n_prompts]:
        ids = tok.encode(t).ids
        mid = max(prompt_tokens, len(ids) // 2)
        prompt, real = ids[mid - prompt_tokens:mid], ids[mid:mid + gen_tokens]
        gen = greedy_generate(model, prompt, gen_tokens)
        head = tok.decode(prompt)
        cut = head.rfind("\n") + 1  # the prompt's unfinished last line belongs to the continuation
        for out, cont in ((model_out, gen), (real_out, real)):
            full = tok.decode(prompt + cont)
            out.append(full[cut:] if full.startswith(head) else tok.decode(cont))
        samples.append({"prompt_tail": head[-300:], "continuation": tok.decode(gen)})
    return {"model": python_likeness(model_out), "real": python_likeness(real_out), "prompts": len(samples),
            "gen_tokens": gen_tokens, "samples": samples}


@torch.no_grad()
def copy_probe(model, tok, texts: list[str], n_texts: int = 8, window: int = 100) -> dict:
    """Top-1 accuracy on a window of held-out text and on its exact repetition right after it."""
    first, second, n = 0.0, 0.0, 0
    for t in texts[:n_texts]:
        ids = tok.encode(t).ids[:window]
        if len(ids) < window:
            continue
        x = torch.tensor([ids + ids])
        _, logits = forward_hidden(model, x)
        hit = logits[0, :-1].argmax(-1) == x[0, 1:]
        first += hit[:window - 1].float().mean().item()
        second += hit[window:].float().mean().item()
        n += 1
    return {"first_copy_top1": first / max(n, 1), "second_copy_top1": second / max(n, 1), "windows": n,
            "window_tokens": window}


def _value_span(tok, answer: str, value: str, a_ids: list[int]) -> tuple[int, int]:
    """Token index range [i, j) of the answer tokens that cover ``value``."""
    start = answer.index(value)
    end = start + len(value)
    offs = tok.encode(answer).offsets
    idx = token_span(offs[:len(a_ids)], start, end)
    return (idx[0], idx[-1] + 1) if idx else (0, len(a_ids))


@torch.no_grad()
def retrieval(model, tok, cases: list[dict], lengths=None, limit_per_length: int | None = None) -> dict:
    """Greedy retrieval accuracy, computed in one forward pass per case.

    A case is correct iff the model's argmax reproduces every answer token given the prompt and the previous
    answer tokens -- i.e. greedy decoding from the prompt emits exactly the answer sentence, which contains the
    value.  ``value_accuracy`` only requires the tokens spelling the value (teacher-forced prefix).
    """
    by_len: dict[int, list] = {}
    for c in cases:
        L = c["target_tokens"]
        if lengths and L not in lengths:
            continue
        if limit_per_length and len(by_len.get(L, [])) >= limit_per_length:
            continue
        p_ids = tok.encode(c["prompt"]).ids
        a_ids = tok.encode(c["answer"]).ids
        x = torch.tensor([p_ids + a_ids])
        _, logits = forward_hidden(model, x)
        pred = logits[0, len(p_ids) - 1:-1].argmax(-1).tolist()
        ok = pred == a_ids
        i, j = _value_span(tok, c["answer"], c["value"], a_ids)
        vok = pred[i:j] == a_ids[i:j]
        by_len.setdefault(L, []).append({"id": c["id"], "family": c["family"], "ok": ok, "value_ok": vok,
                                          "got": tok.decode(pred)[:80], "value": c["value"]})
    res = {}
    for L, rows in sorted(by_len.items()):
        fam = {}
        for r in rows:
            fam.setdefault(r["family"], []).append(r["ok"])
        res[str(L)] = {"accuracy": sum(r["ok"] for r in rows) / len(rows),
                       "value_accuracy": sum(r["value_ok"] for r in rows) / len(rows), "n": len(rows),
                       "by_family": {k: sum(v) / len(v) for k, v in fam.items()},
                       "failures": [r for r in rows if not r["ok"]][:5]}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--eval-dir", default=default_eval_dir())
    ap.add_argument("--out", default=None)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap tokens per text kind for perplexity")
    ap.add_argument("--lengths", default="1024,2048,4096", help="retrieval lengths to run (8192 also shipped)")
    ap.add_argument("--retrieval-limit", type=int, default=None, help="max cases per length")
    ap.add_argument("--accept-prompts", type=int, default=8)
    ap.add_argument("--accept-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of: ppl,accept,python,copy,retrieval")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    skip = set(filter(None, a.skip.split(",")))
    model = load_exported(a.model_dir)
    tok = load_tokenizer(a.model_dir)
    code = [r["text"] for r in load_jsonl(os.path.join(a.eval_dir, "code.jsonl"))]
    prose = [r["text"] for r in load_jsonl(os.path.join(a.eval_dir, "prose.jsonl"))]
    res = {"model_dir": a.model_dir}
    t0 = time.time()
    if "ppl" not in skip:
        res["code"] = text_metrics(model, tok, code, a.window, a.max_tokens)
        res["prose"] = text_metrics(model, tok, prose, a.window, a.max_tokens)
        print(json.dumps({"code": res["code"], "prose": res["prose"]}, indent=1), flush=True)
    if "accept" not in skip:
        res["accept_code"] = self_acceptance(model, tok, code, a.accept_prompts, 192, a.accept_tokens)
        res["accept_prose"] = self_acceptance(model, tok, prose, a.accept_prompts, 192, a.accept_tokens)
        print("acceptance code", res["accept_code"]["acceptance"], "prose", res["accept_prose"]["acceptance"],
              flush=True)
    if "python" not in skip:
        res["python"] = code_likeness(model, tok, code)
        print("python-likeness", json.dumps({k: res["python"][k] for k in ("model", "real")}), flush=True)
    if "copy" not in skip:
        res["copy"] = copy_probe(model, tok, code)
        print("copy", json.dumps(res["copy"]), flush=True)
    if "retrieval" not in skip:
        cases = load_jsonl(os.path.join(a.eval_dir, "retrieval.jsonl"))
        lengths = [int(x) for x in a.lengths.split(",")]
        res["retrieval"] = retrieval(model, tok, cases, lengths, a.retrieval_limit)
        print(json.dumps({k: (v["accuracy"], v["n"]) for k, v in res["retrieval"].items()}), flush=True)
    res["eval_wall_s"] = round(time.time() - t0, 1)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
