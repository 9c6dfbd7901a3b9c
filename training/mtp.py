"""`python -m training.heads --kind mtp`: self-distil a model's native MTP module on its frozen base ("grafting").

The base (transformers' model class, float32, frozen) runs over random windows of a text corpus; MTP element j
reads (h_j, embed(x_{j+1})) and learns the base's own distribution at position j + 1 -- the token the base will
emit two steps after j, which is what speculative verification accepts -- by KL divergence (--loss kl, default)
or cross-entropy on the base's greedy tokens (--loss ce). Only `mtp.*` trains; the base and the shared lm_head
stay as they are. The `mtp.*` tensors of the checkpoint's model.safetensors are replaced in place (in the
checkpoint's dtype) at every save; mtp_train_state.pt (float32 MTP weights + optimizer + step) lets --resume
continue. Needs transformers (installed by the `test` extra).

    python -m training.heads --kind mtp --text corpus.jsonl --steps 300 --minutes 15
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from training.heads import lr_at, train_eval_streams, windows
from turbospec.errors import TurboSpecError

STATE_NAME = "mtp_train_state.pt"
WEIGHTS = "model.safetensors"


def _load(model_path: Path):
    try:
        from transformers import AutoConfig

        from training.model import MTPModule, _classes
    except ImportError as e:
        raise TurboSpecError(f"train-heads --kind mtp needs transformers ({e})") from None
    from safetensors.torch import load_file

    if not (model_path / WEIGHTS).exists():
        raise TurboSpecError(f"train-heads --kind mtp: {model_path / WEIGHTS} not found (single-file checkpoints)")
    config = AutoConfig.from_pretrained(model_path)
    arch = config.model_type
    if arch not in ("qwen3_5_text", "qwen3"):
        raise TurboSpecError(f"train-heads --kind mtp: architecture {arch!r} not supported (qwen3_5_text, qwen3)")
    tensors = load_file(str(model_path / WEIGHTS))
    mtp_sd = {k[4:]: v.float() for k, v in tensors.items() if k.startswith("mtp.")}
    if not mtp_sd:
        raise TurboSpecError(f"{model_path}: no mtp.* weights to train")
    n_layers = 1 + max(int(k.split(".")[1]) for k in mtp_sd if k.startswith("layers."))
    lm_cls, _, _ = _classes(arch)
    lm = lm_cls.from_pretrained(model_path, torch_dtype=torch.float32)
    lm.eval().requires_grad_(False)
    mtp = MTPModule(lm.config, arch, n_layers)
    missing, unexpected = mtp.load_state_dict(mtp_sd, strict=False)
    if missing or unexpected:
        raise TurboSpecError(f"mtp weights do not match the module: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return lm, mtp, tensors


def _batch_terms(lm, mtp, ids: torch.Tensor, loss: str) -> tuple[torch.Tensor, float]:
    """Loss and top-1 agreement with the base's greedy token for a batch of windows ids [B, T]."""
    base = lm.model
    T = ids.shape[1]
    with torch.no_grad():
        h = base(input_ids=ids, use_cache=False).last_hidden_state  # final-normed
        teacher = lm.lm_head(h[:, 1:T - 1]).float()  # position j + 1 predicts x_{j+2}
        emb = base.embed_tokens(ids[:, 1:T - 1])
        pos = torch.arange(T - 2).unsqueeze(0).expand(ids.shape[0], -1)
        pe = base.rotary_emb(h, pos)
    student = lm.lm_head(mtp(h[:, :T - 2], emb, pe)).float()
    s = student.reshape(-1, student.shape[-1])
    t = teacher.reshape(-1, teacher.shape[-1])
    if loss == "kl":
        value = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
    else:
        value = F.cross_entropy(s, t.argmax(-1))
    agree = float((s.detach().argmax(-1) == t.argmax(-1)).float().mean())
    return value, agree


def _save(out_dir: Path, mtp, tensors: dict, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    for k, v in mtp.state_dict().items():
        tensors["mtp." + k] = v.detach().to(dtype).contiguous()
    tmp = out_dir / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS)


def train_mtp(model_path: str, texts: list[str], *, steps: int = 300, seq_len: int = 256, batch: int = 4,
              lr: float = 3e-4, loss: str = "kl", save_every: int = 50, resume: bool = False, seed: int = 0,
              eval_windows: int = 8, minutes: float | None = None, progress: bool = True, log=None) -> dict:
    """Distil the checkpoint's MTP module toward its frozen base; returns eval agreement before and after."""
    from turbospec.tokenizer import Tokenizer

    log = log or (lambda s: print(s, file=sys.stderr))
    if steps < 1 or seq_len < 4 or batch < 1:
        raise TurboSpecError("train-heads --kind mtp: need steps >= 1, batch >= 1, seq-len >= 4")
    if loss not in ("ce", "kl"):
        raise TurboSpecError("--loss must be ce or kl")
    path = Path(model_path)
    lm, mtp, tensors = _load(path)
    dtype = next(iter(v for k, v in tensors.items() if k.startswith("mtp."))).dtype
    train_s, eval_s, n_tokens = train_eval_streams(Tokenizer(str(path)), texts, seq_len)
    params = list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    state_path = path / STATE_NAME
    start = 0
    if resume:
        if not state_path.exists():
            raise TurboSpecError(f"--resume: no {STATE_NAME} in {path}")
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        mtp.load_state_dict(state["mtp"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
    warmup = max(1, min(20, steps // 10))
    eg = torch.Generator().manual_seed(seed + 12345)
    eval_ids = torch.stack(windows(eval_s, eval_windows, seq_len, eg))

    def evaluate() -> tuple[float, float]:
        mtp.eval()
        with torch.no_grad():
            value, agree = _batch_terms(lm, mtp, eval_ids, loss)
        mtp.train()
        return float(value), agree

    before = evaluate()
    log(f"train-heads --kind mtp: corpus {n_tokens} tokens, steps {start}->{steps}, "
        f"eval {loss} {before[0]:.4f}, agreement with the base {before[1]:.3f}")

    def checkpoint(step: int) -> None:
        _save(path, mtp, tensors, dtype)
        tmp = state_path.with_suffix(".tmp")
        torch.save({"step": step, "mtp": mtp.state_dict(), "optim": opt.state_dict(), "seed": seed}, tmp)
        tmp.replace(state_path)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start, desc="train-mtp", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    done = start
    mtp.train()
    for step in range(start, steps):
        if minutes is not None and time.perf_counter() - t0 > 60 * minutes:
            log(f"train-heads --kind mtp: time budget of {minutes} min reached at step {step}")
            break
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # resumable: the batch depends on the step
        ids = torch.stack(windows(train_s, batch, seq_len, g))
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, lr, warmup)
        value, agree = _batch_terms(lm, mtp, ids, loss)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(value.detach()):.3f}", agree=f"{agree:.2f}")
        if save_every > 0 and done % save_every == 0 and done < steps:
            checkpoint(done)
    if bar is not None:
        bar.close()
    mtp.eval()
    checkpoint(done)
    after = evaluate()
    summary = {"out": str(path), "steps_done": done, "start_step": start, "seconds": time.perf_counter() - t0,
               "tokens_seen": (done - start) * batch * seq_len, "loss": loss,
               "eval_loss_before": before[0], "eval_loss_after": after[0],
               "eval_agreement_before": before[1], "eval_agreement_after": after[1]}
    log(f"train-heads --kind mtp: eval {loss} {before[0]:.4f} -> {after[0]:.4f}, agreement with the base "
        f"{before[1]:.3f} -> {after[1]:.3f}; mtp.* saved in {path / WEIGHTS}")
    return summary

