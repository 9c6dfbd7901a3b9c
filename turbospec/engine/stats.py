"""What one generation measured: prompt and output sizes, prefill/decode time, TTFT, peak memory, drafts."""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass

from turbospec.sampling import TokenLogprob
from turbospec.speculative.stats import SpecStats


@dataclass
class GenStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the previous request (not recomputed)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    gen_tokens: int = 0
    decode_s: float = 0.0
    peak_rss_bytes: int = 0
    finish_reason: str = ""
    spec: SpecStats | None = None  # drafts and acceptance, when a drafter ran
    experts: ExpertUse | None = None  # a mixture-of-experts model's expert cache over the decode phase

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first one, over the time after the first token."""
        n = self.gen_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def line(self) -> str:
        tail = f" | {self.spec.line()}" if self.spec is not None else ""
        tail += f" | {self.experts.line()}" if self.experts is not None else ""
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tok{cached}, prefill {self.prefill_tps:.1f} t/s, ttft {self.ttft_s * 1e3:.0f} ms"
            f" | gen {self.gen_tokens} tok, decode {self.decode_tps:.1f} t/s"
            f" | peak mem {self.peak_rss_bytes / 2**20:.0f} MiB" + tail
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.to_dict() if self.spec is not None else None
        d["experts"] = self.experts.to_dict() if self.experts is not None else None
        d.update(prefill_tps=self.prefill_tps, decode_tps=self.decode_tps)
        return d


@dataclass
class ExpertUse:
    """Expert lookups of the decode phase (after the first token): how many found the expert loaded, the bytes of
    the experts loaded, and what the process read from storage meanwhile (/proc/self/io, Linux)."""

    hits: int = 0
    misses: int = 0
    loaded_bytes: int = 0
    disk_read_bytes: int = 0
    tokens: int = 0  # tokens decoded in the phase

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    def per_token_mib(self, n: int) -> float:
        return n / max(1, self.tokens) / 2**20

    def line(self) -> str:
        return (f"experts hit {100 * self.hit_rate:.1f}%, loaded {self.per_token_mib(self.loaded_bytes):.1f} MiB/tok, "
                f"disk {self.per_token_mib(self.disk_read_bytes):.1f} MiB/tok")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, loaded_mib_per_tok=self.per_token_mib(self.loaded_bytes),
                 disk_mib_per_tok=self.per_token_mib(self.disk_read_bytes))
        return d


def disk_read_bytes() -> int:
    """Bytes this process has read from storage (page-cache hits not counted); 0 where /proc/self/io is absent."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class Chunk:
    """One streamed step: the new token ids and the text they complete (may be empty).

    logprobs: one per token, when `SamplingParams.logprobs` is set. prompt_logprobs: when
    `SamplingParams.prompt_logprobs` is set, the first chunk (no tokens) carries one per prompt token, None for
    the first."""

    tokens: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


