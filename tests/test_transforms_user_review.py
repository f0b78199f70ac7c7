"""Regressions of the adversarial review of the user's step (trainprobes.transforms.user):
each case a step the review wrote (tests/transforms_review_steps.py), on 2 gloo ranks."""
import pytest
import transforms_review_steps as s
from trainprobes.transforms import Probe, run_probes
from trainprobes.transforms.user import UserStep

pytestmark = pytest.mark.usefixtures("one_torch_thread")
M = "transforms_review_steps:"


@pytest.mark.slow
def test_one_parameter_all_wrong_inside_the_whole_gradients_bf16_tolerance_fails_naming_it():
    """norm.weight (4 of ~17k elements) is rank 0's shard alone on every rank: the whole
    gradient's error (0.039) is within bf16's noise_tol, that parameter's (~100%) is not."""
    t = UserStep(M + "bug_on_bf16_wire", setup_fn=M + "manual_setup", precisions=("bf16",))
    (r,) = run_probes([Probe(s.normed128_step, t, trials=16, seed=3)], world=2)
    assert r.metrics["equivalent"] is False, r.message
    assert r.metrics["transform_verdict"] == "wrong"
    assert r.metrics["worst_parameter"] == "norm.weight" and "norm.weight" in r.message


def test_wrapper_prefixes_are_stripped_one_at_a_time_until_a_single_device_name():
    from trainprobes.transforms.weights import single_device_name
    proxy = {"module.0.weight", "net.0.weight", "blocks.0.w"}
    assert single_device_name("module.module.0.weight", proxy) == "module.0.weight"  # DDP over a `module` child
    assert single_device_name("_orig_mod.module.module.0.weight", proxy) == "module.0.weight"
    assert single_device_name("module.net.0.weight", proxy) == "net.0.weight"
    assert single_device_name("blocks._checkpoint_wrapped_module.0.w", proxy) == "blocks.0.w"


@pytest.mark.slow
def test_ddp_over_a_model_whose_child_is_called_module_is_equivalent():
    t = UserStep(M + "dp_step", setup_fn=M + "plain_ddp_setup")
    (r,) = run_probes([Probe(s.holder_step, t, trials=8, seed=3)], world=2)
    assert r.metrics["equivalent"] is True, r.message


@pytest.mark.slow
def test_a_setup_raising_on_one_rank_while_its_peer_is_in_a_collective_names_that_rank(capsys):
    """Rank 1 raises before DDP's constructor; rank 0 waits in DDP's parameter broadcast."""
    from trainprobes.cli import main
    assert main(["transforms", "--target", M + "step", "--step", M + "dp_step", "--setup",
                 M + "setup_raises_before_collective", "--trials", "4", "--timeout", "90"]) == 2
    assert (f"setup {M}setup_raises_before_collective raised on rank 1 of 2: RuntimeError: rank 1: "
            "CUDA-less node") in capsys.readouterr().err


@pytest.mark.slow
def test_a_pure_normalisation_bug_gets_no_undeclared_format_hint():
    """Each rank counts one token too many: x0.9961 in every parameter and in the loss."""
    t = UserStep(M + "off_by_one_step", setup_fn=M + "plain_ddp_setup")
    (r,) = run_probes([Probe(s.long_step, t, trials=8, seed=0)], world=2)
    assert r.metrics["transform_verdict"] == "biased", r.message
    assert "undeclared_format" not in r.evidence and "did not declare" not in r.message


@pytest.fixture(scope="module")
def narrow():
    """Gradients handed back in 1-byte dtypes: fp8 e4m3fn undeclared and declared, int8."""
    cases = {"fp8": UserStep(M + "fp8_grads_step", setup_fn=M + "plain_ddp_setup"),
             "fp8 declared": UserStep(M + "fp8_grads_step", setup_fn=M + "plain_ddp_setup",
                                      precisions=("e4m3",)),
             "int8": UserStep(M + "int8_grads_step", setup_fn=M + "plain_ddp_setup")}
    out = run_probes([Probe(s.step, t, trials=8, seed=1, target=k) for k, t in cases.items()], world=2)
    return {r.target: r for r in out}


@pytest.mark.slow
def test_fp8_gradients_are_judged_at_the_declared_format_and_named_when_undeclared(narrow):
    bare, declared = narrow["fp8"], narrow["fp8 declared"]
    assert bare.metrics["equivalent"] is False  # fail-closed: judged at the model's fp32
    assert bare.evidence["undeclared_returned_formats"] == ["fp8_e4m3fn"]
    assert 'precisions=("fp8_e4m3fn",)' in bare.message
    assert declared.metrics["equivalent"] is True, declared.message
    assert declared.metrics["dtype"] == "fp8_e4m3fn" and 0.005 < declared.metrics["max_added_error"] < 0.25


@pytest.mark.slow
def test_int8_gradients_are_never_exact_nor_noise(narrow):
    r = narrow["int8"]
    assert r.metrics["equivalent"] is False and r.metrics["transform_verdict"] != "exact"
    assert "undeclared_returned_formats" not in r.evidence  # an integer is no format to declare


@pytest.mark.slow
def test_a_loss_that_is_not_one_value_is_bad_input_naming_its_shape():
    from trainprobes.errors import InvalidArgument
    t = UserStep(M + "loss_vector_step", setup_fn=M + "plain_ddp_setup")
    with pytest.raises(InvalidArgument, match=r"returned a loss of shape \(2,\) on rank \d; return one value"):
        run_probes([Probe(s.step, t, trials=4)], world=2)


def test_truth_rounding_is_one_step_and_integers_are_not_rounded():
    import torch
    from trainprobes.transforms.judge import rounded
    x = torch.tensor([1 + 2 ** -8 + 2 ** -40, 0.3, 2.5], dtype=torch.float64)
    assert rounded(x, torch.bfloat16)[0] == 1 + 2 ** -7  # fp64 -> fp32 -> bf16 would give 1.0
    assert rounded(x, torch.float8_e4m3fn)[1] == 0.3125
    assert torch.equal(rounded(x, torch.int8), x)


@pytest.mark.slow
def test_a_pipeline_stage_holding_a_tied_weight_under_its_other_name_is_read_as_that_parameter():
    """The last stage holds the embedding's tied weight as head.weight (named_parameters()
    lists it once, as embed.weight): it was refused as a parameter the model does not have.
    Both stages now return embed.weight: a replica, equal when the trainer all-reduces it."""
    ok = UserStep(M + "tied_pp_step", setup_fn=M + "tied_pp_setup")
    bug = UserStep(M + "tied_pp_unreduced", setup_fn=M + "tied_pp_setup")
    r_ok, r_bug = run_probes([Probe(s.tied_step, ok, trials=8), Probe(s.tied_step, bug, trials=8)], world=2)
    assert r_ok.metrics["transform_verdict"] == "noise", r_ok.message
    assert r_bug.metrics["transform_verdict"] == "inconsistent", r_bug.message
    assert r_bug.metrics["worst_parameter"] == "embed.weight"


def test_tied_aliases_map_every_other_name_of_a_parameter_to_its_first():
    from trainprobes.transforms.weights import single_device_name, tied_aliases
    aliases = tied_aliases(s.TiedLM())
    assert aliases == {"head.weight": "embed.weight"}
    assert single_device_name("module.head.weight", {"embed.weight", "body.weight"}, aliases) == "embed.weight"


@pytest.mark.slow
def test_a_gradient_returned_under_two_spellings_of_one_name_is_refused_naming_both(capsys):
    from trainprobes.cli import main
    assert main(["transforms", "--target", M + "step", "--step", M + "twice_returned_step", "--setup",
                 M + "manual_setup", "--trials", "4", "--timeout", "90"]) == 2
    assert "returned two gradients for parameter '2.bias'" in capsys.readouterr().err


@pytest.mark.slow
def test_an_expert_without_tokens_on_a_trial_is_read_as_zero_where_the_truth_is_zero():
    # which head gets the batch changes from trial to trial: the other's .grad stays None,
    # and the fp64 truth's gradient there is exactly zero
    from trainprobes.transforms.equivalence import _seeds
    heads = {int(b["input"][..., 0].mean() > 0) for b in s.two_heads_step.batches(_seeds(0, 8))}
    assert heads == {0, 1}
    (r,) = run_probes([Probe(s.two_heads_step, UserStep(M + "replicated_step"), trials=8, seed=0)], world=2)
    assert r.metrics["transform_verdict"] in ("exact", "noise"), r.message


@pytest.mark.slow
def test_a_gradient_left_none_on_one_replica_is_refused_naming_the_rank_and_the_parameter():
    from trainprobes.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match=r"left '2.bias' without a gradient \(.grad None\) on rank\(s\) "
                                              r"\[1\] on trial 1, while rank\(s\) \[0\] hold one"):
        run_probes([Probe(s.step, UserStep(M + "one_replica_drops_step"), trials=4)], world=2)


@pytest.mark.slow
def test_an_fp64_replica_negating_a_gradient_on_trials_it_does_not_judge_is_inconsistent(capsys):
    """Rank 1 hands back -grad of 2.bias on the trials rank 0 judges: only the fingerprints
    tell, and fp64's sign bits wrapped out of them (NOISE, exit 0, before)."""
    from trainprobes.cli import main
    assert main(["transforms", "--target", M + "step64", "--step", M + "negated_replica_step", "--setup",
                 M + "plain_ddp_setup", "--trials", "8", "--timeout", "120"]) == 1
    assert "INCONSISTENT" in capsys.readouterr().out


@pytest.mark.slow
def test_trials_with_a_zero_truth_are_counted_once_when_every_rank_computes_them(capsys):
    """Seed 4's 8 trials: 5 whose every token is masked (the fp64 gradient exactly 0, the
    most the probe accepts: T - 3). Each stage's rank computes the truth of all 8; both
    counted them: 'exactly zero on 10 of 8 trials' (exit 2) before."""
    from trainprobes.cli import main
    assert main(["transforms", "--target", M + "step_sparse", "--step", M + "staged_step", "--setup",
                 M + "manual_setup", "--trials", "8", "--seed", "4", "--timeout", "120"]) == 0, \
        capsys.readouterr().err
