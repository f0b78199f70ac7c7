"""The zoo: shrink() builds tiny models by their own size names, the cells come from the
probes (token-choice routers causal, expert-choice and capacity ones not), the CLI's exit
codes, the map diff, and a CI subset of the sweep."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from trainprobes.cli import main  # noqa: E402
from trainprobes.errors import InvalidArgument  # noqa: E402
from trainprobes.reference.models.hf_routers import (  # noqa: E402
    ExpertChoiceRouter,
    ProbabilityCapacityRouter,
    patch_gates,
)
from trainprobes.zoo.cells import router_cells, row  # noqa: E402
from trainprobes.zoo.diff import diff_maps  # noqa: E402
from trainprobes.zoo.shrink import MAX_PARAMS, Built, Failure, build, shrink  # noqa: E402


def test_shrink_uses_the_configs_own_names_and_nested_configs():
    cfg, changed = shrink("gpt2")                      # n_embd, n_head, n_layer, n_positions
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.vocab_size) == (64, 4, 2, 128)
    assert changed["n_embd"] == (768, 64)
    cfg, changed = shrink("llava")                     # a multimodal config: text_config too
    assert cfg.text_config.hidden_size == 64 and "text_config.hidden_size" in changed


def test_shrink_keeps_every_kind_of_layer_of_a_hybrid():
    cfg, _ = shrink("gemma3_text")                     # 5 sliding layers, then a full one
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    assert len(cfg.layer_types) == cfg.num_hidden_layers


# positional sizes left as they are, each with why it removes no mechanism the cells probe
_KEPT_POSITIONAL = {
    "chunk_size": "a Mamba-2 / xLSTM scan computed in chunks: the recurrence itself runs at any length",
    "mamba_chunk_size": "as chunk_size", "audio_chunk_size": "an audio encoder's input framing",
    "conf_attention_chunk_size": "gemma3n's audio conformer, not the text decoder",
    "max_window_layers": "a count of layers, not of positions"}


def test_every_mechanism_counted_in_positions_is_shrunk_below_the_documents():
    """A window, chunk or top-k of positions left at its full size (Llama 4's 8192-token
    attention chunks, a DeepSeek sparse-attention indexer's 2048 selected tokens) is wider
    than the probes' 30-token rows: the tiny model would lack the mechanism. Every such size
    a registered config declares is shrunk (or kept, with why)."""
    import re

    from trainprobes.zoo.shrink import SIZES, WINDOW, all_configs, causal_lm_types
    from transformers import CONFIG_MAPPING
    positional = re.compile(r"window|chunk_size|topk|local_attention|compress_rate")
    missed = set()
    for mt in causal_lm_types():
        try:
            cfg = CONFIG_MAPPING[mt]()
        except Exception:  # noqa: BLE001 - a config that cannot be built is listed by build()
            continue
        for c in all_configs(cfg):
            for k, v in vars(c).items():
                if isinstance(v, dict):   # a size per layer kind
                    v = max((e for e in v.values() if isinstance(e, int)), default=0)
                n = v
                if positional.search(k) and isinstance(n, int) and not isinstance(n, bool) and n > WINDOW \
                        and k not in SIZES and k not in _KEPT_POSITIONAL:
                    missed.add(f"{mt}.{k}={v}")
    assert not missed, sorted(missed)
    cfg, changed = shrink("llama4_text")
    assert cfg.attention_chunk_size == WINDOW and changed["attention_chunk_size"] == (8192, WINDOW)
    cfg, _ = shrink("deepseek_v4")
    assert max(cfg.compress_rates.values()) <= WINDOW


def test_group_limited_routing_keeps_more_than_one_group():
    """DeepSeek-V3 routes within the best 4 of 8 expert groups: shrunk to one group the group
    step would select everything and the tiny router would lack it."""
    cfg, _ = shrink("deepseek_v3")
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (4, 2, 1, 2)
    cfg, _ = shrink("glm4_moe")          # a default of one group stays one
    assert cfg.n_group == 1 and cfg.topk_group == 1


def test_build_counts_on_meta_first_and_refuses_what_stays_large():
    b = build("llama")
    assert isinstance(b, Built) and 0 < b.n_params < MAX_PARAMS
    f = build("llama", max_params=1000)
    assert isinstance(f, Failure) and f.stage == "meta" and "parameters after shrinking" in f.reason
    with pytest.raises(InvalidArgument):
        shrink("no_such_model")


def test_a_model_that_cannot_run_an_implementation_is_listed_with_why():
    f = build("mamba", attn_implementation="sdpa")
    assert isinstance(f, Failure) and "ValueError" in f.reason


@torch.no_grad()
def test_sliding_window_shorter_than_documents_is_kept_by_the_mask():
    cells = {c.variant: c for c in row("mistral", probes=("isolation",), implementations=("eager",),
                                       conventions=("mask_4d",))}
    assert cells["eager,mask_4d"].verdict == "isolated"


@torch.no_grad()
@pytest.mark.parametrize("router, causal", [
    (None, True), (ExpertChoiceRouter, False), (ProbabilityCapacityRouter, False)])
@pytest.mark.slow
def test_router_verdict_comes_from_the_mechanism(router, causal):
    model = build("mixtral").model
    if router is not None:
        assert patch_gates(model, router) == 2
    perturb, = router_cells("mixtral", model, modes=("perturb",))
    assert perturb.variant == "perturb"
    assert perturb.verdict == ("causal" if causal else "non-causal")
    assert ("token choice" in perturb.reason) == causal
    assert not perturb.finding     # the kind read from the routing expects what was found


class _CallMeanGate(torch.nn.Module):
    """Token-choice top-k whose logits take eps of the mean logits of every token in the call:
    a row's routing depends on the other rows, by far less than 1e-3 of the logits' scale."""

    def __init__(self, gate, eps=1e-5):
        super().__init__()
        self.weight, self.top_k, self.eps = gate.weight, gate.top_k, eps

    def forward(self, h):
        logits = torch.nn.functional.linear(h.reshape(-1, self.weight.shape[1]), self.weight)
        logits = logits + self.eps * logits.mean(0, keepdim=True)
        w, i = torch.softmax(logits.float(), -1).topk(self.top_k, -1)
        return logits, (w / w.sum(-1, keepdim=True)).to(h.dtype), i


@pytest.mark.slow
@torch.no_grad()
def test_batch_cell_tells_a_leak_between_rows_from_rounding_by_the_fp64_twin():
    """A batch difference is a finding when it survives in float64 (data crossed rows), not by
    its size: the grouped experts' tiling moves mixtral's logits by ulps (rounding), a router
    mixing the rows of the call by 1e-5 of its logits is a leak however small."""
    from trainprobes.zoo.cells import batch_cell
    model = build("mixtral").model
    plain = batch_cell("mixtral", model)
    assert not plain.finding and plain.verdict in ("invariant", "variant")
    assert patch_gates(model, _CallMeanGate) == 2
    leaky = batch_cell("mixtral", model)
    assert leaky.verdict == "variant" and leaky.finding, leaky.reason
    assert leaky.number < 1e-3 * float(model(input_ids=torch.zeros(1, 16, dtype=torch.long)).logits.abs().max())
    assert "fp64" in leaky.reason


def test_cli_unknown_model_exits_2_with_close_names(capsys):
    assert main(["zoo", "--model", "mixtrl"]) == 2
    assert "mixtral" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_one_row_json_and_exit_1_on_a_finding(capsys, monkeypatch, tmp_path):
    assert main(["zoo", "--model", "llama", "--probes", "batch", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_findings"] == 0 and out["versions"]["transformers"]
    assert [c["probe"] for c in out["cells"]] == ["batch"]
    # the one report shape every command prints and the gate reads
    assert out["schema_version"] and out["command"] == "zoo" and out["options"]["model"] == "llama"
    assert [r["probe"] for r in out["results"]] == ["isolation.batch_invariance"]
    from trainprobes.result import load_results
    report = tmp_path / "zoo.json"
    report.write_text(json.dumps(out))
    results, meta = load_results(report)
    assert len(results) == 1 and meta["command"] == "zoo"
    assert main(["gate", "--baseline", str(report), "--candidate", str(report)]) == 0
    capsys.readouterr()
    import trainprobes.zoo.cells as cells

    def leaky_row(mt, **kw):
        return [cells.Cell(mt, "isolation", "sdpa,mask_4d", "leaky", 0.5, "", "leaks", "isolated", True)]
    monkeypatch.setattr(cells, "row", leaky_row)
    assert main(["zoo", "--model", "llama"]) == 1
    assert "FINDING" in capsys.readouterr().out


def test_cli_a_row_that_cannot_be_judged_exits_2_never_0(capsys, monkeypatch):
    """Fail closed: nothing built (bart's shrunk decoder raises), or a cell that raised or
    came out unknown, is not a row agreeing with its design."""
    assert main(["zoo", "--model", "bart", "--no-progress"]) == 2
    assert "could not be built" in capsys.readouterr().err
    import trainprobes.zoo.cells as cells

    def unknown_router(mt, **kw):
        return [cells.Cell(mt, "batch", "", "invariant", 0.0, "", "same bits", "invariant up to rounding"),
                cells.Cell(mt, "router", "", "unknown", None, "", "cannot measure every router: 2 of 4")]
    monkeypatch.setattr(cells, "row", unknown_router)
    assert main(["zoo", "--model", "mixtral", "--no-progress"]) == 2
    assert "cannot measure every router" in capsys.readouterr().err


def test_diff_names_changed_cells(tmp_path):
    cell = {"model_type": "llama", "probe": "batch", "variant": "", "verdict": "invariant"}
    a = {"versions": {"transformers": "5.24.0"}, "rows": {"llama": [cell]}}
    b = {"versions": {"transformers": "5.25.0"}, "rows": {"llama": [dict(cell, verdict="variant")]}}
    ch = diff_maps(a, b)
    assert [(c.probe, c.before, c.after) for c in ch] == [("batch", "invariant", "variant")]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main(["zoo", "--diff", str(pa), str(pa)]) == 0
    assert main(["zoo", "--diff", str(pa), str(pb)]) == 1
    # the same verdict turned into a finding (or a finding called by design) is a change too
    c = dict(cell, probe="isolation", variant="sdpa,position_ids_no_cache", verdict="leaky", finding=False)
    ch = diff_maps({"rows": {"llama": [c]}}, {"rows": {"llama": [dict(c, finding=True)]}})
    assert [(x.before, x.after) for x in ch] == [("leaky", "leaky (finding)")]


@pytest.mark.parametrize("row, says", [
    ([{"model_type": "llama"}], "rows['llama'][0] lacks probe, variant, verdict"),
    ({"x": 1}, "rows['llama'] is dict, expected a list"),
    (None, "rows['llama'] is NoneType"),
    ([{"model_type": "mixtral", "probe": "batch", "variant": "", "verdict": "variant"}],
     "a cell of 'mixtral', in the row of 'llama'"),
    # a cell pasted twice: one of the two verdicts was dropped unseen
    ([{"model_type": "llama", "probe": "batch", "variant": "", "verdict": "invariant"},
      {"model_type": "llama", "probe": "batch", "variant": "", "verdict": "variant"}],
     "rows['llama'][1] repeats the cell ('llama', 'batch', '')"),
    # "false" as a string read as a finding
    ([{"model_type": "llama", "probe": "batch", "variant": "", "verdict": "invariant", "finding": "false"}],
     "rows['llama'][0] has finding='false'"),
    # nested past Python's recursion limit: json raised RecursionError, an internal error (3)
    pytest.param("[" * 100000 + "]" * 100000, "cannot read a zoo map (RecursionError", id="nested")])
def test_diff_refuses_a_hand_edited_map_it_cannot_read(tmp_path, capsys, row, says):
    """Exit 2 naming the cell, never a KeyError (exit 3) or a cell read into another row."""
    good = {"rows": {"llama": [{"model_type": "llama", "probe": "batch", "variant": "", "verdict": "invariant"}]}}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(good))
    pb.write_text('{"rows": {"llama": ' + row + '}}' if isinstance(row, str) else json.dumps({"rows": {"llama": row}}))
    assert main(["zoo", "--diff", str(pa), str(pb)]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.slow
@torch.no_grad()
def test_ci_subset_of_the_sweep(tmp_path):
    """A small fixed subset of the sweep, measured in this process: llama's packed-document
    cells under sdpa (the training call isolated, the cached call leaky by design, the 4-D
    mask isolated), mixtral's router at training time (causal), gpt2's batch cell; folded into
    a map that renders and diffs to nothing against itself."""
    from trainprobes.zoo.page import render
    from trainprobes.zoo.sweep import to_map
    cells = {"llama": row("llama", probes=("isolation",), implementations=("sdpa",),
                          conventions=("position_ids", "position_ids_no_cache", "mask_4d")),
             "mixtral": router_cells("mixtral", build("mixtral").model, modes=("perturb",)),
             "gpt2": row("gpt2", probes=("batch",), implementations=("sdpa",))}
    by = {(c.model_type, c.probe, c.variant): c for cs in cells.values() for c in cs}
    assert by["llama", "isolation", "sdpa,position_ids_no_cache"].verdict == "isolated"
    assert by["llama", "isolation", "sdpa,mask_4d"].verdict == "isolated"
    cached = by["llama", "isolation", "sdpa,position_ids"]
    assert cached.verdict == "leaky" and not cached.finding and "by design" in cached.reason
    assert by["mixtral", "router", "perturb"].verdict == "causal"
    assert by["gpt2", "batch", ""].verdict == "invariant"
    assert not [c for cs in cells.values() for c in cs if c.verdict == "error" or c.finding]
    m = to_map({mt: {"model_type": mt, "cells": [c.to_dict() for c in cs], "seconds": 0.0,
                     "peak_rss_mb": None} for mt, cs in cells.items()})
    assert diff_maps(m, json.loads(json.dumps(m))) == []
    assert "| llama | iso | leak | iso |" in render(m)   # mask_4d, position_ids, no cache


@torch.no_grad()
def test_an_isolation_cell_whose_documents_never_move_is_unknown_not_isolated():
    """A model whose outputs ignore the tokens (gpt2 with its token embedding, tied to the
    head, zeroed) moves no document, not even the perturbed one: isolated would be vacuous.
    The probe says so after its first clause, which the cell once cut off."""
    from trainprobes.zoo.cells import isolation_cell
    model = build("gpt2").model
    model.get_input_embeddings().weight.zero_()
    cell = isolation_cell("gpt2", model, "sdpa", "mask_4d")
    assert cell.verdict == "unknown" and "changed not even their own outputs" in cell.reason


@torch.no_grad()
def test_a_forward_that_ignores_the_4d_mask_is_a_leak_past_the_mask():
    from trainprobes.zoo.cells import isolation_cell
    model = build("llama", attn_implementation="sdpa").model
    inner = model.model
    real = type(inner).forward

    def ignore_4d(self, *a, attention_mask=None, **k):   # silently plain causal attention
        return real(self, *a, attention_mask=None if torch.is_tensor(attention_mask) else attention_mask, **k)
    inner.forward = ignore_4d.__get__(inner)
    cell = isolation_cell("llama", model, "sdpa", "mask_4d")
    assert cell.verdict == "leaky" and cell.finding and "the leak is past the mask" in cell.reason


def test_recurrence_is_read_from_the_mechanism_not_a_substring():
    from trainprobes.zoo.cells import _recurrent_class, expected_isolation
    # "ssm" inside GptOss / SeedOss, "conv1d" in transformers' Conv1D are not recurrence
    for name in ("GptOssModel", "SeedOssModel", "CohereCompass", "Conv1D", "LlamaAttention"):
        assert not _recurrent_class(name), name
    for name in ("MambaMixer", "Mamba2Mixer", "Qwen3NextGatedDeltaNet", "Lfm2ShortConv",
                 "RecurrentGemmaRglru", "MiniMaxLightningAttention"):
        assert _recurrent_class(name), name
    gpt2 = build("gpt2").model                      # Conv1D projections, attention only
    assert expected_isolation(gpt2, "mask_4d") == "isolated"
    # a depthwise short conv along the sequence (mamba / lfm2 mixers) carries state: no promise
    gpt2.add_module("short_conv", torch.nn.Conv1d(64, 64, 4, groups=64, padding=3))
    assert expected_isolation(gpt2, "mask_4d") is None


@torch.no_grad()
def test_gpt_oss_router_is_measured_and_a_hidden_router_cannot_be_measured():
    model = build("gpt_oss").model                  # experts take (hidden, router_indices, routing_weights)
    perturb, = router_cells("gpt_oss", model, modes=("perturb",))
    assert perturb.verdict == "causal" and "token choice top-" in perturb.reason
    assert not perturb.finding
    # a config with experts whose router no hook can find: cannot measure, never "no MoE layer"
    mlp = type(model.model.layers[0].mlp.experts)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(mlp, "forward", lambda self, hidden_states, idx=None, w=None: hidden_states)
    import trainprobes.zoo.targets as targets
    monkey.setattr(targets, "_router_modules", lambda model: [])   # and no other tap either
    monkey.setattr(targets, "_expert_tables", lambda model: [])
    try:
        cell, = router_cells("gpt_oss", model)
    finally:
        monkey.undo()
    assert cell.verdict == "unknown" and cell.reason.startswith("cannot measure")
    assert "experts=4" in cell.reason and "no MoE layer" not in cell.reason
    llama, = router_cells("llama", build("llama").model)   # dense: no experts in the config
    assert llama.verdict == "n/a" and "no MoE layer" in llama.reason


@torch.no_grad()
def test_patched_routers_run_the_experts_loop_that_skips_unchosen_slots(monkeypatch):
    """The expert-choice control once came out 'unknown' late in the full suite: its unchosen
    slots (index E) reached torch's CPU grouped_mm, whose rows past offs[-1] are left
    uninitialised, so the output held whatever the allocator last left there (NaN * 0 = NaN;
    the same input then differed: TP-C2). Here the kernel's leftovers are made NaN on purpose."""
    real = torch.nn.functional.grouped_mm

    def leftovers(input, weight, offs=None, **kw):
        out = real(input, weight, offs=offs, **kw)
        out[int(offs[-1]):] = float("nan")        # what an uninitialised tail may hold
        return out
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", leftovers)
    model = build("mixtral").model
    x = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    patch_gates(model, ExpertChoiceRouter)
    assert model.config._experts_implementation == "eager"
    assert torch.isfinite(model(input_ids=x, use_cache=False).logits).all()
    model.config._experts_implementation = "grouped_mm"    # what patch_gates no longer leaves
    assert model(input_ids=x, use_cache=False).logits.isnan().any()


@torch.no_grad()
@pytest.mark.parametrize("mt, tap, causal", [
    ("llama4_text", "router", True),    # a dense [N, E] score, zeros outside the top-k
    ("jetmoe", "router", True),         # JetMoE's expert-sorted (slot, token, gate, sizes)
    # Doge's product-key router splits the token axis (view(2, B*T, -1)): a finding (slow: a
    # leaking router is confirmed by re-runs and the fp64 twin, ~5 s)
    pytest.param("doge", "tables", False, marks=pytest.mark.slow)])
def test_routers_the_experts_never_see_are_read_at_their_output_or_tables(mt, tap, causal):
    perturb, = router_cells(mt, build(mt).model, modes=("perturb",))
    assert f"(tap: {tap})" in perturb.reason and "token choice top-" in perturb.reason
    assert perturb.verdict == ("causal" if causal else "non-causal")
    assert perturb.finding == (not causal)


def test_a_router_output_in_no_known_layout_is_an_error_not_no_decision():
    from trainprobes.errors import TargetError
    from trainprobes.zoo.targets import _router_output
    gate = torch.nn.Linear(8, 4)
    with pytest.raises(TargetError, match="no routing decision in a known layout"):
        _router_output(gate, torch.randn(6, 4))          # logits only: every expert scored
    dense = torch.tensor([[0.3, 0.0, 0.7, 0.0]])
    assert torch.equal(_router_output(gate, (dense, torch.randn(1, 4))), dense)


@torch.no_grad()
def test_a_router_whose_decisions_reach_no_tapped_module_makes_the_cell_unknown():
    """Fail closed: one MoE layer's experts hidden from the tap, its router still there."""
    from trainprobes.zoo.targets import Routing
    model = build("mixtral").model
    moe = model.model.layers[1].mlp
    moe.experts = torch.nn.Identity()         # the experts no longer take top_k_index...
    moe.forward = lambda h: h                 # ...and the block no longer calls them
    assert Routing(model).untapped == "2 router modules but 1 modules receiving their decisions"
    cell, = router_cells("mixtral", model)
    assert cell.verdict == "unknown" and cell.reason.startswith("cannot measure every router")


def test_every_confirmed_finding_is_a_cell_of_the_map_with_its_verdict():
    """FINDINGS and docs/zoo_map.json agree: each finding names a cell the map measured, with
    the verdict it was confirmed at, and its reproduction script exists."""
    from pathlib import Path

    from trainprobes.zoo.findings import BY_DESIGN, CALLS, FINDINGS
    root = Path(__file__).parents[1]
    m = json.loads((root / "docs" / "zoo_map.json").read_text())
    cells = {(c["model_type"], c["probe"], c["variant"]): c for cs in m["rows"].values() for c in cs}
    from packaging.version import Version
    made = Version(m["versions"]["transformers"])
    for f in FINDINGS:
        c = cells.get((f.model_type, f.probe, f.variant))
        if f.fixed is not None and made >= Version(f.fixed.version):   # the map shows the fix
            assert c is not None and c["verdict"] != f.verdict and not c["finding"], f
            continue
        assert c is not None and c["verdict"] == f.verdict, f
        assert (root / f.script.split()[0]).is_file(), f.script
        assert f.call in CALLS, f
        assert c["finding"] == (f.call != BY_DESIGN), f     # a by-design call no longer counts


@torch.no_grad()
def test_packed_position_ids_beside_a_mask_of_ones_leak_by_design_and_say_what_to_pass():
    from trainprobes.zoo.cells import isolation_cell
    from trainprobes.zoo.targets import CONVENTIONS
    assert "position_ids_ones_mask" in CONVENTIONS       # swept for every model type
    model = build("llama", attn_implementation="sdpa").model
    cell = isolation_cell("llama", model, "sdpa", "position_ids_ones_mask")
    assert cell.verdict == "leaky" and not cell.finding and cell.expected is None
    assert "by design" in cell.reason and "attention_mask=None" in cell.reason


def test_cli_refuses_a_row_the_machine_cannot_hold_before_building_it(capsys, monkeypatch):
    import trainprobes.budget as budget
    import trainprobes.zoo.cells as cells
    from trainprobes.zoo.sweep import row_bytes

    def never(*a, **k):
        raise AssertionError("built a row the machine cannot hold")
    monkeypatch.setattr(cells, "row", never)
    need = row_bytes("mixtral")
    assert need > row_bytes("gpt2") > 0            # the estimate follows the model's parameters
    monkeypatch.setattr(budget, "available_bytes", lambda: need // 2)
    assert main(["zoo", "--model", "mixtral", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "zoo --model mixtral needs about" in err and "available" in err


def test_a_row_is_estimated_at_most_at_the_largest_model_built():
    """A type above MAX_PARAMS after shrinking is refused on the meta device and never
    allocated: blt (192 M parameters) was estimated at 6.7 GB, so a machine with less refused
    it for memory instead of saying it cannot be built."""
    from trainprobes.zoo.shrink import MAX_PARAMS, count_params
    from trainprobes.zoo.sweep import PER_PARAM, ROW_FIXED, row_bytes
    assert count_params("blt") > MAX_PARAMS
    assert row_bytes("blt") == ROW_FIXED + PER_PARAM * MAX_PARAMS


def test_a_zero_weight_slot_in_range_is_a_choice_and_an_index_past_the_experts_is_a_drop():
    from trainprobes.zoo.targets import _slots
    idx = torch.tensor([[0, 3], [1, 4], [2, 2]])          # E = 4: the slot of index 4 is dropped
    w = torch.tensor([[0.5, 0.0], [1.0, 0.0], [0.5, 0.5]])
    assert _slots(idx, w, 4).tolist() == [2, 1, 2]


@torch.no_grad()
def test_longcat_zero_computation_experts_read_as_token_choice():
    """transformers 5.25 hands LongCat's experts module a zero-computation expert's slot at a
    dummy index in range with weight 0 (its identity output added beside): each token still
    chose top-2, and its router is causal by design (5.25's map first called it a finding)."""
    from trainprobes.zoo.targets import Routing
    model = build("longcat_flash").model
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    assert Routing(model).kind(x).startswith("token choice top-2")
    cells = router_cells("longcat_flash", model, modes=("perturb",))
    assert cells[0].verdict == "causal" and not cells[0].finding


def test_the_diff_of_two_maps_sorts_an_upgrade_into_what_a_reader_asks():
    from trainprobes.zoo.diff import categorise

    def cell(mt, probe, variant, verdict, finding=False):
        return {"model_type": mt, "probe": probe, "variant": variant, "verdict": verdict, "finding": finding,
                "reason": "r"}
    a = {"rows": {"bert": [cell("bert", "isolation", "sdpa", "leaky", True)],
                  "bart": [cell("bart", "build", "eager", "n/a")],
                  "opt": [cell("opt", "router", "perturb", "causal")],
                  "old": [cell("old", "batch", "", "invariant")]}}
    b = {"rows": {"bert": [cell("bert", "isolation", "sdpa", "isolated")],
                  "bart": [cell("bart", "batch", "", "invariant")],
                  "opt": [cell("opt", "router", "perturb", "non-causal", True)],
                  "new": [cell("new", "batch", "", "invariant")]}}
    got = categorise(a, b, diff_maps(a, b))
    assert got["new model types"] == ["new"] and got["model types gone"] == ["old"]
    assert got["newly buildable"] == ["bart (was: r)"]
    assert got["newly isolated"] == got["findings gone"] == ["bert isolation sdpa: leaky (finding) -> isolated"]
    assert got["newly non-causal"] == got["new findings"] == ["opt router perturb: causal -> non-causal (finding)"]
    assert not got["other verdict changes"] and not got["no longer buildable"]
