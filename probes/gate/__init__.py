"""The pre-merge gate: compare a candidate report with a baseline and say what regressed.

Exit codes (`GateReport.exit_code`): 0 no unwaived regression, 1 at least one, 2 the gate
cannot judge. It fails closed: a report that is missing, corrupt or of another schema, or
any Result that does not explain its own verdict or lacks (or mistypes) a metric a rule
reads (check_judgeable), or whose figures contradict one another as its probe derives them
(trainprobes.gate.rules: a bias beside its own CI, a collective's bias_z beside its ulp errors),
is "cannot judge", naming the report side, the key and the field.

Regressions, each with a code from trainprobes.result.CODES so a reviewer can search and waive it:
  TP-G1  a probe present in the baseline is missing from the candidate;
  TP-C1  a target that was causal now leaks (metric `causal` True -> False); the same for
         any probe's verdict boolean (trainprobes.result.PROBES) going from good to bad;
  TP-G2  a bias significantly larger: one-sided z-test on |bias| with both standard errors
         (trainprobes.numerics.bias: `bias`, SE = std / sqrt(trials));
  TP-G3  drift significantly worse (the same test on `mean_log_ratio` with `se_mean`, from
         trainprobes.drift.compare), or a drift Result newly over its threshold (TP-D3);
  TP-B3  lower revealed accumulator precision (`accumulator_mantissa_bits` decreased);
  TP-G4  a control (Result.expected set) that reproduced its known verdict in the baseline,
         or is new, misses it in the candidate: the harness is broken on that machine;
  TP-T1/T2/T3  a parallel transform that was equivalent (exact or noise) is now biased /
         inconsistent / wrong (trainprobes.transforms: `equivalent` True -> False, coded by
         its `transform_verdict`);
  TP-T4  a transform's gradient or loss scale error significantly larger (`scale_error`,
         `loss_relative_error` with their `_se`), judged like bias;
  TP-E1  the probe errored in the candidate;
  and any other result whose verdict went from pass/warn to fail keeps the candidate's codes.
Waivers name a code, a target (exact, or an fnmatch pattern) and a reason, and expire.

The package, one role per module: judgeable (reading a Result failing closed), rules/ (each
probe family's Result read against itself, with its tables), statistics, comparison, waivers,
render.
"""
from trainprobes.errors import CannotJudge
from trainprobes.gate.comparison import ESTIMATES, GateReport, Regression, compare, gate_files
from trainprobes.gate.judgeable import check_judgeable
from trainprobes.gate.statistics import estimate, larger_magnitude, standard_error
from trainprobes.gate.waivers import Waiver, load_waivers, parse_waivers, waiver_dict

__all__ = ["CannotJudge", "ESTIMATES", "GateReport", "Regression", "Waiver", "check_judgeable",
           "compare", "estimate", "gate_files", "larger_magnitude", "load_waivers",
           "parse_waivers", "standard_error", "waiver_dict"]
