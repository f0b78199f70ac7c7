"""`localize`: where two engines part, and what share of the log-prob drift each cause holds.
One Result (probe "drift.localize").

The drift of a scored token t at position i is x = lpB[i, t] - lpA[i, t] (engine minus
trainer, as trainprobes.drift.compare). It is split into parts removed one after another,
each the difference between two runs, so the parts add up to x exactly:
  weights          x(B) - x(B'), B' = the engine with the trainer's value of every tensor
                   the weight-sync check names (trainprobes.drift.weights)
  routing          x(B') - x(B'r), B'r = B' replaying the trainer's expert choices
  temperature      from B'r's and A's log-prob vectors (trainprobes.drift.semantics)
  renormalisation  likewise
  numerics[stage]  the trainer run with stage k's output replaced by the engine's own
                   output at k (its input the trainer's): stage k's numerics carried to the
                   log-probs, for each stage beyond noise (trainprobes.drift.localize)
  unexplained      x minus all of the above (numerics below noise, interactions)
share_j = sum x_j x / sum x^2 (they sum to 1 with unexplained), a ratio estimator whose
interval is cluster-robust over the units: the sequences, or spans of them when there are
fewer than 4 (trainprobes.drift.units; trainprobes.drift.stats.cluster_t).
kind: "exact" when the engines agree bit for bit; else the part found (weights named,
temperature or renormalisation detected, routing decisions differing with a routing share
whose interval excludes 0, a stage beyond noise) with the largest share; "noise" when none
is found.
"""
from __future__ import annotations

import torch
from trainprobes.drift.carriers import carriers
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import (
    HAND_OFF,
    Localisation,
    hand_off_name,
    localize_layers,
    record,
    rel_error,
)
from trainprobes.drift.patching import Hooks
from trainprobes.drift.postproc import LOGPROBS_ROLE, ROLE, judge_logprobs, judge_post
from trainprobes.drift.routing import routing
from trainprobes.drift.semantics import semantics
from trainprobes.drift.stage_plot import stage_plot
from trainprobes.drift.stats import cluster_t
from trainprobes.drift.units import describe, n_units, unit_sums
from trainprobes.drift.weights import synced_copy, weight_sync
from trainprobes.errors import InvalidArgument
from trainprobes.result import Result

KINDS = ("exact", "noise", "numeric", "routing", "weights", "temperature", "renormalisation")
PARTS = ("weights", "routing", "temperature", "renormalisation", "numerics", "unexplained")


def _logits(engine: Engine, ids, am) -> torch.Tensor:
    with torch.no_grad():
        return engine.logits(ids, am)[:, :-1]


def _replayed(engine: Engine, loc: Localisation, ids, am):
    """The engine's logits with the trainer's free-run expert choices replayed."""
    routers = [n for n, c in loc.runs.a.items() if c and c[0].indices is not None]
    if not routers:
        return None
    _, logits = record(engine, [], ids, am, replay_from=loc.runs.a, routers=routers)
    return logits[:, :-1]


def _hybrid(trainer: Engine, own: list, name: str, ids, am) -> torch.Tensor:
    """The trainer's logits with stage `name`'s output replaced by `own` (recorded Calls)."""
    count = {"i": 0}
    mod = trainer.module.get_submodule(name)

    def hook(m, args, out):
        new = own[min(count["i"], len(own) - 1)].out
        count["i"] += 1
        ref = out if isinstance(out, torch.Tensor) else out[0]
        new = new.reshape(ref.shape).to(ref.dtype)
        if trainer.convention == "vllm" and isinstance(out, tuple) and len(out) == 2:
            return new, torch.zeros_like(new)
        return new if isinstance(out, torch.Tensor) else (new, *out[1:])

    h = mod.register_forward_hook(hook)
    try:
        return _logits(trainer, ids, am)
    finally:
        h.remove()


def _hybrid_in(trainer: Engine, given: list, name: str, blocks: frozenset, ids, am) -> torch.Tensor:
    """The trainer's logits with stage `name` fed the inputs the engine's code handed it
    (`given`: the engine's patched Calls, whose inputs are what its hand-off made of the
    trainer's outputs): the hand-off's numerics carried to the log-probs."""
    hooks = Hooks({name: trainer.module.get_submodule(name)}, "patch", source={name: given},
                  convention=trainer.convention, blocks=blocks, shape=tuple(ids.shape))
    with hooks:
        hooks.new_forward()
        return _logits(trainer, ids, am)


def _post(trainer: Engine, eng: Engine, loc_engine: Engine, loc: Localisation, z_b, ids, am, mask, tok, lp_a,
          margin, alpha):
    """The post-lm_head row (trainprobes.drift.postproc) and its part of the drift:
    lpB(z_B) - lpB(z_h) per scored token."""
    last = next((s for s in reversed(loc.layout.stages) if s.role == "lm_head"), loc.layout.stages[-1])
    routers = [n for n, c in loc.runs.a.items() if c and c[0].indices is not None]
    if routers or eng.module is not loc_engine.module:  # replayed, or weights synced: a new run
        calls, _ = record(eng, [last], ids, am, replay_from=loc.runs.a if routers else None, routers=routers)
    else:  # the engine's free run recorded it already
        calls = loc.runs.b_free
    z_h = _hybrid(trainer, calls[last.name], last.name, ids, am)
    # the free runs' own logits: the free column, whatever sync or replay did to z_b
    z_a, z_free = loc.runs.logits_a[:, :-1], loc.runs.logits_b[:, :-1]
    free = torch.where(mask, rel_error(z_free, z_a), 0.0).sum().item() / max(int(mask.sum()), 1)
    post = judge_post(z_b, z_h, mask, lm_head=last.name, u=loc.u, margin=margin, alpha=alpha,
                      n_stages=len(loc.stages) + 1, free_error=free)
    part = _tok(eng.logprobs(z_b), lp_a, tok, mask) - _tok(eng.logprobs(z_h), lp_a, tok, mask)
    return post, part


def _shares(x: torch.Tensor, parts: dict, mask: torch.Tensor, alpha: float) -> dict:
    m = mask.double()
    q = unit_sums(x * x * m, mask.shape)
    out = {}
    for name, p in parts.items():
        s = unit_sums(p * x * m, mask.shape)
        if float(q.sum()) == 0:
            out[name] = (0.0, 0.0, 0.0)
            continue
        ct = cluster_t(s, q, alpha)
        mean, half = ct.mean.item(), ct.half.item()
        out[name] = (mean, mean - half, mean + half)
    return out


def localize(trainer: Engine, engine: Engine, input_ids, attention_mask=None, *, margin: float = 8.0,
             alpha: float = 0.01, seed: int = 0, tol: float = 1e-3, target: str | None = None,
             tokenizer=None, u: float | None = None, progress=None, score_mask=None) -> Result:
    """Localise the engine's drift from the trainer on the same tokens: per stage own and
    free errors against the noise floor, the op inside the first stage beyond noise, the
    weight sync, the log-prob semantics, the routing, and the decomposition (module doc).
    input_ids [B, L] (B >= 1 distinct sequences: with fewer than 4, each is cut into spans of
    tokens, the units of the tests and intervals: trainprobes.drift.units); positions 0..L-2
    score tokens 1..L-1. tokenizer:
    optional, to name the heaviest tokens (trainprobes.drift.carriers). u: the unit roundoff
    of the nominal precision (default: from the coarser engine's dtype). progress(forwards
    done, what runs next): said before each run (a long model's command line shows it).
    score_mask [B, L] (bool): the tokens whose log-probs are compared (default: every attended
    one); the forwards still see every attended token. A sampler's truncated log-probs are
    finite only on its own samples: score the completion, not the prompt."""
    ids = torch.as_tensor(input_ids)
    tell = progress or (lambda done, what: None)
    loc = localize_layers(trainer, engine, ids, attention_mask, margin=margin, alpha=alpha, seed=seed, u=u,
                          progress=progress)
    tell(loc.n_forwards, "weights, routing replay, log-prob semantics and the decomposition")
    am = None if attention_mask is None else torch.as_tensor(attention_mask)
    mask = torch.ones(ids.shape, dtype=torch.bool) if am is None else am.bool()
    mask = mask[:, 1:] & mask[:, :-1]
    if score_mask is not None:
        sm = torch.as_tensor(score_mask)
        if sm.shape != ids.shape:
            raise InvalidArgument(f"score_mask has shape {tuple(sm.shape)}, expected {tuple(ids.shape)} like "
                                  "input_ids (True where a token's log-prob is compared)")
        mask = mask & sm.bool()[:, 1:]
    tok = ids[:, 1:]
    fa = trainer.logprobs
    z_a, z_b = loc.runs.logits_a[:, :-1], loc.runs.logits_b[:, :-1]  # the free runs' own logits
    if z_a.shape != z_b.shape:
        raise InvalidArgument(f"the {trainer.name}'s logits have shape {tuple(z_a.shape)} and the "
                              f"{engine.name}'s {tuple(z_b.shape)}: a vocabulary of {z_a.shape[-1]} against "
                              f"{z_b.shape[-1]} (a tokenizer mismatch?); both must score the same ids")
    _check_truncated(z_a, None, mask, trainer.name)
    _check_truncated(z_b, z_a, mask, engine.name)
    lp_a = fa(z_a).double()
    lp_b = engine.logprobs(z_b)
    _check_logprobs(lp_b, tok, mask, engine.name)
    x = _tok(lp_b, lp_a, tok, mask)
    dropped = mask & ~torch.isfinite(x)
    n_real = int(mask.sum())
    if bool(dropped.any()):
        mask = mask & ~dropped  # a token the engine cannot emit: named, not averaged
        x = torch.where(mask, x, 0.0)
    _check_judged(n_real, int(dropped.sum()), engine.name)
    n_forwards = loc.n_forwards
    # 1. weights
    sync = weight_sync(trainer.module, engine.module)
    stale = [s for s in sync if s.status == "mismatch"]
    unmatched = [s for s in sync if s.status == "missing"]  # not compared: never stale (weights doc)
    parts = {}
    eng = engine
    if stale:
        eng = Engine(synced_copy(trainer.module, engine.module, [s.name for s in stale]),
                     engine.logprobs, engine.convention, engine.name + " (weights synced)")
        z_f = _logits(eng, ids, am)
        n_forwards += 1
        parts["weights"] = x - _tok(engine.logprobs(z_f), lp_a, tok, mask)
        z_b = z_f
    # 2. routing: replay the trainer's choices in the (synced) engine
    rt = routing(loc.runs.a, loc.runs.b_free, mask_full(ids, am))
    z_r = _replayed(eng, loc, ids, am) if rt is not None else None
    if z_r is not None:
        n_forwards += 1
        parts["routing"] = (_tok(engine.logprobs(z_b), lp_a, tok, mask)
                            - _tok(engine.logprobs(z_r), lp_a, tok, mask))
        z_b = z_r
    # 3. after lm_head: the engine's lm_head output through the trainer's own post-processing
    post, post_part = _post(trainer, eng, engine, loc, z_b, ids, am, mask, tok, lp_a, margin, alpha)
    n_forwards += 1 + (eng is not engine or rt is not None)  # the hybrid, and a new record
    # 4. semantics: both sides' log-prob functions on the SAME logits, so no numerics enter
    sem = semantics(fa(z_b), engine.logprobs(z_b), tok, mask, alpha=alpha, tol=tol)
    if post.affine:  # a logit rescale in the model's forward is a temperature
        sem.parts["temperature"] = sem.parts["temperature"] + post_part
        sem.slope, sem.slope_ci = sem.slope * post.slope if sem.temperature else post.slope, post.slope_ci
        sem.temperature = True
    parts["temperature"] = sem.parts["temperature"]
    parts["renormalisation"] = sem.parts["renormalisation"]
    # 4. numerics by stage: the stages beyond noise of the engine as it now stands
    num_loc = loc if not stale else localize_layers(trainer, eng, ids, am, margin=margin, alpha=alpha,
                                                    seed=seed, ops=False, u=loc.u)
    if stale:
        n_forwards += num_loc.n_forwards
    beyond = [r for r in num_loc.stages if r.verdict == "beyond"]
    by_stage = {}
    blocks = frozenset(s.name for s in loc.layout.stages if s.role == "block")
    for r in beyond:
        if r.role == HAND_OFF:
            stage = r.name[len(hand_off_name("")):]
            z_h = _hybrid_in(trainer, num_loc.runs.b_patched[stage], stage, blocks, ids, am)
        else:
            z_h = _hybrid(trainer, num_loc.runs.b_patched[r.name], r.name, ids, am)
        by_stage[r.name] = _tok(fa(z_h), lp_a, tok, mask)
        n_forwards += 1
    if post.report.verdict == "beyond" and not post.affine:
        by_stage[post.report.name] = post_part
        beyond.append(post.report)
    loc.stages.append(post.report)
    if post.report.verdict == "beyond" and loc.first_layer is None:
        loc.first_layer, loc.op, loc.op_module = post.report.name, ROLE, post.report.name[len("after "):]
    # the log-prob functions on the same logits, once temperature and renormalisation are out
    fn = judge_logprobs(fa, z_b, sem.parts["numerics"], tok, mask, u=loc.u, margin=margin, alpha=alpha,
                        n_stages=len(loc.stages) + 1, seed=seed,
                        free_error=x[mask].abs().mean().item() if bool(mask.any()) else 0.0)
    loc.stages.append(fn)
    if fn.verdict == "beyond":
        by_stage[fn.name] = sem.parts["numerics"]
        beyond.append(fn)
        if loc.first_layer is None:
            loc.first_layer, loc.op, loc.op_module = fn.name, LOGPROBS_ROLE, fn.name
    parts["numerics"] = sum(by_stage.values(), torch.zeros_like(x))
    for k in PARTS[:-1]:
        parts.setdefault(k, torch.zeros_like(x))
    parts["unexplained"] = x - sum(parts[k] for k in PARTS[:-1])
    shares = _shares(x, {**{k: parts[k] for k in PARTS}, **{f"numerics[{n}]": v for n, v in by_stage.items()}},
                     mask, alpha)
    # 5. kind
    exact = bool((x[mask] == 0).all()) and all(r.verdict == "exact" for r in loc.stages) and not stale
    found = {"weights": bool(stale), "temperature": sem.temperature, "renormalisation": sem.renormalised,
             # flips are a cause only where replaying the trainer's choices removes a share of
             # the drift that is not zero (flips at unscored positions, or whose experts agree,
             # explain nothing: a bf16 noise pair was kind 'routing' at a share of 0.0)
             "routing": rt is not None and rt.frac_decisions > 0 and shares["routing"][1] > 0,
             "numeric": bool(beyond)}
    share_of = {"weights": "weights", "temperature": "temperature", "renormalisation": "renormalisation",
                "routing": "routing", "numeric": "numerics"}
    cands = [k for k, v in found.items() if v]
    kind = "exact" if exact else max(cands, key=lambda k: shares[share_of[k]][0]) if cands else "noise"
    if kind == "routing" and loc.first_layer is None:
        # no stage's numerics beyond noise, but decisions flip: where they first flip is the answer
        flipped = next(r.name for r in rt.routers if r.n_flipped)
        block = next((s.name for s in loc.stages if flipped.startswith(s.name + ".")), flipped)
        loc.first_layer, loc.op, loc.op_module = block, "router", flipped
    carried = carriers(x, mask, lp_a.gather(-1, tok[..., None]).squeeze(-1), tok, tokenizer)
    before = loc.n_forwards
    explained = explains(kind, loc, shares, rt)
    n_forwards = round(n_forwards + loc.n_forwards - before, 3)  # the ops of the stage that explains it
    return _result(trainer, engine, loc, kind, shares, sem, rt, stale, unmatched, sync, x, mask, dropped,
                   margin, alpha, seed, n_forwards, target, carried, explained)


def explains(kind: str, loc: Localisation, shares: dict, rt) -> tuple:
    """(stage, op, module) that explains the drift, the answer a user acts on; it differs from
    the first stage beyond noise when an earlier stage is beyond noise but carries ~none of
    it (every router in bf16: block 0's router logits differ, its decisions do not flip, the
    flips from block 1 on carry the drift). routing: the block of the first router whose
    decisions flip (replaying them removed the share); numeric: the stage beyond noise with
    the largest numerics share (a block: the op inside it, searched as for the first stage);
    otherwise the first stage beyond noise."""
    first = (loc.first_layer or "", loc.op or "", loc.op_module or "")
    if kind == "routing" and rt is not None:
        flipped = next((r.name for r in rt.routers if r.n_flipped), None)
        if flipped is not None:
            block = next((s.name for s in loc.layout.stages if flipped.startswith(s.name + ".")), flipped)
            return block, "router", flipped
    if kind == "numeric":
        by = {k[len("numerics["):-1]: v[0] for k, v in shares.items() if k.startswith("numerics[")}
        if by:
            best = max(by, key=by.get)
            if best != first[0] and by[best] > by.get(first[0], 0.0):
                row = next((r for r in loc.stages if r.name == best), None)
                role = row.role if row is not None else ""
                if role == HAND_OFF:
                    return best, HAND_OFF, best[len(hand_off_name("")):]
                if role == "block" and loc.context is not None:  # the op inside it, as for the first
                    ops, op_role, op_module, more = loc.context.ops_of(row, loc.layout)
                    loc.ops += ops
                    loc.n_forwards = round(loc.n_forwards + more, 3)
                    return best, op_role, op_module
                return best, role, best
    return first


# fewest scored tokens that must stay judged (finite on both sides), as a share of the real
# ones: an engine that reports -inf for most tokens is not "exact" on the rest
MIN_JUDGED_SHARE = 0.5


def _check_logprobs(lp: torch.Tensor, tok, mask, who: str) -> None:
    """NaN or +inf in the engine's log-probs on a real position is a broken sampler, not a
    token it cannot emit (that is -inf): nothing can be judged from it."""
    bad = (torch.isnan(lp) | (lp == torch.inf))[mask]
    if bool(bad.any()):
        pos = int((bad.any(-1)).sum())
        raise InvalidArgument(f"the {who}'s log-probs hold NaN or +inf at {pos} of {int(mask.sum())} real "
                              "positions: a log-prob is finite or -inf (a token it cannot emit); fix the "
                              "engine's log-prob function (an overflow?) before localising")


def _check_truncated(z: torch.Tensor, ref: torch.Tensor | None, mask, who: str) -> None:
    """Logits with -inf entries on real positions come from a forward that truncates the
    distribution itself (a top-p or top-k applied inside it): the comparison stage by stage
    and the log-prob semantics need the full distribution from the forward, and the
    truncation belongs to the log-prob function, where it is measured (renormalisation).
    ref: the other side's logits, to say whether the kept entries are its top ones (a nucleus)."""
    cut = torch.isneginf(z) & mask[..., None]
    if not bool(cut.any()):
        return
    pos = cut.any(-1)
    n_pos, n_real = int(pos.sum()), int(mask.sum())
    kept = (~cut[pos]).sum(-1).double()
    where = ""
    if ref is not None and bool(torch.isfinite(ref[pos]).all()):
        r = ref[pos].double()
        low_kept = torch.where(cut[pos], torch.inf, r).min(-1).values
        high_cut = torch.where(cut[pos], r, -torch.inf).max(-1).values
        top = int((low_kept >= high_cut).sum())
        where = (f"; at {top} of them the kept entries are the top ones by the other side's logits "
                 "(a nucleus)")
    raise InvalidArgument(
        f"the {who}'s logits hold -inf at {n_pos} of {n_real} real positions ({kept.mean().item():.1f} of "
        f"{z.shape[-1]} entries kept on average){where}: a top-p or top-k truncation applied inside its "
        "forward. Localisation compares the full distributions stage by stage: return the raw logits from "
        "the forward and give the truncation as the engine's log-prob function (Engine(module, logprobs=f), "
        "e.g. trainprobes.drift.faults.top_p_logprobs), where it is measured as renormalisation")


def _check_judged(n_real: int, n_dropped: int, who: str) -> None:
    judged = n_real - n_dropped
    if n_real == 0 or judged < MIN_JUDGED_SHARE * n_real:
        raise InvalidArgument(f"only {judged} of {n_real} scored tokens have a finite log-prob under the "
                              f"{who} ({n_dropped} are -inf): at least {MIN_JUDGED_SHARE:.0%} must be judged; "
                              "score tokens the engine can emit (its own samples) or compare raw log-probs")


def _tok(lp: torch.Tensor, lp_a: torch.Tensor, tok, mask) -> torch.Tensor:
    d = lp.gather(-1, tok[..., None]).squeeze(-1) - lp_a.gather(-1, tok[..., None]).squeeze(-1)
    return torch.where(mask, d, 0.0)


def mask_full(ids, am):
    return torch.ones(ids.shape, dtype=torch.bool) if am is None else am.bool()


def _result(trainer, engine, loc, kind, shares, sem, rt, stale, unmatched, sync, x, mask, dropped, margin,
            alpha, seed, n_forwards, target, carried, explained=("", "", "")) -> Result:
    xs = x[mask]
    flips = rt.per_layer() if rt is not None else {}
    rounded = [s for s in sync if s.status == "trainer_rounded"]
    metrics = {
        "engines_agree": kind in ("exact", "noise"), "kind": kind,
        "first_layer": loc.first_layer or "", "op": loc.op or "", "op_module": loc.op_module or "",
        "explained_by": explained[0], "explained_by_op": explained[1], "explained_by_module": explained[2],
        "n_tokens": int(mask.sum()), "n_sequences": int(mask.shape[0]), "n_units": n_units(*mask.shape),
        "mean_log_ratio": xs.mean().item() if xs.numel() else 0.0,
        "mean_abs_log_ratio": xs.abs().mean().item() if xs.numel() else 0.0,
        "max_abs_log_ratio": xs.abs().max().item() if xs.numel() else 0.0,
        "n_dropped_tokens": int(dropped.sum()),
        "n_stale_tensors": len(stale), "n_trainer_rounded_tensors": len(rounded),
        "n_unmatched_tensors": len(unmatched), "n_forwards": n_forwards,
        "margin": margin, "alpha": alpha,
        "nominal_roundoff": loc.u,
        **{f"share_{k}": v[0] for k, v in shares.items() if "[" not in k},
        **{f"share_{k}_ci_low": v[1] for k, v in shares.items() if "[" not in k},
        **{f"share_{k}_ci_high": v[2] for k, v in shares.items() if "[" not in k},
        **{f"share_{k}": v[0] for k, v in shares.items() if "[" in k},
        **sem.as_metrics(),
    }
    for r in loc.stages:
        metrics[f"own_error[{r.name}]"] = r.own_error
        metrics[f"free_error[{r.name}]"] = r.free_error
        metrics[f"noise_floor[{r.name}]"] = r.noise_floor
    for name, f in flips.items():
        metrics[f"routing_mismatch[{name}]"] = f
    if rt is not None:
        metrics["routing_frac_decisions"] = rt.frac_decisions
        metrics["routing_frac_tokens_any_layer"] = rt.frac_tokens_any_layer
    where = ""
    if loc.first_layer:
        beyond = any(r.verdict == "beyond" for r in loc.stages)
        own = shares.get(f"numerics[{loc.first_layer}]")
        where = (f"first stage beyond noise {loc.first_layer} (op {loc.op}: {loc.op_module}"
                 + (f"; numerics {own[0]:.0%}" if own is not None else "") + "); " if beyond else
                 f"no stage beyond noise; decisions first flip at {loc.op_module}; ")
        # a second fault later on may carry most of the drift: name every stage beyond with its share
        later = [r.name for r in loc.stages if r.verdict == "beyond" and r.name != loc.first_layer]
        if later:
            where += "also beyond noise: " + ", ".join(
                f"{n}" + (f" (numerics {shares[f'numerics[{n}]'][0]:.0%})" if f"numerics[{n}]" in shares else "")
                for n in later) + "; "
    named = ", ".join(s.name for s in stale[:5]) + (" ..." if len(stale) > 5 else "")
    held = (f"the trainer holds {len(rounded)} tensor(s) rounded to a coarser dtype than the engine's "
            f"({', '.join(s.name for s in rounded[:3])}{' ...' if len(rounded) > 3 else ''}: a trainer-side "
            "precision loss, counted in numerics); " if rounded else "")
    parts = "; ".join(f"{k} {shares[k][0]:.0%}" for k in PARTS if abs(shares[k][0]) >= 0.005)
    odd = ([s.name for s in unmatched if s.note == "not in the engine"],
           [s.name for s in unmatched if s.note != "not in the engine"])
    apart = (f" ({len(unmatched)} tensor(s) have no counterpart of the same name and were not compared: "
             f"only the trainer's {', '.join(odd[0][:3])}{' ...' if len(odd[0]) > 3 else ''}; only the "
             f"engine's {', '.join(odd[1][:3])}{' ...' if len(odd[1]) > 3 else ''})" if unmatched else "")
    if explained[0] and explained[0] != loc.first_layer:  # the answer first, the first beyond noise beside it
        share = shares.get(f"numerics[{explained[0]}]")
        where = (f"explained by {explained[0]} (op {explained[1]}: {explained[2]}"
                 + (f"; decisions first flip here, routing {shares['routing'][0]:.0%}" if explained[1] == "router"
                    else f"; numerics {share[0]:.0%}" if share is not None else "")
                 + f"), not by the first stage beyond noise; {where}")
    if kind == "exact":
        msg = "exact: the engines agree bit for bit at every stage"
    elif kind == "noise":
        msg = (f"noise: every stage's own error is within its noise floor (x{margin:g}) at the nominal "
               f"precision (unit roundoff {loc.u:.3g}); no stage is to blame; mean |log-ratio| "
               f"{metrics['mean_abs_log_ratio']:.3g} nats")
        if rt is not None and rt.frac_decisions:  # R3's figures, though replay explains no share
            lo, hi = shares["routing"][1:]
            msg += (f"; {rt.frac_decisions:.1%} of router decisions flip ({rt.frac_tokens_any_layer:.0%} of "
                    f"tokens in >= 1 layer), replay explains a share in [{lo:.2g}, {hi:.2g}]")
    else:
        msg = (f"{kind}: {where}"
               + (f"engine tensors that differ from the trainer's beyond its dtype conversion (stale or "
                  f"wrong): {named}; " if stale else "") + held
               + (f"temperature slope {sem.slope:.4g}; " if sem.temperature else "")
               + (f"renormalised log-probs, mean log mass kept {sem.mean_log_mass_kept:.3g}; "
                  if sem.renormalised else "")
               + (f"{rt.frac_decisions:.1%} of router decisions differ, "
                  f"{rt.frac_tokens_any_layer:.0%} of tokens in >= 1 layer; " if rt and rt.frac_decisions else "")
               + f"shares: {parts}")
    msg += apart
    if n_units(*mask.shape) != mask.shape[0]:
        msg += f"; units: {describe(*mask.shape)}"
    evidence = {
        "stages": [r.as_dict() for r in loc.stages], "ops": [r.as_dict() for r in loc.ops],
        "weights": [s.__dict__ for s in sync if s.status != "exact"],
        "routing": [r.__dict__ for r in rt.routers] if rt is not None else [],
        "shares": {k: {"share": v[0], "ci_low": v[1], "ci_high": v[2]} for k, v in shares.items()},
        **carried,
        "residual_convention": {"trainer": trainer.convention, "engine": engine.convention},
        "units": describe(*mask.shape),
    }
    evidence["plots"] = [stage_plot(evidence["stages"], margin, f"{kind}: {target or trainer.name + ' vs ' + engine.name}",
                                    shares=evidence["shares"], kind=kind,
                                    explained_by=explained[0] or loc.first_layer or "")]
    codes = [] if kind in ("exact", "noise") else ["TP-D4"]
    verdict = "pass" if not codes else "fail"
    return Result(probe="drift.localize", target=target or f"{trainer.name} vs {engine.name}",
                  verdict=verdict, metrics=metrics, evidence=evidence, seed=seed, codes=codes,
                  message=msg)
