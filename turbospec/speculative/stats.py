"""Speculative-decoding statistics: drafts, accepted tokens, acceptance per position and per drafter."""

from __future__ import annotations

from dataclasses import dataclass, field

from turbospec.speculative.tree import DraftTree


@dataclass
class SpecStats:
    drafts: int = 0  # verification steps that carried at least one draft token
    draft_tokens: int = 0
    accepted: int = 0
    per_pos_drafted: list[int] = field(default_factory=list)
    per_pos_accepted: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafts, tokens, accepted]
    skipped: int = 0  # steps without a draft because drafting did not pay (adaptive speculation)
    trees: int = 0  # verification steps whose draft was a tree (more than one candidate somewhere), not a chain

    def record(self, tree: DraftTree, accepted_depth: int) -> None:
        if not len(tree):
            return
        self.drafts += 1
        self.trees += not tree.is_chain
        self.draft_tokens += len(tree)
        self.accepted += accepted_depth
        depth = max(tree.depth(i) for i in range(len(tree)))
        while len(self.per_pos_drafted) < depth:
            self.per_pos_drafted.append(0)
            self.per_pos_accepted.append(0)
        for d in range(depth):
            self.per_pos_drafted[d] += 1
            if d < accepted_depth:
                self.per_pos_accepted[d] += 1
        s = self.by_source.setdefault(tree.source or "draft", [0, 0, 0])
        s[0] += 1
        s[1] += len(tree)
        s[2] += accepted_depth

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verification step that carried a draft."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_pos_accepted, self.per_pos_drafted)]

    def line(self) -> str:
        pos = ",".join(f"{p:.2f}" for p in self.per_position)
        skipped = f", {self.skipped} steps undrafted" if self.skipped else ""
        trees = f", {self.trees} trees" if self.trees else ""
        return (f"spec: {self.drafts} drafts{trees}, {self.draft_tokens} draft tok, {self.accepted} accepted"
                f" ({self.acceptance_rate:.1%}), mean acc len {self.mean_acceptance_length:.2f}, per-pos [{pos}]"
                f"{skipped}")

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position": self.per_position, "by_source": self.by_source, "skipped": self.skipped,
                "trees": self.trees}

    def merge(self, o: SpecStats) -> None:
        self.drafts += o.drafts
        self.trees += o.trees
        self.draft_tokens += o.draft_tokens
        self.accepted += o.accepted
        for d in range(len(o.per_pos_drafted)):
            if d >= len(self.per_pos_drafted):
                self.per_pos_drafted.append(0)
                self.per_pos_accepted.append(0)
            self.per_pos_drafted[d] += o.per_pos_drafted[d]
            self.per_pos_accepted[d] += o.per_pos_accepted[d]
        for k, v in o.by_source.items():
            s = self.by_source.setdefault(k, [0, 0, 0])
            for i in range(3):
                s[i] += v[i]
