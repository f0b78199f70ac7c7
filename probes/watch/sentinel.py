"""The sentinel: what it samples, what it keeps, when it judges, where verdicts go.

    sentinel = Sentinel(findings="findings.jsonl")   # one per rank, same arguments everywhere
    attach_ddp(ddp_model, sentinel, hook=my_hook)     # or SentinelCallback for a Trainer
    for batch in data:
        ...; optimizer.step()
        sentinel.step()                               # the per-step call
    sentinel.close()                                  # final Results; also on `with`

Promises (tests/test_watch.py): it changes no bit of the run (its own torch.Generator, its
own process group, fp64 copies that are never views of the run's tensors), its copies stay
within `budget` bytes (at most PEAK_WINDOWS fp64 windows of `window` elements per checked
bucket of a step, max_per_step of them, alive at once), and an error of its own is logged,
counted and reported in the final Result, never raised into the training step. With stop_on_finding=True a finding ends the
run: every Result is written first, then step() raises SentinelFinding (exit code 1).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch
from trainprobes.errors import InvalidArgument, OutputExists, TrainprobesError
from trainprobes.numerics.bias import signed_relative_error
from trainprobes.result import Result
from trainprobes.validation import check_bool, check_int, check_number, check_seed
from trainprobes.watch.stream import Judgement, Streams

log = logging.getLogger("trainprobes.watch")
# a finding is the bias probe's Result (metrics as numerics.bias documents them), so the
# report and the gate read it as any other; where it came from is in target and evidence
PROBE = "numerics.bias"
# fp64 windows alive at a sample's peak, in its check: the reduced reference, the copy of
# the hook's output, and signed_relative_error's sign(ref), low - ref and their product.
# Measured (benchmarks/bench_watch.py --memory): 5.02 to 5.07 windows of extra peak RSS.
PEAK_WINDOWS = 5
POOLED = "all_buckets"


class SentinelFinding(TrainprobesError, RuntimeError):
    """stop_on_finding=True and the sentinel found something; .results holds every Result
    (already written). Uncaught it ends the process with exit code 1, a finding."""

    exit_code = 1

    def __init__(self, results: list):
        self.results = results
        found = [r for r in results if r.verdict == "fail"]
        super().__init__("; ".join(f"{r.target}: {r.message}" for r in found) or "finding")


class Sentinel:
    """Sampled checks of a live run's gradient reductions; see the module docstring.

    sample: the share of steps checked; a checked step re-reduces `max_per_step` of its
        buckets in fp64, chosen uniformly (so each bucket is checked alike).
    interval: steps between looks (judgements); alpha: the chance of any false "biased"
        over the whole run, spent over looks and buckets (trainprobes.watch.stream).
    min_effect: the smallest |relative bias| called biased. The default, 2^-12 (2.4e-4,
        bf16's unit roundoff / 16, numerics.bias.default_min_effect('bf16')), is a
        learning rate off by 0.024%; a gradient reduction with a smaller bias does not
        matter to a run, however many samples resolve it.
    window: elements of a bucket re-reduced per sample (a random window when the bucket is
        larger); budget: the bytes the sentinel may hold for its copies at once.
    findings: a JSON lines file; each finding is appended as it happens, the final Results
        at close(). Only rank `write_rank` writes it (every rank judges the same numbers);
        this process's rank is read when it writes (torch.distributed once initialised,
        else $RANK, else 0), since callbacks are often built before the process group
        exists; `rank` fixes it instead. A file that exists is refused (another run's
        findings) unless append=True (a resumed run adding to its own): at construction
        where the rank is known then, else at the first write (counted as its own error,
        nothing written).
    """

    def __init__(self, *, sample: float = 0.25, interval: int = 10, alpha: float = 0.01,
                 min_effect: float = 2.0 ** -12, window: int = 1 << 16, max_per_step: int = 1,
                 budget: int = 8 << 20, keep: int = 4096, seed: int = 0,
                 findings: str | Path | None = None, rank: int | None = None,
                 write_rank: int = 0, stop_on_finding: bool = False, timeout: float = 300.0,
                 append: bool = False):
        self.sample = check_number(sample, "sample", min=0, max=1, min_open=True,
                                   hint="the share of steps checked, e.g. 0.25")
        self.interval = check_int(interval, "interval", min=1, hint="steps between looks")
        self.window = check_int(window, "window", min=16, hint="elements per sample, e.g. 65536")
        self.max_per_step = check_int(max_per_step, "max_per_step", min=1)
        self.budget = check_int(budget, "budget", min=1, hint="bytes, e.g. 8 << 20")
        need = PEAK_WINDOWS * 8 * self.window * self.max_per_step
        if need > self.budget:
            per = PEAK_WINDOWS * 8 * self.max_per_step
            raise InvalidArgument(f"window={window} and max_per_step={max_per_step} need {need} bytes "
                                  f"({PEAK_WINDOWS} fp64 windows per sample at its peak), over "
                                  f"budget={budget}: lower window to {self.budget // per} or raise budget")
        self.seed = check_seed(seed)
        self.stop_on_finding = check_bool(stop_on_finding, "stop_on_finding")
        self.timeout = check_number(timeout, "timeout", min=0, min_open=True, hint="seconds")
        self.streams = Streams(alpha=alpha, min_effect=min_effect, keep=keep)
        self.findings = Path(findings) if findings is not None else None
        self._rank = check_int(rank, "rank", min=0) if rank is not None else None
        self.write_rank = check_int(write_rank, "write_rank", min=0, hint="the rank that writes findings")
        self.append = check_bool(append, "append")
        self._output_checked = False
        self._refused = False
        if rank is not None or _rank_known():
            self._check_output()
        self.steps = 0
        self.results: list[Result] = []
        self.errors: list[str] = []  # the newest 100 messages of its own errors
        self._error_count = 0
        self._reported_findings = 0
        self.relayouts = 0
        # wall seconds of its own work: in the hook before the user's hook and in the check
        # (the wait for its fp64 reduction included); at looks
        self.own_seconds = 0.0
        self.look_seconds = 0.0
        self._generator = torch.Generator().manual_seed(self.seed)
        self._lock = threading.Lock()
        self._calls_in_step = 0  # bucket hook calls so far in this step
        self._last_calls = 0  # in the last step that had any (DDP's buckets per step)
        self._chosen: set = set()
        self._hook = None
        self._ddp = None
        # attach_fsdp2's record (.name: the reduce-scatter it wraps, .evidence() -> dict)
        self._fsdp = None
        # samples whose fp64 reduction is still in flight, checked at the next step() or
        # close() (attach_fsdp2: on a GPU, reading them inside backward would stall it)
        self._flushes: list = []
        self._group = None  # its own process group (attach_ddp), the hook's group's ranks
        self._hook_calls = 0
        self._closed = False
        self.last_judgements: list[Judgement] = []
        # why the per-step bias test does not apply to the registered hook (error feedback),
        # set by attach_ddp; then nothing is sampled and the final Result cannot judge
        self.not_applicable: str | None = None
        # other checks stepped and closed with it (watch_routers, watch_updates): each has
        # step(step) -> new finding Results, close() -> final Results, summary() -> dict
        self.watches: list = []

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else _rank()

    def _check_output(self) -> None:
        self._output_checked = True
        if (self.findings is not None and self.rank == self.write_rank and self.findings.exists()
                and not self.append):
            raise OutputExists(f"findings={str(self.findings)!r} exists (another run's findings?): "
                               "pass another path, or append=True to add to it")

    def plan(self) -> dict:
        """What must be alike on every rank for every rank to draw the same samples and
        issue the same collectives (attach_ddp compares it across ranks)."""
        return {"seed": self.seed, "sample": self.sample, "window": self.window,
                "max_per_step": self.max_per_step, "interval": self.interval,
                "alpha": self.streams.alpha, "min_effect": self.streams.min_effect,
                "keep": self.streams.keep, "not_applicable": self.not_applicable is not None}

    # --- called from the comm hook (on DDP's and gloo's threads) ----------------------

    def _choose(self, numel: int, window: int | None = None):
        """(start, n) of the window to check (n: at most `window`, default the
        sentinel's), or None. The same draws on every rank: at a
        step's first bucket, whether the step is checked (`sample`) and which of its buckets
        (max_per_step of them, uniformly among as many as the last step with buckets had),
        then one draw per bucket for the window's start. Every bucket is checked alike, and
        the cost per step stays bounded whatever the number of buckets."""
        i = self._calls_in_step
        self._calls_in_step += 1
        if i == 0:
            u = float(torch.rand(1, generator=self._generator, dtype=torch.float64))
            order = torch.randperm(max(self._last_calls, 1), generator=self._generator)
            self._chosen = set(order[:self.max_per_step].tolist()) if u < self.sample else set()
        pos = float(torch.rand(1, generator=self._generator, dtype=torch.float64))
        if i not in self._chosen:
            return None
        n = min(numel, self.window if window is None else window)
        return int(pos * (numel - n + 1)), n

    def _take(self, buffer: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """A new fp64 tensor of n + 1 elements: buffer[start:start+n], then 0, the flag
        that this rank took its sample (a rank that fails sends 1 instead, see attach_ddp).
        Never a view of the buffer: the reduction works on it in place."""
        out = torch.empty(n + 1, dtype=torch.float64)
        out[:n].copy_(buffer.detach().reshape(-1)[start:start + n])
        out[n] = 0.0
        return out

    def _record(self, key: str, numel: int, step: int, low, ref, skipped: bool = False) -> None:
        zero = not skipped and bool(ref.abs().sum() == 0)
        err = float("nan") if zero or skipped else signed_relative_error(low, ref)
        with self._lock:
            s = self.streams.streams.get(key)
            if s is not None and s.numel != numel:  # DDP rebuilt its buckets
                self.relayouts += 1
                del self.streams.streams[key]
            new = self.streams.stream(key, numel)
            if s is not None and s is not new and s.found_at is not None:
                # the samples start afresh, the finding made on this bucket stands
                new.found_at, new.found = s.found_at, s.found
            new.add(step, err, zero_reference=zero, skipped=skipped)
            # every bucket's samples together: a reduction biased everywhere (a hook's own
            # arithmetic) is caught on the samples of all buckets, not each bucket's few
            self.streams.stream(POOLED, 0).add(step, err, zero_reference=zero, skipped=skipped)

    def _own_error(self, where: str, e: BaseException) -> None:
        msg = f"step {self.steps}, {where}: {type(e).__name__}: {e}"
        with self._lock:
            self.errors.append(msg)
            del self.errors[:-100]  # the count is kept apart; the newest 100 messages
            self._error_count += 1
        log.warning("trainprobes sentinel (its own error, the run goes on): %s", msg)

    def _add_time(self, seconds: float) -> None:
        with self._lock:
            self.own_seconds += seconds

    @property
    def error_count(self) -> int:
        return self._error_count

    # --- the per-step call ------------------------------------------------------------

    def add_watch(self, watch) -> None:
        """Step and close another check with this sentinel (watch_routers, watch_updates)."""
        self.watches.append(watch)

    def _step_watches(self) -> list[Result]:
        found = []
        for w in self.watches:
            try:
                found += w.step(self.steps)
            except Exception as e:
                self._own_error(f"stepping {type(w).__name__}", e)
        return found

    def _flush(self) -> None:
        """Check the samples whose fp64 reduction was left in flight (attach_fsdp2)."""
        for flush in self._flushes:
            try:
                flush()
            except Exception as e:
                self._own_error("checking a sample", e)

    def step(self) -> list[Result]:
        """Close a training step; at every `interval`-th, judge. Returns new findings."""
        self._flush()
        watched = self._step_watches()  # at the step count its forwards ran under
        for r in watched:
            self.report(r)  # SentinelFinding (stop_on_finding) leaves the step from here
        self.steps += 1
        if self._calls_in_step:
            self._last_calls = self._calls_in_step
        self._calls_in_step = 0
        if self.steps % self.interval:
            return watched
        t0 = time.perf_counter()
        try:
            with self._lock:
                judged = self.streams.look(self.steps)
            self.last_judgements = judged
            new = [self._result(j) for j in judged if j.biased and
                   self.streams.streams[j.key].found_at == self.steps]
        except Exception as e:
            self._own_error("judging", e)
            return watched
        finally:
            self.look_seconds += time.perf_counter() - t0
        for r in new:
            self.results.append(r)
            self._write(r)
        if new and self.stop_on_finding:
            raise SentinelFinding(self.close())
        return watched + new

    def report(self, result: Result) -> None:
        """Add a Result of another check (the packing check): kept, written, and with
        stop_on_finding a failing one ends the run as a bias finding does."""
        self.results.append(result)
        self._write(result)
        self._reported_findings += result.verdict == "fail"
        if result.verdict in ("fail", "error"):  # rank-local checks: the file is write_rank's only
            rank = self.rank
            log.warning("trainprobes sentinel: rank %d, %s %s%s: %s", rank, result.probe,
                        "finding" if result.verdict == "fail" else "cannot judge",
                        "" if self.findings is None or rank == self.write_rank else
                        f" (not in {self.findings}: rank {self.write_rank} writes it)",
                        result.message)
        if result.verdict == "fail" and self.stop_on_finding:
            raise SentinelFinding(self.close())

    def summary(self) -> dict:
        """Numbers for a trainer's logger: the latest look, flat."""
        j = [x for x in self.last_judgements if x.stats is not None and x.key != POOLED]
        pooled = [x for x in self.last_judgements if x.stats is not None and x.key == POOLED]
        out = {"sentinel/step": self.steps, "sentinel/samples": sum(
            s.samples for k, s in self.streams.streams.items() if k != POOLED),
            "sentinel/buckets_judged": len(j), "sentinel/biased_buckets": sum(bool(x.biased) for x in j),
            "sentinel/own_errors": self.error_count,
            "sentinel/skipped": self.streams.streams[POOLED].skipped if POOLED in self.streams.streams else 0,
            # streams found biased (once each, however often judged) and other checks' findings
            "sentinel/findings": sum(s.found_at is not None for s in self.streams.streams.values())
            + self._reported_findings}
        if pooled:
            out["sentinel/bias"] = pooled[0].stats["bias"]
            out["sentinel/biased"] = int(bool(pooled[0].biased))
        if j:
            worst = max(j, key=lambda x: abs(x.stats["bias"]))
            out["sentinel/worst_bucket_bias"] = worst.stats["bias"]
        for w in self.watches:
            out.update(w.summary())
        return out

    # --- Results ----------------------------------------------------------------------

    def _evidence(self) -> dict:
        from trainprobes.watch.ddp import ddp_hook_name
        # what it watches: FSDP2's reduce-scatter (attach_fsdp2) or DDP's comm hook
        where = (self._fsdp.evidence() if self._fsdp is not None else
                 {"hook_configured": getattr(self._hook, "__qualname__", None),
                  "hook_registered_in_ddp": ddp_hook_name(self._ddp) if self._ddp is not None else None})
        return {**where, "hook_calls": self._hook_calls, "steps": self.steps, "sample": self.sample,
                "interval": self.interval, "window": self.window, "budget": self.budget,
                "looks": self.streams.looks, "own_errors": self.error_count,
                "own_seconds": self.own_seconds, "look_seconds": self.look_seconds,
                "own_error_messages": list(self.errors), "relayouts": self.relayouts,
                "not_applicable": self.not_applicable,
                "correction": "alpha * 6/(pi^2 k^2) / buckets at look k (union bound over looks "
                              "and buckets)"}

    def _result(self, j: Judgement) -> Result:
        s = self.streams.streams[j.key]
        ev = {**self._evidence(), "errors": list(s.errors), "sample_steps": list(s.steps),
              "skipped_samples": s.skipped,
              "found_at_step": s.found_at, "found": s.found, "biased_at_this_look": j.now, "look": j.look, "alpha_look": j.alpha}
        target = f"{self._target()}.{j.key}"
        if j.stats is None:
            return Result(probe=PROBE, target=target, verdict="error", seed=self.seed,
                          metrics={"biased": None, "trials": len(s.errors),
                                   "nonfinite_trials": s.nonfinite,
                                   "zero_reference_trials": s.zero_reference},
                          evidence=ev, codes=["TP-E1"],
                          message=f"cannot judge {j.key}: {j.reason} by step {j.step}"
                          + (f" ({s.nonfinite} samples were inf/NaN)" if s.nonfinite else "")
                          + (f" ({s.skipped} samples skipped: {_SKIPPED})" if s.skipped else ""))
        m = {**j.stats, "nonfinite_trials": s.nonfinite, "zero_reference_trials": s.zero_reference}
        ev.update({"step": j.step, "bucket_numel": s.numel, "window": min(s.numel, self.window),
                   "run_alpha": self.streams.alpha})
        st = j.stats
        head = (f"{j.key}: reduced gradients off by {st['bias']:+.3g} relative "
                f"({st['confidence']:.4%} CI [{st['ci_low']:+.3g}, {st['ci_high']:+.3g}]) over "
                f"{st['trials']} sampled reductions, spread {st['std']:.3g}, p={st['p_value']:.2g} "
                f"at look {j.look} (level {j.alpha:.2g})")
        if st["biased"]:
            verdict, codes = "fail", ["TP-B1"]
            f = s.found  # the direction is the finding's, not the latest samples'
            msg = (head + f": biased since step {s.found_at}, "
                   + ("too small" if f["bias"] < 0 else "too large") + " on average")
            msg += ("; this compounds over steps" if j.now is not False else
                    f"; no longer seen in the latest samples (found at look {f['look']}: "
                    f"{f['bias']:+.3g} over {f['trials']} reductions, p={f['p_value']:.2g} at "
                    f"level {f['alpha']:.2g})")
        else:
            verdict, codes = ("warn" if s.nonfinite else "pass"), []
            msg = head + (": noise, no bias of at least " f"{self.streams.min_effect:.3g}")
            if s.nonfinite:
                msg += f"; {s.nonfinite} samples were inf/NaN and left out"
        if s.skipped:
            msg += f"; {s.skipped} samples skipped ({_SKIPPED})"
        return Result(probe=PROBE, target=target, verdict=verdict, metrics=m, evidence=ev,
                      seed=self.seed, codes=codes, message=msg)

    def _target(self) -> str:
        from trainprobes.watch.ddp import ddp_hook_name
        if self._fsdp is not None:
            return f"watch:fsdp2[{self._fsdp.name}]"
        ddp = ddp_hook_name(self._ddp) if self._ddp is not None else None
        hook = getattr(self._hook, "__qualname__", None)
        return f"watch:ddp[{ddp or hook}]" if ddp or hook else "watch:ddp"

    def close(self) -> list[Result]:
        """Judge every bucket once more on all its samples and write the final Results:
        one per bucket (pass / fail / cannot judge) and the sentinel's own account. A
        sentinel that saw no bucket says it cannot judge; it never passes."""
        if self._closed:
            return self.results
        self._closed = True
        self._flush()
        final = []
        try:
            with self._lock:
                judged = self.streams.look(self.steps, full=True)
            self.last_judgements = judged
            final = [self._result(j) for j in judged]
        except Exception as e:
            self._own_error("judging at close", e)
        ev = self._evidence()
        if self.not_applicable is not None:
            final.append(Result(probe=PROBE, target=self._target(), verdict="error", seed=self.seed,
                                metrics={"biased": None, "trials": 0}, evidence=ev,
                                codes=["TP-E1"], message=f"cannot judge: {self.not_applicable}"))
        elif not self.streams.streams and (self._ddp is not None or self._fsdp is not None
                                           or not self.watches):
            acc = Result(probe=PROBE, target=self._target(), verdict="error", seed=self.seed,
                         metrics={"biased": None, "trials": 0},
                         evidence=ev, codes=["TP-E1"],
                         message=f"the sentinel checked no reduction in {self.steps} steps "
                         f"({self._hook_calls} {'reduce-scatter' if self._fsdp else 'bucket hook'} calls, {self.error_count} errors of its "
                         "own): nothing judged")
            final.append(acc)
        for r in final:
            self.results.append(r)
            self._write(r)
        for w in self.watches:
            try:
                more = w.close()
            except Exception as e:
                self._own_error(f"closing {type(w).__name__}", e)
                continue
            for r in more:
                self.results.append(r)
                self._write(r)
        if self.error_count:
            log.warning("trainprobes sentinel: %d errors of its own (see the Results' evidence)",
                        self.error_count)
        return self.results

    def _write(self, r: Result) -> None:
        if self.findings is None:
            return
        try:
            if self.rank != self.write_rank or self._refused:
                return
            if not self._output_checked:
                try:
                    self._check_output()
                except OutputExists:
                    self._refused = True  # never add to another run's findings
                    raise
            with open(self.findings, "a") as f:
                f.write(r.to_json() + "\n")
        except Exception as e:
            self._own_error(f"writing {self.findings}", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


_SKIPPED = "a rank could not take them, so every rank left them out: no verdict from them"


def _rank_known() -> bool:
    import torch.distributed as dist
    return (dist.is_available() and dist.is_initialized()) or "RANK" in os.environ


def _rank() -> int:
    """This process's rank now: the process group's once it exists, else $RANK (torchrun,
    Lightning's launchers), else 0."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except ValueError:
        return 0

