"""The ``match:`` grammar: each condition true and false against hand-built probes, its validation, and the
docs section that documents it."""
import dataclasses
import re
import textwrap
from pathlib import Path

import pytest

from aiak.strategy import MODULE_KINDS, Match, Probes, Strategy, StrategyError, load_strategy, match_profile
from aiak.strategy.rules import COMPARISONS

STRATEGY_DOCS = Path(__file__).resolve().parents[2] / "docs" / "strategy.md"
GRAMMAR_HEADING = "## How `auto` chooses: the `match:` grammar"


def match(**conditions) -> Match:
    return Strategy.from_dict({"match": conditions}).match


def probes(**facts) -> Probes:
    modules = dict.fromkeys(MODULE_KINDS, 0)
    modules.update(facts.pop("modules", {}))
    loader = {"present": False, "batch_size": None, "num_workers": None, "pin_memory": None, "variable_length": None}
    loader.update(facts.pop("loader", {}))
    return Probes(modules=modules, loader=loader, **facts)


A100 = {"device": "cuda", "cuda": {"name": "NVIDIA A100", "capability": "8.0", "count": 8, "memory_gb": 79.2},
        "bf16_native": True, "fp16_native": True}
V100 = {"device": "cuda", "cuda": {"name": "Tesla V100", "capability": "7.0", "count": 8, "memory_gb": 31.7},
        "bf16_native": False, "fp16_native": True}
H100 = {**A100, "cuda": {**A100["cuda"], "name": "NVIDIA H100", "capability": "9.0"}}
CPU_BF16 = {"device": "cpu", "cpu_features": frozenset({"avx2", "avx512f", "avx512_bf16"}), "bf16_native": True}
CPU_PLAIN = {"device": "cpu", "cpu_features": frozenset({"avx2", "fma"})}

# (conditions, probes where they hold, probes where they do not, the failing text)
CASES = [
    ({"modules": ["conv2d", "batchnorm"]}, probes(modules={"conv2d": 20, "batchnorm": 20}),
     probes(modules={"conv2d": 20}), "modules all of [conv2d, batchnorm] (missing batchnorm)"),
    ({"modules": {"any": ["multihead_attention", "window_attention"]}}, probes(modules={"window_attention": 12}),
     probes(modules={"linear": 3}), "modules any of [multihead_attention, window_attention] (found none)"),
    ({"modules": ["dropout"]}, probes(modules={"dropout": 1}), probes(), "modules: dropout (found none)"),
    ({"device": "cuda"}, probes(**A100), probes(**CPU_BF16), "device: cuda (found cpu)"),
    ({"device": "cpu"}, probes(**CPU_PLAIN), probes(**V100), "device: cpu (found cuda)"),
    ({"cuda_capability": ">=8.0"}, probes(**A100), probes(**V100), "cuda_capability >=8.0 (found 7.0)"),
    ({"cuda_capability": ">=8.0"}, probes(**H100), probes(**CPU_BF16), "cuda_capability >=8.0 (found no CUDA device"),
    ({"cuda_capability": "<9.0"}, probes(**A100), probes(**H100), "cuda_capability <9.0 (found 9.0)"),
    ({"cuda_capability": "==8.6"}, probes(**{**A100, "cuda": {**A100["cuda"], "capability": "8.6"}}),
     probes(**A100), "cuda_capability ==8.6 (found 8.0)"),
    ({"cuda_capability": "!=7.0"}, probes(**A100), probes(**V100), "cuda_capability !=7.0 (found 7.0)"),
    ({"cuda_capability": ">7"}, probes(**A100), probes(**V100), "cuda_capability >7 (found 7.0)"),
    ({"cuda_capability": "<=7.5"}, probes(**V100), probes(**A100), "cuda_capability <=7.5 (found 8.0)"),
    ({"cpu_features": {"any": ["avx512_bf16", "amx_bf16"]}}, probes(**CPU_BF16), probes(**CPU_PLAIN),
     "cpu_features any of [avx512_bf16, amx_bf16] (found none)"),
    ({"cpu_features": ["avx512f", "avx512_bf16"]}, probes(**CPU_BF16),
     probes(cpu_features=frozenset({"avx512f"})), "cpu_features all of [avx512f, avx512_bf16] (missing avx512_bf16)"),
    ({"cpu_features": ["AVX512_BF16"]}, probes(**CPU_BF16), probes(**CPU_PLAIN),
     "cpu_features: AVX512_BF16 (found none)"),
    ({"world_size": 8}, probes(world_size=8), probes(world_size=4), "world_size: 8 (found 4)"),
    ({"world_size": ">=2"}, probes(world_size=2), probes(), "world_size >=2 (found 1)"),
    ({"nodes": ">=2"}, probes(nodes=2), probes(nodes=1), "nodes >=2 (found 1)"),
    ({"nodes": 1}, probes(), probes(nodes=4), "nodes: 1 (found 4)"),
    ({"params": "<1e8"}, probes(params=11_689_512), probes(params=300_000_000), "params <1e8 (found 300,000,000)"),
    ({"params": ">=2.5e7"}, probes(params=25_000_000), probes(params=24_999_999), "params >=2.5e7 (found 24,999,999)"),
    ({"fp8_linear_share": ">=0.5"}, probes(fp8_linear_share=0.93), probes(fp8_linear_share=0.004),
     "fp8_linear_share >=0.5 (found 0.00)"),
    ({"training_state_share": ">=0.5"}, probes(host_memory_gb=1.0, params=2 ** 28, trainable_params=2 ** 28),
     probes(host_memory_gb=64.0, params=2 ** 28, trainable_params=2 ** 28), "training_state_share >=0.5 (found 0.03)"),
    ({"lm_head_logits_bytes": ">=2.56e8"}, probes(lm_head_logits_bytes=823_394_304),
     probes(lm_head_logits_bytes=102_924_288), "lm_head_logits_bytes >=2.56e8 (found 102,924,288)"),
    ({"optimizer": ["AdamW", "Adam"]}, probes(optimizer="AdamW"), probes(optimizer="SGD"),
     "optimizer any of [AdamW, Adam] (found SGD)"),
    ({"optimizer": ["sgd"]}, probes(optimizer="SGD"), probes(), "optimizer any of [sgd] (found no optimizer)"),
    ({"variable_length": True}, probes(loader={"present": True, "variable_length": True}),
     probes(loader={"present": True, "variable_length": False}), "variable_length: true (found false)"),
    ({"variable_length": False}, probes(loader={"present": True, "variable_length": False}),
     probes(loader={"present": True, "variable_length": None}), "variable_length: false (found unknown"),
    ({"loader": True}, probes(loader={"present": True}), probes(), "loader: true (found no loader)"),
    ({"loader": False}, probes(), probes(loader={"present": True}), "loader: false (found a loader)"),
]


@pytest.mark.parametrize("conditions, holds, fails, failing_text", CASES, ids=[str(c[0]) for c in CASES])
def test_each_condition_is_true_and_false_where_it_should_be(conditions, holds, fails, failing_text):
    m = match(**conditions)
    ok, why = match_profile(m, holds)
    assert ok, why
    assert why.startswith(next(iter(conditions))), why
    ok, why = match_profile(m, fails)
    assert not ok
    assert why.startswith(failing_text), why


def test_every_match_field_and_comparison_operator_has_a_case():
    covered = {key for conditions, *_ in CASES for key in conditions}
    assert covered == {f.name for f in dataclasses.fields(Match)}
    operators = {re.match(r"[<>=!]+", c["cuda_capability"]).group() for c, *_ in CASES if "cuda_capability" in c}
    assert operators == set(COMPARISONS)


def test_all_conditions_must_hold_and_the_explanation_lists_each_with_what_was_found():
    """In the order of the keys of ``Match`` (the table in docs/strategy.md), not as written."""
    m = match(device="cpu", cpu_features={"any": ["avx512_bf16", "amx_bf16"]}, modules=["conv2d"])
    found = probes(modules={"conv2d": 3}, **CPU_BF16)
    assert match_profile(m, found) == (True, "modules: conv2d (found 3 conv2d); device: cpu (found cpu); "
                                             "cpu_features any of [avx512_bf16, amx_bf16] (found avx512_bf16)")
    ok, why = match_profile(m, dataclasses.replace(found, modules=dict.fromkeys(MODULE_KINDS, 0)))
    assert (ok, why) == (False, "modules: conv2d (found none)")  # the first failing condition only
    ok, why = match_profile(m, probes(modules={"conv2d": 3}, **CPU_PLAIN))
    assert not ok and why.startswith("cpu_features")


def test_an_empty_match_matches_everything_and_empty_lists_are_no_condition():
    for p in (probes(), probes(**A100), probes(nodes=4, world_size=32)):
        assert match_profile(match(), p) == (True, "match: {} (always)")
        assert match_profile(match(modules=[], cpu_features=[], optimizer=[], device=None), p)[0]


def test_values_are_kept_as_written_and_round_trip(tmp_path):
    m = match(modules={"any": ["conv2d"]}, cuda_capability=" >= 8.0 ", params="<1e8", world_size=4)
    assert (m.modules, m.cuda_capability, m.params, m.world_size) == ({"any": ["conv2d"]}, ">=8.0", "<1e8", 4)
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent("""
        match:
          modules: {any: [conv2d, conv3d]}
          cuda_capability: ">=8.0"
          params: <1e8
          nodes: 2
          optimizer: [AdamW]
          variable_length: false
          loader: true
    """))
    s = load_strategy(str(path))
    assert Strategy.from_dict(s.to_dict()).match == s.match
    assert s.match.params == "<1e8" and s.match.nodes == 2 and s.match.variable_length is False


# -- validation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("conditions, message", [
    ({"modules": ["conv"]}, r"match.modules: unknown module kind 'conv' \(did you mean 'conv\dd'\?\); "
                            r"valid: \['conv2d'"),
    ({"modules": "conv2d"}, r"match.modules must be a list of module kinds \(all present\) or \{any: \[...\]\}"),
    ({"modules": {"all": ["conv2d"]}}, r"match.modules.all: unknown key; a mapping takes only 'any'"),
    ({"modules": {"anyy": ["conv2d"]}}, r"match.modules.anyy: unknown key \(did you mean 'any'\?\)"),
    ({"modules": {"any": []}}, r"match.modules.any needs at least one of the module kinds"),
    ({"modules": {"any": ["windowattention"]}}, r"match.modules.any: unknown module kind 'windowattention' "
                                                r"\(did you mean 'window_attention'\?\)"),
    ({"device": "gpu"}, r"match.device must be one of \['cpu', 'cuda'\], got 'gpu'"),
    ({"device": "CUDA"}, r"match.device must be one of \['cpu', 'cuda'\], got 'CUDA' \(did you mean 'cuda'\?\)"),
    ({"cuda_capability": 8.0}, r"match.cuda_capability must be a comparison \(a string\) such as '>=8.0' or '<9.0'; "
                               r"operators: >=, >, <=, <, ==, !=; got 8.0"),
    ({"cuda_capability": "=>8.0"}, r"match.cuda_capability must be a comparison"),
    ({"cuda_capability": ">=1e1"}, r"match.cuda_capability must be a comparison"),
    ({"cpu_features": "avx512_bf16"}, r"match.cpu_features must be a list of CPU flags"),
    ({"cpu_features": [512]}, r"match.cpu_features must be a list of CPU flags .*got item 512"),
    ({"world_size": "two"}, r"match.world_size must be a comparison \(a string\) such as '>=2' or '<1e8'"),
    ({"fp8_linear_share": 0.5}, r"match.fp8_linear_share must be a comparison \(a string\) such as '>=0.5'"),
    ({"fp8_linear_share": ">=50"}, r"match.fp8_linear_share must compare with a share between 0 and 1"),
    ({"nodes": 2.5}, r"match.nodes must be an integer \(matches that number\) or a comparison"),
    ({"params": True}, r"match.params must be an integer"),
    ({"optimizer": "AdamW"}, r"match.optimizer must be a list of optimizer class names \(e.g. \[AdamW, SGD\]\)"),
    ({"variable_length": "yes"}, r"match.variable_length must be true or false, got 'yes'"),
    ({"loader": 1}, r"match.loader must be true or false, got 1"),
    ({"modulse": ["conv2d"]}, r"match.modulse: unknown key \(did you mean 'modules'\?\); valid keys: \['modules', "
                              r"'device', 'cuda_capability', 'cpu_features', 'world_size', 'nodes', 'params', "
                              r"'fp8_linear_share', 'training_state_share', 'lm_head_logits_bytes', 'optimizer', "
                              r"'variable_length', 'loader'\]"),
])
def test_each_bad_condition_has_its_message(conditions, message):
    with pytest.raises(StrategyError, match=message):
        load_strategy({"match": conditions})


def test_every_bad_condition_of_a_file_is_reported_at_once_with_the_file_and_key(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(textwrap.dedent("""
        match:
          modules: [conv2d, window_atention]
          device: gpu
          cuda_capability: 8.0
          cpu_features: {all: [amx_bf16]}
          nodes: many
          optimiser: [AdamW]
        tf32: true
    """))
    with pytest.raises(StrategyError) as err:
        load_strategy(str(path))
    problems = err.value.problems
    expected = ["match.modules: unknown module kind 'window_atention' (did you mean 'window_attention'?)",
                "match.device must be one of ['cpu', 'cuda']",
                "match.cuda_capability must be a comparison",
                "match.cpu_features.all: unknown key",
                "match.nodes must be a comparison",
                "match.optimiser: unknown key (did you mean 'optimizer'?)"]
    assert len(problems) == len(expected), problems
    for problem, text in zip(problems, expected):
        assert problem.startswith(f"{path}: ") and text in problem, (problem, text)


def test_match_is_never_inherited_through_extends(tmp_path):
    path = tmp_path / "child.yaml"
    path.write_text("extends: cnn\ntf32: false\n")
    assert load_strategy(str(path)).match == Match()
    assert load_strategy("cnn").match.device == "cuda"


# -- the docs document the grammar the schema accepts -------------------------------------------------------
def grammar_section() -> str:
    text = STRATEGY_DOCS.read_text(encoding="utf-8")
    assert GRAMMAR_HEADING in text, f"docs/strategy.md has no section {GRAMMAR_HEADING!r}"
    section = text.split(GRAMMAR_HEADING, 1)[1]
    return section.split("\n## ", 1)[0]


def test_readme_documents_every_match_key_module_kind_and_operator():
    section = grammar_section()
    for f in dataclasses.fields(Match):
        assert f"`{f.name}`" in section, f"the docs' match: grammar does not mention the key {f.name!r}"
    for kind in MODULE_KINDS:
        assert kind in section, f"the docs' match: grammar does not list the module kind {kind!r}"
    for op in COMPARISONS:
        assert f"`{op}`" in section, f"the docs' match: grammar does not list the operator {op!r}"
    for words in ("AIAK_PROFILE_PATH", "~/.config/aiak/profiles", "sorted by name", "{any:"):
        assert words in section, f"the docs' match: grammar does not say {words!r}"


def test_readme_examples_of_match_sections_validate():
    """Every ``match:`` example in the docs section is accepted by the schema (a renamed key fails here)."""
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", grammar_section(), flags=re.S)
    examples = [yaml.safe_load(b) for b in blocks]
    with_match = [e for e in examples if isinstance(e, dict) and "match" in e]
    assert with_match, "the docs section shows no YAML example with a match: key"
    for example in with_match:
        load_strategy({k: v for k, v in example.items() if k != "name"})
