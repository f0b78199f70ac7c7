"""The picture of a localisation, as a plot spec of kind "stages" (drawn by
trainprobes.report.stage_figure): every stage's own and free-running error beside its band
noise floor .. margin x floor, exact zeros on a "0" strip of their own (a log axis has no
zero), the log-prob row in nats on its own axis, and the share of the drift each part holds,
the part that explains it highlighted. The probe puts it in evidence["plots"], so the HTML
report, the audit and `--plot` draw the same picture from the same numbers."""
from __future__ import annotations

import re

from trainprobes.drift.postproc import LOGPROBS_ROLE

# the parts of the decomposition in the order the probe removes them (decompose.PARTS)
PARTS = ("weights", "routing", "temperature", "renormalisation", "numerics", "unexplained")
WHOLE_MODEL = ("temperature", "renormalisation")  # parts with no stage of their own


_IMPORT_PATH = re.compile(r"\b[A-Za-z_][\w.]*:([A-Za-z_]\w*)")  # pkg.mod:factory -> factory


NOTE = ("own: the stage alone (the trainer's input into the engine's stage); free-running: everything "
        "before it too. Exact zeros sit on the '0' strip, not on the log axis. The log-probs row is in "
        "nats: its free value is the whole drift, its own value what remains once a temperature and a "
        "renormalisation are taken out. The shaded row holds the largest share of the drift.")
NOTE_DUMPS = ("From dumps: the free-running error only (no patched run, no shares). Exact zeros sit on "
              "the '0' strip, not on the log axis. The shaded row is the first whose free-running error "
              "exceeds margin x its floor.")


def _short(name: str) -> str:
    return name.replace("model.", "")


def _parts(shares: dict) -> list[dict]:
    """The share rows: each part, numerics split by stage where the probe did so."""
    rows = []
    for part in PARTS:
        split = [k for k in shares if k.startswith(f"{part}[")] if part == "numerics" else []
        for key in split or ([part] if part in shares else []):
            s = shares[key]
            label = f"numerics: {_short(key[len('numerics['):-1])}" if key != part else part
            rows.append({"key": key, "label": label, "share": s["share"], "low": s["ci_low"],
                         "high": s["ci_high"]})
    return rows


def _explains(kind: str, stages: list, parts: list, explained_by: str) -> tuple[str | None, str | None]:
    """(stage, share key) that explain the drift: the largest share of a finding; its stage
    is the one the probe names (explained_by), or for a whole-model part the row where it
    shows (after lm_head when a rescale in the forward is beyond noise, else the log-probs)."""
    if kind in ("exact", "noise") or not parts:
        return None, None
    top = max((p for p in parts if p["key"] != "unexplained"), key=lambda p: abs(p["share"]), default=None)
    if top is None:
        return None, None
    if top["key"] in WHOLE_MODEL:
        post = [s["name"] for s in stages if s.get("role") == "post_processing" and s.get("verdict") == "beyond"]
        logprobs = [s["name"] for s in stages if s.get("role") == LOGPROBS_ROLE]
        return (post or logprobs or [None])[0], top["key"]
    if top["key"].startswith("numerics["):
        return top["key"][len("numerics["):-1], top["key"]
    return explained_by or None, top["key"]


def stage_plot(stages: list, margin: float, title: str, *, shares: dict | None = None, kind: str = "",
               explained_by: str = "") -> dict | None:
    """stages: the evidence's stage rows (name, role, free_error, noise_floor, own_error or None
    from dumps, verdict); shares: evidence["shares"] (None from dumps: no decomposition);
    kind and explained_by: the Result's metrics of those names."""
    if not stages:
        return None
    parts = _parts(shares) if shares else []
    stage, key = _explains(kind, stages, parts, explained_by)
    if shares is None:  # from dumps: no decomposition, the first divergent stage is the answer
        stage = next((s["name"] for s in stages if s.get("divergent") or s.get("verdict") == "beyond"), None)
    rows = [{"name": s["name"], "label": _short(s["name"]), "own": s.get("own_error"), "free": s["free_error"],
             "floor": s["noise_floor"], "high": s["noise_floor"] * margin, "verdict": s.get("verdict", ""),
             "unit": "nats" if s.get("role") == LOGPROBS_ROLE else "relative"} for s in stages]
    share = next((p for p in parts if p["key"] == key), None)
    title = _IMPORT_PATH.sub(r"\1", title)  # the card and the report say the whole path
    return {"kind": "stages", "title": title if len(title) <= 90 else title[:89] + "\u2026",
            "stages": rows, "margin": margin, "shares": parts,
            "explains": {"stage": stage, "part": key, "share": share["share"] if share else None},
            "highlight": "explains the drift" if shares is not None else "first divergent stage",
            "xlabel": "|B - A| / |A| per token (log)", "xlabel_nats": "|log-ratio| per scored token, nats (log)",
            "note": NOTE if shares is not None else NOTE_DUMPS}
