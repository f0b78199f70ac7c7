"""Transforms by name with options from text, and each transform's checks before any rank
starts (divisibility, a pipeline split that covers the model, a plan naming real modules)."""
import pytest
import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.transforms import (
    DDP,
    FSDP2,
    Accumulation,
    Custom,
    Pipeline,
    TensorParallel,
    build_transform,
    parse_transform,
)
from trainprobes.transforms.demo import SP_PLAN, TP_PLAN, step
from trainprobes.transforms.step import check_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_text_options_build_the_same_objects_as_python():
    assert parse_transform("ddp") == DDP()
    assert parse_transform("ddp:hook=bf16") == DDP(hook="bf16")
    assert parse_transform("accum:micro_batches=4,normalization=mean-of-means") == \
        Accumulation(micro_batches=4, normalization="mean-of-means")
    assert parse_transform("fsdp2:param_dtype=bf16,reduce_dtype=none") == FSDP2(param_dtype="bf16")
    assert parse_transform("tp:plan=1:colwise;3:rowwise") == TensorParallel(plan=TP_PLAN)
    assert parse_transform('tp:{"plan": {"0": "sequence", "1": "colwise-from-sequence", "3": "rowwise"}}') == \
        TensorParallel(plan=SP_PLAN)
    assert parse_transform("pp:split=0+1|2+3+4,schedule=gpipe") == \
        Pipeline(schedule="gpipe", split=[["0", "1"], ["2", "3", "4"]])
    assert build_transform("pp", {"micro_batches": 2}) == Pipeline(micro_batches=2)
    assert parse_transform("DDP") == DDP() and parse_transform("FSDP") == FSDP2()


def test_labels_are_stable_targets():
    assert DDP().label == "ddp"
    assert FSDP2(reduce_dtype="bf16").label == "fsdp2(reduce_dtype=bf16)"
    assert TensorParallel(plan=TP_PLAN).label == "tp(plan=1:colwise;3:rowwise)"
    assert Pipeline(split=[["0", "1"], ["2", "3", "4"]]).label == "pp(split=0+1|2+3+4)"


@pytest.mark.parametrize("text, match", [
    ("fsdp3", "did you mean 'fsdp2'"),
    ("ddp:hook=bf8", "hook='bf8' must be one of"),
    ("ddp:hooks=fp16", "no option 'hooks'; did you mean 'hook'"),
    ("accumulation:normalization=mean", "normalization='mean' must be one of"),
    ("accumulation:micro_batches=0", "micro_batches=0 must be an int >= 1"),
    ("fsdp2:reduce_dtype=fp12", "reduce_dtype='fp12'"),
    ("pp:schedule=zb", "schedule='zb' must be one of"),
    ("tp", "plan={} is empty"),
    ("tp:plan=1:rowish", "plan style='rowish'"),
    ("ddp:hook", "is not key=value"),
    ("ddp:{bad json", "not a JSON object"),
    ("", "must name a transform"),
    ("ddp:hook=bf16,hook=fp16", "sets 'hook' twice"),
    ('ddp:{"hook": "bf16", "hook": "fp16"}', "sets 'hook' twice"),
])
def test_bad_transforms_are_refused_naming_the_option(text, match):
    with pytest.raises((InvalidArgument, InvalidType), match=match):
        parse_transform(text)


def test_a_custom_step_must_be_callable():
    with pytest.raises(InvalidType, match="fn=None must be callable"):
        Custom()


@pytest.mark.parametrize("transform, world, match", [
    (DDP(), 3, "not divisible by world=3 x micro_batches=1"),
    (Accumulation(micro_batches=3), 2, "not divisible by world=2 x micro_batches=3 = 6"),
    (Pipeline(split=[["0", "1"], ["2", "3"]]), 2, r"does not cover the model's children.*missing \['4'\]"),
    (Pipeline(split=[["0", "2"], ["1", "3", "4"]]), 2, "in order"),
    (Pipeline(split=[["0"], ["1"], ["2", "3", "4"]]), 2, "names 3 stages; this schedule on this world runs 2"),
    (Pipeline(schedule="interleaved-1f1b", micro_batches=1), 2, "must be a multiple of world=2"),
    (Pipeline(micro_batches=3), 2, "micro_batches=3"),
    (TensorParallel(plan={"9": "colwise"}), 2, "plan names module '9'"),
    (TensorParallel(plan={"0": "colwise"}), 2, "needs an nn.Linear"),
    (TensorParallel(plan={"4": "colwise"}), 4, "over 2 features, not divisible by world=4"),
    (TensorParallel(plan={"0": "sequence"}), 3, "into world=3 equal spans"),
])
def test_transform_checks_refuse_before_any_rank_starts(transform, world, match):
    batch = check_step(step, 0)
    with pytest.raises(InvalidArgument, match=match):
        transform.check(step, world, batch, step.model())


def test_pipelines_need_a_sequential_model():
    with pytest.raises(InvalidArgument, match="nn.Sequential"):
        Pipeline().check(step, 2, check_step(step, 0), torch.nn.ModuleDict())
