"""pytest plugin for training CI (entry point pytest11).

Kept light: importing it imports neither torch nor any probe; a probe is imported when a
fixture method calls it, torch when a `gpu`-marked test is about to run.

  def test_router_is_causal(trainprobes):
      trainprobes.assert_causal(my_router, tokens)           # fails with the leaks shown

Every Result a test produces is recorded: shown in a terminal summary section, attached to
the test's JUnit XML properties, written by `--trainprobes-report PATH` as one report, and
compared by `--trainprobes-baseline PATH` with the gate (a regression fails the session).
Under pytest-xdist the workers send their Results to the controller (`workeroutput`).
"""
from __future__ import annotations

import json

import pytest

MARKERS = {
    "numerics": "low-precision numerics probes (bias, stall, accumulator)",
    "causality": "future-token causality probes",
    "drift": "train/inference log-prob drift probes",
    "isolation": "packed-document isolation and batch-invariance probes",
    "distributed": "runs real collectives on torch.distributed",
    "gpu": "needs CUDA; skipped with a reason where there is none",
}
OPTIONS = {
    "report": "write every trainprobes Result of the session to PATH as one report.json",
    "baseline": "fail the session when its Results regress against this report.json",
    "waivers": "waivers (TOML or JSON) applied when comparing with the baseline",
}
WORKER_KEY = "trainprobes_results"


class Recorder:
    """The session's Results, in order; lives on config.stash (no module-level state)."""

    def __init__(self):
        self.results = []       # trainprobes.result.Result, target suffixed with the test id
        self.gate = None        # trainprobes.gate.GateReport once compared
        self.crashes = []       # (nodeid, exit code, one line): trainprobes raised, not judged

    def add(self, result) -> None:
        self.results.append(result)

    def add_worker_output(self, text: str) -> None:
        from trainprobes.result import Result
        self.results.extend(Result.from_dict(d) for d in json.loads(text))


RECORDER = pytest.StashKey[Recorder]()


def pytest_addoption(parser):
    group = parser.getgroup("trainprobes", "trainprobes: numerics, causality and drift probes")
    for name, doc in OPTIONS.items():
        group.addoption(f"--trainprobes-{name}", metavar="PATH", default=None,
                        help=f"{doc} (ini: trainprobes_{name})")
        parser.addini(f"trainprobes_{name}", doc, default=None)
    parser.addini("trainprobes_root", "the folder report keys are relative to (default: the "
                  "ini file's folder, else where pytest was started)", default=None)


def _option(config, name: str):
    """The command-line value, else the ini value (relative to the ini file, as pytest's
    own path options are)."""
    value = config.getoption(f"--trainprobes-{name}")
    if value is not None:
        return value
    value = config.getini(f"trainprobes_{name}") or None
    if value and config.inipath is not None:
        from pathlib import Path
        value = str(Path(config.inipath).parent / value)
    return value


def project_root(config):
    """The folder report keys are relative to: trainprobes_root (relative to the ini file),
    the ini file's folder, or where pytest started. Never pytest's rootdir, which moves with
    the paths on the command line (a baseline given as ../base.json must keep its keys)."""
    from pathlib import Path
    root = config.getini("trainprobes_root") or None
    base = Path(config.inipath).parent if config.inipath is not None \
        else Path(config.invocation_params.dir)
    return (base / root).resolve() if root else base.resolve()


def node_key(node, root) -> str:
    """The test's id with its file relative to root: tests/test_x.py::test_y[a]."""
    import os
    from pathlib import Path
    path = Path(str(node.path)).resolve()
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:  # a test outside the root: the path from it
        rel = Path(os.path.relpath(path, root)).as_posix()
    _, sep, rest = node.nodeid.partition("::")
    return rel + (sep + rest if sep else "")


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    config.stash[RECORDER] = Recorder()
    config.pluginmanager.register(_Crashes(config), "trainprobes-crashes")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(config), "trainprobes-xdist")


class _XdistController:
    """Registered only where xdist is installed (its hook is unknown to pytest otherwise)."""

    def __init__(self, config):
        self.config = config

    @pytest.hookimpl
    def pytest_testnodedown(self, node, error):
        text = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if text:
            self.config.stash[RECORDER].add_worker_output(text)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        import torch  # only now: a gpu-marked test is about to run
        if not torch.cuda.is_available():
            pytest.skip("marked gpu: needs CUDA, and torch.cuda.is_available() is False here")


CRASH = "trainprobes: not a finding"  # the report section that marks a crash (xdist carries it)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails because trainprobes itself raised (not a finding it asserted) is
    marked so, and the session exits by the contract: 3 for an internal error (traceback in
    the log folder), 2 for a probe that could not judge (bad arguments, a target that
    raised); never 1, which means a finding."""
    outcome = yield
    rep = outcome.get_result()
    if call.excinfo is None or rep.when != "call" or not rep.failed:
        return
    code = _crash_code(call.excinfo)
    if code is None:
        return
    from trainprobes.exits import INTERNAL, write_log
    exc = call.excinfo.value
    line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if code == INTERNAL:
        path = write_log(f"pytest {item.nodeid}", exc)
        line += f" (an internal error; traceback in {path})" if path else " (an internal error)"
    rep.sections.append((CRASH, f"{code} trainprobes raised {line}; the session exits {code}"))


class _Crashes:
    """Counts the crashes the test reports carry, where reports are logged (the controller,
    under xdist)."""

    def __init__(self, config):
        self.config = config

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        for name, text in report.sections:
            if name == CRASH:
                self.config.stash[RECORDER].crashes.append((report.nodeid, int(text.split()[0]), text))


def _crash_code(excinfo) -> int | None:
    """The contract's code when the exception came out of trainprobes' own code (its
    innermost frame is in the package, or it is a TrainprobesError) and is not an assertion
    (a finding, or the test's own assert); else None: the test's own error."""
    import os

    import trainprobes.reference as ref
    from _pytest.outcomes import OutcomeException
    from trainprobes.errors import TrainprobesError
    from trainprobes.exits import classify
    exc = excinfo.value
    if isinstance(exc, (AssertionError, OutcomeException)):
        return None
    inner = os.path.abspath(str(excinfo.traceback[-1].path)) if len(excinfo.traceback) else ""
    ours = [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (ref, _package())]
    if not (isinstance(exc, TrainprobesError) or any(inner.startswith(d) for d in ours)):
        return None
    return classify(exc)


def _package():
    import trainprobes
    return trainprobes


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    rec = config.stash.get(RECORDER, None)
    if rec is None:
        return
    if _is_worker(config):
        config.workeroutput[WORKER_KEY] = json.dumps([r.to_dict() for r in rec.results])
        return
    if rec.crashes and session.exitstatus in (0, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = max(code for _, code, _ in rec.crashes)  # a crash is no finding
    report = _option(config, "report")
    if report:
        from trainprobes.result import save_results
        save_results(report, rec.results, source="pytest", args=list(config.invocation_params.args))
    baseline = _option(config, "baseline")
    if baseline:
        from trainprobes.gate import CannotJudge, GateReport, compare, load_waivers
        from trainprobes.result import SchemaError, load_results
        try:
            waivers = load_waivers(_option(config, "waivers")) if _option(config, "waivers") else []
            base, _ = load_results(baseline)
            rec.gate = compare(base, rec.results, waivers=waivers)
        except (SchemaError, CannotJudge) as e:
            rec.gate = GateReport(cannot_judge=f"baseline: {e}")
        # the gate's own contract: 1 a regression, 2 cannot judge (a missing or unreadable
        # baseline is no finding); a failed test (1) stays the session's status
        if rec.gate.exit_code != 0 and session.exitstatus == 0:
            session.exitstatus = rec.gate.exit_code


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rec = config.stash.get(RECORDER, None)
    if rec is None or _is_worker(config) or not (rec.results or rec.gate or rec.crashes):
        return
    tr = terminalreporter
    tr.section("trainprobes")
    for nodeid, code, text in rec.crashes:
        tr.write_line(f"not a finding (exit {code}): {nodeid}: {text.split(' ', 1)[1]}", red=True)
    from collections import Counter
    # a control is OK or MISSED (its known verdict reproduced or not), never a finding's FAIL
    counts = Counter(("control ok" if r.reproduced else "control MISSED") if r.is_control
                     else r.verdict for r in rec.results)
    tr.write_line(", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + " Result(s)")
    for r in rec.results[:40]:
        tr.write_line("  " + r.summary_line())
    if len(rec.results) > 40:
        tr.write_line(f"  ... and {len(rec.results) - 40} more (see the report)")
    report = _option(config, "report")
    if report:
        tr.write_line(f"report: {report}")
    if rec.gate is not None:
        from trainprobes.gate.render import render_text  # a terminal: plain text
        tr.write_line(render_text(rec.gate).rstrip("\n"), red=rec.gate.exit_code != 0,
                      green=rec.gate.exit_code == 0)


# --- the fixture -------------------------------------------------------------------------

# expect= words: the outcome a test knows a case has, as the verdict its Result carries.
EXPECT = {"leaky": "fail", "noncausal": "fail", "biased": "fail", "not_equivalent": "fail",
          "not_isolated": "fail", "batch_variant": "fail", "drifts": "fail",
          "fail": "fail", "warn": "warn", "pass": "pass"}


def expected_verdict(expect: str) -> str:
    from trainprobes.validation import check_choice
    return EXPECT[check_choice(expect, "expect", tuple(EXPECT))]


def _failure(result, what: str, why: str = "") -> str:
    from trainprobes.result import CODES
    lines = [f"{what}: {result.probe} on {result.target!r} -> {result.verdict}",
             f"  {why}" if why else "", f"  {result.message}" if result.message else ""]
    for c in result.codes:
        lines.append(f"  {c} {CODES.get(c, '')}")
    shown = {k: v for k, v in result.metrics.items() if not isinstance(v, (list, dict))}
    for k, v in list(shown.items())[:12]:
        if not isinstance(v, bool) and hasattr(v, "__float__"):
            v = f"{float(v):.6g}"  # numpy scalars print as np.float64(...) otherwise
        lines.append(f"  {k} = {v}")
    if result.seed is not None:
        lines.append(f"  seed = {result.seed} (rerun with it to reproduce)")
    return "\n".join(x for x in lines if x)


def _raise_if_unjudged(result, what: str) -> None:
    """A Result nothing could judge (an error, or a fail with its verdict boolean None: all-NaN
    decisions, a nondeterministic target) fails its test as "cannot judge", which the session
    exits 2 for, as the command line does (commands.options.exit_for), never as a finding."""
    from trainprobes.commands.options import exit_for
    from trainprobes.errors import CannotJudge
    if exit_for([result]) == 2:
        raise CannotJudge(_failure(result, what, "cannot judge: the probe could not decide (see "
                                                 "its message); not a finding"))


class TrainProbes:
    """What the `trainprobes` fixture gives a test: probe-and-assert helpers that record."""

    def __init__(self, request, recorder: Recorder):
        self._request, self._recorder = request, recorder
        self.results = []

    def record(self, result):
        """Record a Result (from any probe) for the report, the summary and JUnit XML."""
        from trainprobes.result import Result, repeat_suffix
        if not isinstance(result, Result):
            raise TypeError(f"record(result={result!r}) needs a trainprobes.result.Result")
        node = self._request.node
        # a test that calls a probe twice on one target (two stall sums, two formats)
        suffix = repeat_suffix(result.key, [r.key for r in self.results])
        key = node_key(node, project_root(self._request.config))
        stored = Result.from_dict({**result.to_dict(),
                                   "target": f"{result.target} @ {key}{suffix}"})
        self.results.append(result)
        self._recorder.add(stored)
        node.user_properties.append((f"trainprobes:{result.probe}", json.dumps(
            {"target": result.target, "verdict": result.verdict, "codes": result.codes,
             "metrics": result.metrics, "seed": result.seed}, default=str)))
        return result

    def _expect(self, result, expect, what: str):
        """A case known to be bad (expect="leaky", "biased", ...): recorded as a control
        with that known verdict; the test passes when the probe reproduces it and fails
        with MISSED when it does not."""
        result.expected = expected_verdict(expect)
        self.record(result)
        if not result.reproduced:
            pytest.fail(_failure(result, f"MISSED: expected {expect!r}",
                                 f"expected verdict {result.expected}, got {result.verdict}"),
                        pytrace=False)
        return result

    def check(self, result, what: str = "probe failed", *, expect: str | None = None):
        """Record the Result and fail the test unless its verdict is pass or warn (with
        expect: unless it reproduces the expected outcome)."""
        if expect is not None:
            return self._expect(result, expect, what)
        self.record(result)
        _raise_if_unjudged(result, what)
        if not result.passed:
            pytest.fail(_failure(result, what), pytrace=False)
        return result

    def assert_flag(self, result, what: str = "probe failed", *, expect: str | None = None):
        """Record the Result and fail the test unless its verdict is pass/warn AND its probe's
        verdict boolean (trainprobes.result.VERDICT_FLAGS: biased, causal, equivalent,
        isolated, batch_invariant) holds its good value. Fails closed: a Result without the
        boolean, or with a mistyped one, fails with that said. The face for every probe
        that reports a verdict boolean (assert_causal, assert_unbiased, assert_within...)."""
        from trainprobes.errors import CannotJudge
        from trainprobes.result import PROBES, VERDICT_FLAGS
        if expect is not None:
            return self._expect(result, expect, what)
        self.record(result)
        try:
            value = result.flag()
        except CannotJudge as e:  # no boolean, or a mistyped one: not judged, not a finding
            raise CannotJudge(_failure(result, what, f"cannot judge: {e}")) from None
        _raise_if_unjudged(result, what)
        name = PROBES[result.probe].flag
        if not result.passed or value is not VERDICT_FLAGS[name]:
            pytest.fail(_failure(result, what, f"{name} = {value} (passes with "
                                               f"{name} = {VERDICT_FLAGS[name]})"),
                        pytrace=False)
        return result

    def assert_causal(self, fn, inputs, expect: str | None = None, **kwargs):
        """trainprobes.causality.check(fn, inputs, **kwargs) must find the target causal
        (metric `causal` True) and batch-isolated."""
        from trainprobes.causality import check
        kwargs.setdefault("target", getattr(fn, "__qualname__", None))
        # A batch-isolation leak (TP-C3) fails too (verdict fail): the decision then depends
        # on other sequences' tokens, future ones included, which inference never sees.
        return self.assert_flag(check(fn, inputs, **kwargs), "not causal", expect=expect)

    def assert_unbiased(self, fn, reference, make_inputs, expect: str | None = None, **kwargs):
        """trainprobes.numerics.bias.bias_probe(fn, reference, make_inputs, **kwargs) must find
        no significant bias (metric `biased` False; make_inputs(generator) -> inputs; trials,
        seed, alpha, min_effect as the probe takes them)."""
        from trainprobes.numerics.bias import bias_probe
        kwargs.setdefault("target", getattr(fn, "__qualname__", "callable"))
        return self.assert_flag(bias_probe(fn, reference, make_inputs, **kwargs), "biased", expect=expect)

    def assert_no_stall(self, fmt, increment: float, n: int, **kwargs):
        """Summing n copies of increment in fmt must not stall (lose additions)."""
        from trainprobes.numerics.stall import stall
        r = self.record(stall(formats=(fmt,), increments=(increment,), n=n, **kwargs))
        if r.verdict == "error" or "TP-B2" in r.codes:
            pytest.fail(_failure(r, "stalled"), pytrace=False)
        return r

    def assert_equivalent(self, step, transform, expect: str | None = None, **kwargs):
        """trainprobes.transforms.probe(step, transform, **kwargs) must find the transform
        equivalent to the single-device step (metric `equivalent` True: exact or noise;
        world, trials, seed, alpha, min_effect, noise_tol as the probe takes them)."""
        from trainprobes.transforms import probe
        return self.assert_flag(probe(step, transform, **kwargs), "not equivalent", expect=expect)

    def assert_within(self, train_lp, infer_lp, expect: str | None = None, **kwargs):
        """trainprobes.drift.compare(train_lp, infer_lp, **kwargs): metric `biased` False and
        the verdict pass/warn (not heavy-tailed past a fail, within thresholds)."""
        from trainprobes.drift import compare
        return self.assert_flag(compare(train_lp, infer_lp, **kwargs), "train/inference drift", expect=expect)

    def assert_documents_isolated(self, fn, tokens, lengths, expect: str | None = None, **kwargs):
        """trainprobes.isolation.documents(fn, tokens, lengths, **kwargs) must find every packed
        document isolated (metric `isolated` True: no structural leak, none left unverified)
        and the row causal (a TP-C1 fails the verdict); fn(tokens, packing) -> outputs."""
        from trainprobes.isolation import documents
        kwargs.setdefault("target", getattr(fn, "__qualname__", None))
        return self.assert_flag(documents(fn, tokens, lengths, **kwargs),
                                "packed documents not isolated", expect=expect)

    def assert_batch_invariant(self, fn, inputs, expect: str | None = None, **kwargs):
        """trainprobes.isolation.batch_invariance(fn, inputs, **kwargs): every row must give the
        same bits alone and inside batches (metric `batch_invariant` True; within atol, when
        given)."""
        from trainprobes.isolation import batch_invariance
        kwargs.setdefault("target", getattr(fn, "__qualname__", None))
        return self.assert_flag(batch_invariance(fn, inputs, **kwargs), "batch-variant", expect=expect)

    def assert_gemm_unbiased(self, a, b, expect: str | None = None, **kwargs):
        """trainprobes.numerics.gemm.gemm_bias(a, b, **kwargs): C = a b^T (a: M x K, b: N x K)
        under a recipe and an accumulator preset (recipe, preset, gemm, samples, trials,
        seed, alpha, tolerance as the probe takes them) must not be biased against fp64:
        exact, or noise (the whole CI within +-tolerance). Fails closed: a sample that cannot
        rule a bias out (inconclusive) fails as cannot judge."""
        from trainprobes.numerics.gemm import gemm_bias
        return self.assert_flag(gemm_bias(a, b, **kwargs), "biased GEMM", expect=expect)

    def assert_engines_agree(self, trainer, engine, input_ids, *, up_to: str = "noise", **kwargs):
        """trainprobes.drift.decompose.localize(trainer, engine, input_ids, **kwargs): the
        engines (nn.Modules or trainprobes.drift.engines.Engine) must agree up_to "exact" (bit
        for bit at every stage) or "noise" (no stage beyond its noise floor, no stale weight,
        no temperature, renormalisation or routing flip). The failure names the first stage,
        the op and the kind."""
        from trainprobes.drift.decompose import localize
        from trainprobes.drift.engines import Engine
        from trainprobes.validation import check_choice
        check_choice(up_to, "up_to", ("exact", "noise"))
        pair = [e if isinstance(e, Engine) else Engine(e, name=n)
                for e, n in ((trainer, "trainer"), (engine, "engine"))]
        r = self.assert_flag(localize(*pair, input_ids, **kwargs), "engines disagree")
        if up_to == "exact" and r.metrics["kind"] != "exact":
            pytest.fail(_failure(r, "engines not bit-identical", "kind = noise (asked up_to='exact')"),
                        pytrace=False)
        return r


@pytest.fixture
def trainprobes(request):
    """Probe-and-assert helpers whose Results go to the session's trainprobes report."""
    return TrainProbes(request, request.config.stash[RECORDER])
