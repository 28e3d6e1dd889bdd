"""Built-in profiles, ``load_strategy``, ``extends:`` and the error messages for each class of bad input."""
import textwrap

import pytest

import aiak
from aiak.strategy import Strategy, StrategyError, list_profiles, load_strategy

BUILT_IN = ["cnn", "default", "large_batch", "multi_node", "swin", "transformer"]


def test_all_built_in_profiles_exist_and_validate():
    assert set(BUILT_IN) <= set(list_profiles())
    for name in list_profiles():
        s = load_strategy(name)
        assert isinstance(s, Strategy)
        assert s.name == name
        assert s.description, f"profile {name} has no description"


def test_default_profile_turns_everything_off():
    s = load_strategy("default")
    assert (s.tf32, s.channels_last, s.compile, s.cudnn_benchmark) == (False, False, False, False)
    assert s.precision.level == "O0" and s.grad_accumulation == 1 and s.optimizer.name == "keep"
    assert s.loader.prefetch == 0 and s.fused_ops == [] and s.comm.compression == "none"


def test_extends_inherits_then_overrides_section_by_section(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(textwrap.dedent("""
        extends: swin
        precision: {dtype: fp16}
        grad_accumulation: 3
    """))
    s = load_strategy(str(child))
    parent = load_strategy("swin")
    assert s.name == "child"
    assert s.precision.level == parent.precision.level == "O2"  # inherited inside the section
    assert s.precision.dtype == "fp16"                            # overridden
    assert s.tf32 == parent.tf32 and s.grad_accumulation == 3
    assert s.match.modules == []                                  # match is never inherited


def test_dict_and_yaml_round_trip(tmp_path):
    s = load_strategy({"extends": "cnn", "optimizer": {"name": "lamb", "weight_decay": 0.01}})
    assert s.optimizer.hyperparameters == {"weight_decay": 0.01}
    path = tmp_path / "rt.yaml"
    path.write_text(s.to_yaml())
    again = Strategy.from_yaml(str(path))
    assert again.to_dict() == {**s.to_dict(), "name": s.name}
    assert aiak.load_strategy(again) is again


def test_extends_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(StrategyError, match="cycle"):
        load_strategy(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize("spec, message", [
    ({"precison": {"level": "O2"}}, r"<dict>: precison: unknown key \(did you mean 'precision'\?\)"),
    ({"precision": {"levle": "O2"}}, r"precision.levle: unknown key \(did you mean 'level'\?\)"),
    ({"tf32": "yes"}, r"tf32 must be a boolean, got str 'yes'"),
    ({"grad_accumulation": 2.5}, r"grad_accumulation must be an integer"),
    ({"grad_accumulation": True}, r"grad_accumulation must be an integer"),
    ({"precision": {"level": "O3"}}, r"precision.level must be one of \['O0', 'O1', 'O2'\], got 'O3'"),
    ({"precision": {"dtype": "fp8"}}, r"precision.dtype must be one of \['fp16', 'bf16'\]"),
    ({"precision": {"loss_scale": -4}}, r"precision.loss_scale must be one of \['dynamic', 'none'"),
    ({"comm": {"compression": "zip"}}, r"comm.compression must be one of \['none', 'fp16', 'bf16', 'int8'\]"),
    ({"comm": {"hierarchical": 1}}, r"comm.hierarchical must be one of \['auto', true, false\]"),
    ({"fused_ops": ["flash"]}, r"fused_ops: unknown entry 'flash'; valid choices: \['window_attention'\]"),
    ({"optimizer": {"name": "adamw"}}, r"optimizer.name must be one of \['keep', 'lamb', 'lars'\]"),
    ({"precision": "O2"}, r"precision must be a mapping"),
    ({"precision": {"level": "O2", "dtype": "fp16", "loss_scale": "none"}}, r"fp16 at O2 needs loss scaling"),
    ({"grad_accumulation": 0}, r"grad_accumulation must be an integer >= 1"),
    ({"loader": {"pin_memory": True}}, r"loader.pin_memory needs loader.prefetch >= 1"),
    ({"loader": {"prefetch": 2, "mean": [0.5, 0.5, 0.5]}}, r"loader.mean and loader.std go together"),
    ({"loader": {"prefetch": 2, "mean": [0.5], "std": ["a"]}}, r"loader.std must be a non-empty list of numbers"),
    ({"loader": {"mean": [0.5], "std": [0.2]}}, r"loader.mean/std need loader.prefetch >= 1"),
    ({"loader": {"max_tokens": 4096}}, r"loader.max_tokens needs loader.balanced: true"),
    ({"loader": {"balanced": True, "max_tokens": "lots"}}, r"loader.max_tokens must be an integer"),
    ({"comm": {"perf_mode": "fast"}}, r"comm.perf_mode must be one of \['comm', 'step'\]"),
    ({"comm": {"bucket_mb": 0}}, r"comm.bucket_mb must be > 0"),
    ({"comm": {"tune_steps": 0}}, r"comm.tune_steps must be >= 1"),
])
def test_each_class_of_bad_input_has_its_message(spec, message):
    with pytest.raises(StrategyError, match=message):
        load_strategy(spec)


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("precision: {level: O2, dtpye: bf16}\n")
    with pytest.raises(StrategyError) as err:
        load_strategy(str(path))
    assert str(path) in str(err.value) and "precision.dtpye" in str(err.value) and "'dtype'" in str(err.value)


def test_unknown_profile_suggests_a_close_name():
    with pytest.raises(StrategyError, match=r"unknown profile 'swim' \(did you mean 'swin'\?\)"):
        load_strategy("swim")


def test_invalid_yaml_is_reported_with_its_path(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("precision: {level: O2\n")
    with pytest.raises(StrategyError, match="not valid YAML"):
        load_strategy(str(path))


def test_static_loss_scale_number_is_parsed():
    s = load_strategy({"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 1024}})
    assert s.precision.loss_scale == 1024.0


def test_loader_optional_keys_parse():
    s = load_strategy({"loader": {"prefetch": 2, "balanced": True, "max_tokens": 4096, "mean": [0.485, 0.456, 0.406],
                                  "std": [0.229, 0.224, 0.225]}})
    assert s.loader.max_tokens == 4096 and s.loader.mean == [0.485, 0.456, 0.406]
