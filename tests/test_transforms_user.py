"""trainprobes.transforms.user: a user's own parallel step with its setup hook, run as the
trainer has it (FSDP2, DTensor TP, DDP with bucket views, main_grad buffers, plain shards
with a declared partition) on 2 gloo ranks: correct steps equivalent, a local-token
normalisation biased, an undeclared bf16 wire named, bad inputs refused naming them."""
import os
import sys

import pytest
import transforms_user_steps as u
from trainprobes.cli import main
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.transforms import Probe, probe, run_probes
from trainprobes.transforms.user import Partition, UserStep

pytestmark = pytest.mark.usefixtures("one_torch_thread")
M = "transforms_user_steps:"
HERE = os.path.dirname(os.path.abspath(__file__))

GOOD = [
    ("fsdp2", UserStep("transforms_user_fsdp")),  # the module form: its step and setup
    ("fsdp2 kept unsharded", UserStep(M + "fsdp_step", setup_fn=M + "fsdp_setup_kept")),
    ("tp dtensor", UserStep(M + "tp_step", setup_fn=M + "tp_setup")),
    ("ddp bucket views", UserStep(M + "ddp_step", setup_fn=M + "ddp_setup")),
    ("main_grad", UserStep(M + "main_grad_step", setup_fn=M + "main_grad_setup")),
    ("plain shard", UserStep(M + "plain_step", setup_fn=M + "plain_setup", partitions=u.plain_partitions)),
    ("bf16 wire declared", UserStep(M + "ddp_step", setup_fn=M + "ddp_bf16_setup", precisions=("bf16",))),
]
BAD = [
    ("local tokens", UserStep(M + "fsdp_local_tokens", setup_fn=M + "fsdp_setup")),
    ("bf16 wire undeclared", UserStep(M + "ddp_step", setup_fn=M + "ddp_bf16_setup")),
]


def bitwise_cases():
    from trainprobes.reference.bugs import bug
    from trainprobes.transforms import Custom
    from trainprobes.transforms.zoo import step_of
    sp = bug("sp_layernorm")  # replicas that disagree: the one element-wise exchange
    return [Probe(u.step, UserStep(M + "plain_step", setup_fn=M + "plain_setup", partitions=u.plain_partitions),
                  trials=4, tolerances=True, target="bitwise.plain"),
            Probe(step_of(sp), Custom(sp.buggy), trials=4, tolerances=True, target="bitwise.sp")]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lm") / "tokens.pt")
    u.write_dataset(path)
    return u.lm_step(path)


@pytest.fixture(scope="module")
def results(lm):
    """Every case that runs on ranks and is expected to finish, on one launch."""
    cases = [(name, Probe(u.step, t, trials=8, seed=1)) for name, t in GOOD + BAD]
    cases += [(f, Probe(lm, UserStep(M + f, setup_fn=M + "ddp_setup"), trials=8))
              for f in ("lm_ddp_step", "lm_ddp_local_mean")]
    cases += [(p.target, p) for p in bitwise_cases()]
    out = run_probes([p for _, p in cases], world=2)
    return {name: r for (name, _), r in zip(cases, out)}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in GOOD])
def test_correct_steps_the_probe_did_not_write_are_equivalent(results, name):
    r = results[name]
    assert r.metrics["equivalent"] is True, r.message
    assert r.metrics["transform"] == "step" and r.metrics["loss_reported"] is True


@pytest.mark.slow
def test_a_local_token_count_is_biased_whatever_the_wrapper(results):
    r = results["local tokens"]
    assert r.metrics["transform_verdict"] == "biased" and r.codes == ["TP-T1"]
    assert "undeclared_format" not in r.evidence  # a x1.2 scale is no rounding


@pytest.mark.slow
def test_an_undeclared_bf16_wire_fails_and_says_how_to_declare_it(results):
    r = results["bf16 wire undeclared"]
    assert r.metrics["equivalent"] is False  # fail-closed: the hint does not pass it
    assert r.evidence["undeclared_format"]["format"] == "bf16"
    assert 'precisions=("bf16",)' in r.message and "--precisions bf16" in r.message
    assert results["bf16 wire declared"].metrics["dtype"] == "bf16"


@pytest.mark.slow
def test_a_declared_partition_that_is_not_a_slice_is_refused_naming_it():
    """(the other bad inputs exit 2 from the command line: tests/test_transforms_cli.py)"""
    t = UserStep(M + "plain_step", setup_fn=M + "plain_setup", partitions=u.bad_partitions)
    with pytest.raises(InvalidArgument, match=r"partitions\['3.weight'\]: rank \d holds a piece of shape "
                                              r"\(4, 4\), which is not a slice along dim 0 of the parameter \(4, 8\)"):
        probe(u.step, t, world=2, trials=4)


def test_a_step_module_without_step_is_refused_before_any_rank():
    with pytest.raises(TargetError, match="module without a callable `step`"):
        UserStep("trainprobes.transforms.weights").resolve()


def test_partitions_are_checked():
    with pytest.raises(InvalidArgument, match=r"must be Partition\(dim >= 0"):
        UserStep(M + "plain_step", partitions={"3.weight": -1}).options
    assert UserStep(M + "plain_step", partitions={"3.weight": (1, [0, 1])}).options["partitions"] == {
        "3.weight": [1, (0, 1)]}
    assert Partition(1) == (1, None)


def test_the_step_flags_belong_to_step(capsys):
    assert main(["transforms", "--target", M + "step", "--precisions", "bf16"]) == 2
    assert "--precisions bf16 belongs to --step" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_line_imports_step_and_target_from_the_current_folder(capsys, monkeypatch):
    """As `python -m` would: the folder is not on sys.path, yet both load, here and on the ranks."""
    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", HERE)])
    for name in ("transforms_user_steps", "transforms_user_fsdp"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    code = main(["transforms", "--target", M + "step", "--step", "transforms_user_fsdp",
                 "--trials", "4", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert '"transform_verdict": "noise"' in out.out


def test_an_audit_entry_takes_a_step_and_its_declarations():
    from trainprobes.audit.config import suite_from_config
    from trainprobes.errors import ConfigError
    (check,) = suite_from_config({"transforms": [{"target": M + "step", "step": "transforms_user_fsdp",
                                                  "options": {"precisions": ["bf16"]}, "name": "mine"}]})[0]
    assert check.family == "transforms" and check.name == "mine"
    with pytest.raises(ConfigError, match="both 'transform' and 'step'"):
        suite_from_config({"transforms": [{"target": M + "step", "step": "x.y", "transform": "ddp"}]})
    with pytest.raises(ConfigError, match=r"unknown keys \['reduce_dtype'\] for a step"):
        suite_from_config({"transforms": [{"target": M + "step", "step": "transforms_user_fsdp",
                                           "options": {"reduce_dtype": "bf16"}}]})


@pytest.mark.slow
def test_a_trainers_batches_several_inputs_and_num_items_in_batch(results):
    ok, bug = results["lm_ddp_step"], results["lm_ddp_local_mean"]
    assert ok.metrics["equivalent"] is True, ok.message
    assert bug.metrics["equivalent"] is False and bug.metrics["max_added_error"] > 0.1
    assert {p["parameter"] for p in ok.evidence["parameters"]} == {
        "tok_embeddings.weight", "pos_embeddings.weight", "mixer.weight", "mixer.bias",
        "lm_head.weight", "lm_head.bias"}


def test_a_data_iterable_that_runs_dry_is_refused(lm):
    from trainprobes.transforms.equivalence import prepare
    with pytest.raises(InvalidArgument, match=r"ran dry after 8 batch\(es\); 16 trials need 16"):
        prepare(Probe(lm, UserStep(M + "lm_ddp_step"), trials=16), 2)


def test_a_batch_keeps_its_scalars_whole_when_split(lm):
    from trainprobes.transforms.base import split
    from trainprobes.transforms.step import check_step
    b = check_step(lm, 0)
    halves = split(b, 2)
    assert all(h["num_items_in_batch"] is b["num_items_in_batch"] for h in halves)
    assert halves[0]["labels"].shape[0] == 4


@pytest.mark.slow
def test_statistics_summed_on_the_ranks_give_the_gathered_verdict_bit_for_bit(results):
    """No gather (the default) against every gradient sent to rank 0: one judgement; where
    replicas disagree (the verdict inconsistent) the summed statistics mix the replicas
    trial by trial, so only the verdict and what it says about the replicas agree."""
    gathered = run_probes(bitwise_cases(), world=2, gather=True)
    for b in gathered:
        a = results[b.target]
        assert a.evidence["statistics"] == "summed on the ranks" != b.evidence["statistics"]
        assert a.message == b.message and a.evidence["replica_disagreements"] == b.evidence["replica_disagreements"]
        if b.target == "bitwise.plain":
            assert a.metrics == b.metrics and a.evidence["tolerances"] == b.evidence["tolerances"]
    sp = results["bitwise.sp"].metrics
    assert sp["transform_verdict"] == "inconsistent" == gathered[1].metrics["transform_verdict"]
