"""Report formatting: the fit table and the text report of `plan`."""

from __future__ import annotations

from turbospec.lab.fit.units import fmt_bytes, fmt_ctx

COLUMNS = [("weights", "weights"), ("experts", "experts"), ("experts_on_disk", "experts on disk"),
           ("mtp_weights", "MTP w"), ("draft_weights", "draft w"),
           ("attention_kv", "attn KV"), ("recurrent_state", "GDN state"),
           ("spec_state_copies", "spec copies"), ("mtp_kv", "MTP KV"), ("draft_kv", "draft KV"),
           ("drafter_tables", "drafter tables"),
           ("activations", "activ."), ("upcast_scratch", "upcast"), ("rope_tables", "rope"),
           ("spec_hidden_rows", "MTP rows"), ("draft_head", "draft head"),
           ("mtp_compute", "MTP compute"), ("runtime", "runtime"), ("load_peak", "load peak")]


def render_table(rows: list[dict]) -> str:
    """Fixed-width table: KV type, mode, max context, (fit at -c,) total and every non-zero component."""
    used = [(k, t) for k, t in COLUMNS if any(r["breakdown"] and r["breakdown"][k] for r in rows)]
    head = ["KV", "mode", "max ctx", "total"] + [t for _, t in used]
    if any(r.get("at_ctx") for r in rows):
        head.insert(3, "at -c")
    body = []
    for r in rows:
        b = r["breakdown"]
        line = [r["kv_type"], r["mode"], fmt_ctx(r["max_ctx"]) if r["max_ctx"] else "none"]
        if "at -c" in head:
            a = r.get("at_ctx")
            line.append(f"{'fits' if a['fits'] else 'NO'} ({fmt_bytes(a['total'])})" if a else "")
        line.append(fmt_bytes(b["total"]) if b else "-")
        line += [fmt_bytes(b[k]) if b else "-" for k, _ in used]
        body.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    out = ["  ".join(str(x).rjust(w) for x, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).rjust(w) for x, w in zip(line, widths)) for line in body]
    return "\n".join(out)



def format_report(info: dict) -> str:
    """The text report of a `plan` result: a header line, the notes, the table."""
    setup = info["setup"]
    lines = [f"{info['model']}: budget {fmt_bytes(info['mem_bytes'])}, backend {info['backend']}, "
             f"ubatch {setup['ubatch']}, n_max {setup['n_max']}"
             + (f", parallel {setup['parallel']} (max ctx: positions of the shared KV pool)"
                if setup.get("parallel", 1) > 1 else "")
             + (f", {info['weights_bpw']} bpw weights" if info["weights_bpw"] else "")]
    lines += [f"note: {n}" for n in info["notes"]]
    lines.append(render_table(info["rows"]))
    return "\n".join(lines)
