"""[[tool.trainprobes.transforms]] in a suite: options checked when the suite is built,
naming the entry; one Check per entry; the plugin's assert_equivalent."""
import pytest
from trainprobes.audit.config import suite_from_config
from trainprobes.errors import ConfigError
from trainprobes.reference.bugs import bug
from trainprobes.transforms import Custom
from trainprobes.transforms.zoo import step_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TARGET = "trainprobes.transforms.demo:step"


def build(entry):
    return suite_from_config({"transforms": [entry]})[0]


def test_an_entry_is_one_check_named_by_name():
    (check,) = build({"target": TARGET, "transform": ["ddp", "fsdp2"], "name": "x", "trials": 8})
    assert check.family == "transforms" and check.name == "x"


@pytest.mark.parametrize("entry, match", [
    ({"transform": "ddp"}, "is missing 'target'"),
    ({"target": TARGET, "transform": "fsdp3"}, r"#0 transform: .*did you mean 'fsdp2'"),
    ({"target": TARGET, "transform": "ddp", "options": {"hooks": "fp16"}}, "no option 'hooks'"),
    ({"target": TARGET, "transform": "ddp", "options": "fp16"}, "options='fp16' must be a table"),
    ({"target": TARGET, "trails": 8}, r"unknown keys \['trails'\]"),
])
def test_bad_entries_are_refused_naming_them(entry, match):
    with pytest.raises(ConfigError, match=match):
        build(entry)


@pytest.mark.slow
def test_assert_equivalent_passes_a_fixed_twin_and_fails_the_bug(trainprobes):
    b = bug("cp_token_count")
    r = trainprobes.assert_equivalent(step_of(b), Custom(b.fixed), trials=4)
    assert r.metrics["equivalent"] is True
    with pytest.raises(pytest.fail.Exception, match="not equivalent: transforms.equivalence"):
        trainprobes.assert_equivalent(step_of(b), Custom(b.buggy), trials=4)
