"""`drift localize` at its edges (issue 31): the engine's own hooks around a stage, an
engine that is not an HF model, a pair built together, and a forward that truncates."""
import copy
import json
import math
import textwrap

import pytest
import torch
from trainprobes.cli import main
from trainprobes.drift.engines import Engine, candidates
from trainprobes.errors import InvalidArgument

pytest.importorskip("transformers")
from trainprobes.drift.decompose import localize  # noqa: E402
from trainprobes.drift.localize_demo import base_model, sample  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _verdicts(r) -> dict:
    return {s["name"]: s["verdict"] for s in r.evidence["stages"]}


def test_cast_in_an_engine_forward_hook_is_blamed_on_the_module():
    """The engine rounds lm_head's OUTPUT to bf16 in its own forward hook: the recording hook
    runs after it, so the rounding is lm_head's (not the post-processing's after it)."""
    a = base_model("llama", layers=2)
    b = copy.deepcopy(a)
    b.lm_head.register_forward_hook(lambda m, args, out: out.bfloat16().float())
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), sample(Engine(b), 6, 16, 1))
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"], m["explained_by"]) == ("numeric", "lm_head", "lm_head", "lm_head")
    v = _verdicts(r)
    assert v["lm_head"] == "beyond" and v["after lm_head"] == "exact" and v["into lm_head"] == "exact"


class Plain(torch.nn.Module):
    """An engine that is no HF model: HF's decoder stack and a head of another name, no
    config, no get_output_embeddings; forward returns the logits tensor."""

    def __init__(self, body, out):
        super().__init__()
        self.body, self.out = body, out

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)


def _plain_pair():
    m = base_model("llama", layers=2)
    a = Plain(m.model, m.lm_head)
    b = copy.deepcopy(a)
    return a, b


def test_output_head_found_by_role_on_a_plain_module():
    """The module whose output is the logits is the lm_head stage, whatever its name: a bf16
    head is found there (without it, the fault showed as the post-processing after the norm)."""
    from trainprobes.drift import faults
    a, b = _plain_pair()
    assert not hasattr(a, "get_output_embeddings") and candidates(a).head == "out"
    faults.in_dtype(b.out, torch.bfloat16)
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), sample(Engine(a), 6, 16, 1))
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"], m["op_module"]) == ("numeric", "out", "lm_head", "out")
    roles = {s["name"]: s["role"] for s in r.evidence["stages"]}
    assert roles["out"] == "lm_head" and _verdicts(r)["after out"] == "exact"
    assert m["share_numerics[out]"] > 0.9


def _truncating(model, top_p=0.9):
    """The model's forward with a top-p applied to its logits (a hook on the whole model)."""
    def hook(m, args, kwargs, out):
        p = torch.softmax(out.logits.float(), -1)
        s, order = p.sort(-1, descending=True)
        drop = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (s.cumsum(-1) - s) >= top_p)
        out.logits = out.logits.masked_fill(drop, -math.inf)
        return out
    model.register_forward_hook(hook, with_kwargs=True)
    return model


def test_top_p_inside_the_forward_says_what_happened():
    """It was refused as 'the trainer's log-probs have non-finite entries'; the truncation is
    the engine's, in its forward, and the message says so and what to do."""
    a = base_model("llama", layers=2)
    b = _truncating(copy.deepcopy(a))
    with pytest.raises(InvalidArgument) as e:
        localize(Engine(a, name="trainer"), Engine(b, name="engine"), sample(Engine(b), 6, 16, 1))
    msg = str(e.value)
    assert "the engine's logits hold -inf at 90 of 90 real positions" in msg
    assert "at 90 of them the kept entries are the top ones" in msg and "nucleus" in msg
    assert "top-p or top-k truncation applied inside its forward" in msg and "logprobs=" in msg
    assert "trainer's log-probs" not in msg


PAIRS = '''
import copy
import math
import torch
from trainprobes.drift import faults
from trainprobes.drift.localize_demo import base_model


def bf16_mlp():
    a = base_model("llama")
    b = copy.deepcopy(a)  # built together: the engine starts from the trainer's very weights
    faults.in_dtype(b.model.layers[2].mlp, torch.bfloat16)
    return a, b


def three():
    a = base_model("llama")
    return a, a, a


def not_a_module():
    return base_model("llama"), "engine"


def truncating():
    a = base_model("llama")
    b = copy.deepcopy(a)

    def top_k(m, args, kwargs, out):  # a top-k 5 inside the engine's forward
        kth = out.logits.topk(5, dim=-1).values[..., -1:]
        out.logits = out.logits.masked_fill(out.logits < kth, -math.inf)
        return out
    b.register_forward_hook(top_k, with_kwargs=True)
    return a, b
'''


@pytest.fixture
def pairs(tmp_path, monkeypatch):
    (tmp_path / "my_pairs.py").write_text(textwrap.dedent(PAIRS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_pairs"


def test_pair_factory_builds_both_engines(pairs, capsys):
    rc = main(["drift", "localize", "--pair", f"{pairs}:bf16_mlp", "--json", "--sequences", "6", "--length", "16"])
    doc = json.loads(capsys.readouterr().out)
    m = doc["results"][0]["metrics"]
    assert rc == 1 and (m["kind"], m["first_layer"], m["op"]) == ("numeric", "model.layers.2", "mlp")
    assert doc["results"][0]["target"] == f"{pairs}:bf16_mlp"


@pytest.mark.parametrize("argv, error, words", [
    (["--pair", "{p}:three"], "TargetError", "returned a tuple of 3; expected a (trainer, engine) pair"),
    (["--pair", "{p}:not_a_module"], "TargetError", "pair[1] is a str; expected an nn.Module"),
    (["--pair", "{p}:bf16_mlp", "--engine", "{p}:three"], "InvalidArgument", "--pair builds both engines"),
    (["--pair", "{p}:truncating"], "InvalidArgument", "truncation applied inside its forward"),
])
def test_pair_refusals_are_json_documents(pairs, argv, error, words, capsys):
    argv = [a.format(p=pairs) for a in argv]
    assert main(["drift", "localize", "--json", "--sequences", "6", "--length", "16", *argv]) == 2
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["results"] == [] and doc["refused"]["exit_code"] == 2
    assert doc["refused"]["error"] == error and words in doc["refused"]["message"] and words in out.err


def test_one_sequence_gives_intervals_over_its_spans():
    """One rollout, not repeated: the bf16 MLP is found, the shares' intervals come from 8 spans
    of its tokens (width > 0, covering the estimate) and the message says what one sequence
    cannot show. (At least 4 sequences were required; one rollout copied 4 times gave
    zero-width intervals and is refused now.)"""
    from trainprobes.drift import faults
    a = base_model("llama")
    b = base_model("llama", "sdpa")   # other kernels: the bf16 MLP does not explain every token exactly
    faults.in_dtype(b.model.layers[2].mlp, torch.bfloat16)
    ids = sample(Engine(b), 1, 24, 1)
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), ids)
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"]) == ("numeric", "model.layers.2", "mlp")
    assert (m["n_sequences"], m["n_units"]) == (1, 8)
    for part in ("numerics", "unexplained"):
        lo, mid, hi = m[f"share_{part}_ci_low"], m[f"share_{part}"], m[f"share_{part}_ci_high"]
        assert lo < mid < hi and math.isfinite(hi - lo)
    assert "units: 8 spans of about 3 tokens of 1 sequence" in r.message
    assert "how the drift varies from one sequence to another is not shown" in r.message
    from trainprobes.gate import check_judgeable
    check_judgeable(r, "candidate")  # the gate reads a one-sequence report as consistent
    with pytest.raises(InvalidArgument, match="same sequence"):
        localize(Engine(a, name="trainer"), Engine(b, name="engine"), ids.repeat(4, 1))


@pytest.mark.parametrize("argv, words", [
    (["--margin", "0.5", "--demo"], "margin=0.5 must be a finite number >= 1"),
    (["--sequences", "0", "--demo"], "sequences=0 must be an int >= 1"),
    (["--demo", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_command_line_that_does_not_parse_is_a_json_document_too(argv, words, capsys):
    """argparse's refusals printed nothing on stdout under --json."""
    assert main(["drift", "localize", "--json", *argv]) == 2
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["results"] == [] and doc["refused"]["exit_code"] == 2 and doc["refused"]["error"] == "UsageError"
    assert words in doc["refused"]["message"] and words in out.err and "usage:" in out.err


def test_the_stage_with_the_largest_share_is_the_answer_with_its_op():
    """A dense Llama: block 0's down_proj in bf16 is the first stage beyond noise but carries
    ~0% of the drift; block 2's norm epsilon 1e-6 -> 1e-3 carries ~100%. The answer is block 2
    at its norm (its ops searched as the first stage's are), block 0 beside it."""
    from trainprobes.drift import faults
    a = base_model("llama")
    b = copy.deepcopy(a)
    faults.in_dtype(b.model.layers[0].mlp.down_proj, torch.bfloat16)
    faults.norm_epsilon(b.model.layers[2].post_attention_layernorm, 1e-3)
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), sample(Engine(b), 8, 24, 1))
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"]) == ("numeric", "model.layers.0", "mlp")
    assert (m["explained_by"], m["explained_by_op"], m["explained_by_module"]) == (
        "model.layers.2", "norm", "model.layers.2.post_attention_layernorm")
    assert m["share_numerics[model.layers.2]"] > 0.99 and abs(m["share_numerics[model.layers.0]"]) < 0.01
    assert r.message.startswith("numeric: explained by model.layers.2 (op norm: "
                                "model.layers.2.post_attention_layernorm; numerics 100%)")
    assert "first stage beyond noise model.layers.0 (op mlp" in r.message
    from trainprobes.gate import check_judgeable
    check_judgeable(r, "candidate")


def test_one_sequence_of_a_noise_pair_is_noise():
    """Spans of one sequence as units do not turn kernel noise into a finding (36 pairs
    measured, docs/drift.md: largest stage ratio 0.90)."""
    a, b = base_model("llama", "eager", 3), base_model("llama", "sdpa", 3)
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), sample(Engine(b), 1, 24, 4), seed=3)
    assert r.metrics["kind"] == "noise" and r.metrics["n_units"] == 8
    assert max(s["ratio"] for s in r.evidence["stages"]) < 2
