"""End to end: how much train/inference drift does batch variance alone make?

The same sequences' per-token log-probs computed at batch size 1 and inside batches (with
other sequences as companions, at shuffled positions) are two "engines" that differ only in
the batch: `trainprobes.drift.compare` judges them (clean, noisy, biased, heavy-tailed). With
the user's measured train/inference drift beside it, the share of that drift batch variance
explains: variance share = var(batch log-ratio) / var(measured log-ratio) (independent
noise sources add their variances; None above 1, where the measured drift cannot hold the
batch variance: variance_ratio keeps the figure), bias share = mean(batch) / mean(measured)
(None unless the measured mean's confidence interval excludes zero).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from trainprobes.causality.target import abs_diff
from trainprobes.drift import compare
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.result import Result
from trainprobes.validation import check_int

__all__ = ["end_to_end", "logprobs_of"]


def logprobs_of(model) -> Callable:
    """A log-prob function ids [b, L] -> [b, L-1] (log p of token i+1 given its prefix) for a
    HF causal LM, or the callable itself when it already is one."""
    if hasattr(model, "config") and callable(model):
        from trainprobes.drift.adapters import hf_token_logprobs
        return lambda ids: hf_token_logprobs(model, ids)[0]
    if not callable(model):
        raise TargetError(f"model={model!r} must be a HF causal LM or a callable ids -> log-probs")
    return model


def _lp(fn, ids, name):
    try:
        with torch.no_grad():
            out = fn(ids)
    except Exception as e:
        raise TargetError(f"target {name!r} raised {type(e).__name__}: {e} (on ids "
                          f"{tuple(ids.shape)!r})") from e
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != ids.shape[0]:
        raise TargetError(f"target {name!r} returned {type(out).__name__}"
                          f"{tuple(getattr(out, 'shape', ()))!r} for ids {tuple(ids.shape)!r}; "
                          f"expected per-token log-probs [b, T]")
    return out.detach().float().cpu()


def end_to_end(model, sequences: torch.Tensor, *, sizes=(8,), vocab: int | None = None,
               seed: int = 0, measured=None, target: str | None = None,
               **compare_options) -> Result:
    """Log-probs of each sequence alone vs inside batches, judged as drift.

    model: a HF causal LM or a callable ids [b, L] -> log-probs [b, T] (one per scored token).
    sequences: token ids [N, L]. sizes: batch sizes; each sequence is computed once per size,
      at a shuffled position, with the other sequences (and, to fill the last batch, random
      companions from [0, vocab)) around it. The headline comparison is at the largest size.
    measured: your train/inference drift, as (train_logprobs, infer_logprobs) or a
      trainprobes.drift.compare Result; gives variance_share and bias_share.
    compare_options: passed to trainprobes.drift.compare (alpha, clip, min_bias, ...).

    A difference must reproduce (the first differing batch again, its differing sequence
    alone again), else the model is nondeterministic: TP-C2, batch_invariant None.
    """
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.is_floating_point():
        raise InvalidArgument(f"sequences must be token ids [N, L], got "
                              f"{type(sequences).__name__}{tuple(getattr(sequences, 'shape', ()))!r}")
    sizes = sorted({check_int(s, "sizes[...]", min=2) for s in sizes})
    if not sizes:
        raise InvalidArgument("sizes=() is empty: give batch sizes >= 2, e.g. (8,)")
    fn = logprobs_of(model)
    name = target or getattr(model, "name_or_path", None) or getattr(fn, "__qualname__", None) or "model"
    N, L = sequences.shape
    V = vocab or int(sequences.max()) + 1
    g = torch.Generator().manual_seed(seed)
    ids = sequences.detach()
    alone = torch.cat([_lp(fn, ids[i:i + 1], name) for i in range(N)])
    n_eval = N
    by_size, batched, first_differing = [], {}, None
    for b in sizes:  # a loop over batch sizes and batches
        order = torch.randperm(N, generator=g)
        got = torch.empty_like(alone)
        for start in range(0, N, b):
            rows = order[start:start + b]
            fill = b - len(rows)
            extra = torch.randint(V, (fill, L), generator=g).to(ids.device)
            batch = torch.cat([ids[rows], extra])
            perm = torch.randperm(b, generator=g)  # the sequences at shuffled positions
            out = _lp(fn, batch[perm], name)
            n_eval += 1
            back = out[perm.argsort()][:len(rows)]
            got[rows] = back
            moved = (abs_diff(alone[rows], back) > 0).any(1)
            if first_differing is None and moved.any():
                first_differing = (batch[perm], out, int(rows[moved.nonzero()[0, 0]]))
        d = abs_diff(alone, got)  # equal -inf log-probs are no difference
        by_size.append({"size": b, "frac_tokens_differ": float((d > 0).double().mean()),
                        "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean())})
        batched[b] = got
    if first_differing is not None:
        # a difference must reproduce, the batch again and its sequence alone again: else
        # it is nondeterminism (dropout left on, atomics), not batch variance
        inp, out, i = first_differing
        for where, x, before in ((f"a batch of {len(inp)}", inp, out),
                                 (f"sequence {i} alone", ids[i:i + 1], alone[i:i + 1])):
            n_eval += 1
            if (abs_diff(before, _lp(fn, x, name)) > 0).any():
                return _nondeterministic(name, seed, sizes, n_eval, where)
    head = sizes[-1]
    drift = compare(alone, batched[head], target=f"{name}: batch 1 vs {head}", **compare_options)
    m = drift.metrics
    variant = any(s["frac_tokens_differ"] > 0 for s in by_size)
    metrics = {"batch_invariant": not variant, "size": head,
               "frac_tokens_differ": by_size[-1]["frac_tokens_differ"],
               "max_abs_diff": by_size[-1]["max_abs_diff"], "drift_verdict": m["drift_verdict"],
               "mean_log_ratio": m["mean_log_ratio"], "std_log_ratio": m["std_log_ratio"],
               "k3_kl": m["k3_kl"], "p_value": m["p_value"], "n_tokens": m.get("n_tokens"),
               "n_evaluations": n_eval}
    shares = _shares(drift, measured, compare_options)
    metrics.update(shares)
    codes = [c for c in drift.codes if c in ("TP-D1", "TP-D2")]
    if variant:
        codes.insert(0, "TP-I2")
    # batch_invariant False never passes (result.PROBES); heavy-tailed alone warns
    verdict = "fail" if variant or "TP-D1" in codes else "warn" if codes else "pass"
    msg = (f"log-probs at batch 1 and inside batches of {', '.join(map(str, sizes))}: "
           + ("bit for bit identical" if not variant else
              f"{metrics['frac_tokens_differ']:.1%} of tokens differ at batch {head} (max "
              f"{metrics['max_abs_diff']:.3g} nats); as drift: {drift.message}"))
    if shares.get("variance_share") is not None:
        msg += (f"; batch variance explains {shares['variance_share']:.1%} of the measured "
                f"drift's variance")
    elif shares.get("variance_ratio") is not None:
        msg += (f"; batch variance alone is {shares['variance_ratio']:.3g} times the measured "
                f"drift's variance: that drift cannot contain it (measured on other tokens, or "
                f"by engines that batch differently)")
    if shares.get("bias_share") is not None:
        msg += f"; and {shares['bias_share']:.3g} of its mean (bias)"
    evidence = {"by_size": by_size, "drift": {"verdict": drift.verdict, "codes": drift.codes,
                                              "message": drift.message,
                                              "metrics": {k: v for k, v in m.items()
                                                          if not isinstance(v, (list, dict))}}}
    return Result(probe="isolation.end_to_end", target=name, verdict=verdict, metrics=metrics,
                  evidence=evidence, seed=seed, codes=codes, message=msg)


def _nondeterministic(name, seed, sizes, n_eval, where) -> Result:
    return Result(probe="isolation.end_to_end", target=name, verdict="fail", codes=["TP-C2"],
                  metrics={"batch_invariant": None, "n_evaluations": n_eval},
                  evidence={"sizes": sizes, "nondeterministic_in": where}, seed=seed,
                  message=f"{name} gave different log-probs for {where} on two identical calls; "
                          f"nondeterminism is not batch variance (.eval(), seeds, "
                          f"torch.use_deterministic_algorithms) and probe again")


def _shares(drift: Result, measured, options) -> dict:
    if measured is None:
        return {"variance_share": None, "variance_ratio": None, "bias_share": None}
    if isinstance(measured, Result):
        mm = measured.metrics
    else:
        try:
            train, infer, *rest = measured
        except (TypeError, ValueError):
            raise InvalidArgument("measured must be (train_logprobs, infer_logprobs[, mask]) or a "
                                  "trainprobes.drift.compare Result") from None
        mm = compare(train, infer, mask=rest[0] if rest else None, **options).metrics
    for k in ("std_log_ratio", "mean_log_ratio"):
        if not isinstance(mm.get(k), (int, float)):
            raise InvalidArgument(f"measured drift has no numeric {k!r}: pass a drift.compare Result")
    var_b, var_m = drift.metrics["std_log_ratio"] ** 2, mm["std_log_ratio"] ** 2
    mean_b, mean_m = drift.metrics["mean_log_ratio"], mm["mean_log_ratio"]
    ratio = var_b / var_m if var_m > 0 else (math.inf if var_b > 0 else None)
    # a share is at most the whole: a larger ratio says the measured drift cannot hold this
    # batch variance (other tokens, or engines that batch differently), not that it explains
    # more than all of it
    share = ratio if ratio is not None and ratio <= 1 else None
    # a share of the bias exists only where the measured drift has one: a ratio of two
    # means that cannot be told from zero is noise over noise, of any sign and size
    lo, hi = mm.get("ci_low"), mm.get("ci_high")
    significant = (isinstance(lo, (int, float)) and isinstance(hi, (int, float))
                   and (lo > 0 or hi < 0))
    return {"variance_share": share, "variance_ratio": ratio,
            "bias_share": mean_b / mean_m if significant else None,
            "measured_std_log_ratio": mm["std_log_ratio"], "measured_mean_log_ratio": mean_m}
