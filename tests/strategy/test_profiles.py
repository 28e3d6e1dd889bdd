"""Built-in profiles, ``load_strategy``, ``extends:`` and the error messages for each class of bad input."""
import textwrap

import pytest
import torch

import aiak
from aiak.strategy import Match, Strategy, StrategyError, list_profiles, load_strategy

BUILT_IN = ["auto_base", "channels_last", "cnn", "cpu_bf16", "cuda", "cuda_bf16", "default", "large_batch",
            "multi_node", "multi_node_comm", "swin", "transformer", "window_attention"]


def test_all_built_in_profiles_exist_and_validate():
    assert set(BUILT_IN) <= set(list_profiles())
    for name in list_profiles():
        s = load_strategy(name)
        assert isinstance(s, Strategy)
        assert s.name == name
        assert s.description and "\n" not in s.description, f"profile {name} needs a one-line description"


def test_only_profiles_that_change_the_training_itself_lack_a_match_section():
    """LAMB and accumulation (large_batch, multi_node) and plain PyTorch (default) apply only when named."""
    from aiak.strategy.profiles import load_profile, profile_files

    without = [f.name for f in profile_files() if not load_profile(f).has_match]
    assert without == ["default", "large_batch", "multi_node"]


def test_default_profile_turns_everything_off():
    s = load_strategy("default")
    assert (s.tf32, s.channels_last, s.compile, s.cudnn_benchmark) == (False, False, False, False)
    assert s.precision.level == "O0" and s.grad_accumulation == 1 and s.optimizer.name == "keep"
    assert s.loader.prefetch == 0 and s.fused_ops == [] and s.comm.compression == "none"
    assert not s.tune and s.match == Match()


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
    ({"fused_ops": ["flash"]},
     r"fused_ops: unknown entry 'flash'; valid choices: \['window_attention', 'linear_cross_entropy', 'pointwise_conv'\]"),
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


# -- every mistake at once, each with its file, key path and suggestion -------------------------------------
def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads ``1e4`` as a string; aiak's loader reads it as YAML 1.2 does."""
    path = tmp_path / "exp.yaml"
    path.write_text("precision: {level: O2, dtype: fp16, loss_scale: 1e4}\n"
                    "optimizer: {name: lamb, lr: 1e-3, weight_decay: 2.5E-2}\n"
                    "comm: {bucket_mb: 5e1}\n")
    s = load_strategy(str(path))
    assert s.precision.loss_scale == 1e4
    assert s.optimizer.hyperparameters == {"lr": 1e-3, "weight_decay": 0.025}
    assert s.comm.bucket_mb == 50.0


@pytest.mark.parametrize("name, suggestion", [("Auto", "auto"), ("CNN", "cnn"), ("Swin", "swin"),
                                              ("larg_batch", "large_batch")])
def test_profile_names_get_a_suggestion_and_the_choices_include_auto(name, suggestion):
    with pytest.raises(StrategyError) as err:
        aiak.optimize(torch.nn.Linear(2, 2), strategy=name)
    message = str(err.value)
    assert f"unknown profile {name!r} (did you mean {suggestion!r}?)" in message
    assert "'auto'" in message.split("choices:")[1] and "'cnn'" in message


def test_loading_auto_says_what_auto_is_instead_of_listing_it_among_the_choices():
    """``load_strategy("auto")`` (and ``aiak profiles auto``) once said "unknown profile 'auto'; choices:
    ['auto', ...]": auto is no file, its knobs are composed per model."""
    with pytest.raises(StrategyError) as err:
        load_strategy("auto")
    message = str(err.value)
    assert "unknown profile" not in message and "aiak explain --model" in message and "match:" in message


def test_unknown_extends_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("extends: cnnn\ntf32: true\n")
    with pytest.raises(StrategyError, match=rf"{path}: extends: unknown profile 'cnnn' \(did you mean 'cnn'\?\)"):
        load_strategy(str(path))


def test_every_mistake_of_a_file_is_reported_at_once(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text(textwrap.dedent("""
        extends: swim
        precison: {level: O2}
        precision: {dtpye: bf16}
        optimizer: {name: lamb, lrr: 0.1, betas: [0.9, 1.5]}
        loader: {prefetch: two}
        fused_ops: [window_atention]
    """))
    with pytest.raises(StrategyError) as err:
        load_strategy(str(path))
    problems = err.value.problems
    expected = [
        "extends: unknown profile 'swim' (did you mean 'swin'?)",
        "precison: unknown key (did you mean 'precision'?)",
        "precision.dtpye: unknown key (did you mean 'dtype'?)",
        "optimizer.lrr: unknown hyper-parameter for lamb (did you mean 'lr'?)",
        "optimizer.betas: betas[1] must be a number in [0.0, 1.0)",
        "loader.prefetch must be an integer, got str 'two'",
        "fused_ops: unknown entry 'window_atention' (did you mean 'window_attention'?)",
    ]
    assert len(problems) == len(expected), problems
    for problem, text in zip(problems, expected):
        assert problem.startswith(f"{path}: ") and text in problem, (problem, text)
    assert str(err.value).startswith(f"{len(expected)} problems in the strategy:")


def test_a_mistake_in_a_parent_names_the_parent_file(tmp_path):
    (tmp_path / "parent.yaml").write_text("tf32: maybe\noptimizer: {name: lamb, weight_decay: 0.01}\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: parent.yaml\noptimizer: {lr: 0.001, bta: 0.9}\n")
    with pytest.raises(StrategyError) as err:
        load_strategy(str(child))
    assert err.value.problems == [
        f"{tmp_path / 'parent.yaml'}: tf32 must be a boolean, got str 'maybe'",
        f"{child}: optimizer.bta: unknown hyper-parameter for lamb (did you mean 'betas'?); valid keys: "
        "['lr', 'betas', 'eps', 'weight_decay', 'bias_correction', 'trust_clip', 'max_grad_norm', 'foreach', "
        "'bucket_elems', 'exclude_bias_and_norm']"]


@pytest.mark.parametrize("section, message", [
    ({"name": "lamb", "lrr": 0.1}, r"<dict>: optimizer.lrr: unknown hyper-parameter for lamb \(did you mean 'lr'\?\)"),
    ({"name": "lamb", "lr": "abc"}, r"<dict>: optimizer.lr: lr must be a number in \[0.0, inf\], got 'abc'"),
    ({"name": "lars", "momentum": "high"}, r"<dict>: optimizer.momentum: momentum must be a number"),
    ({"name": "lars", "nesterov": 1}, r"<dict>: optimizer.nesterov must be true or false, got 1"),
    ({"name": "LAMB"}, r"optimizer.name must be one of \['keep', 'lamb', 'lars'\], got 'LAMB' \(did you mean 'lamb'\?\)"),
    ({"lr": 0.1}, r"<dict>: optimizer.lr: hyper-parameters need optimizer.name lamb or lars"),
])
def test_optimizer_hyperparameters_are_validated_at_load_time(section, message):
    with pytest.raises(StrategyError, match=message):
        load_strategy({"optimizer": section})


def test_an_optimizer_section_naming_another_optimizer_replaces_the_parents():
    s = load_strategy({"extends": "large_batch", "optimizer": {"name": "lars", "momentum": 0.8}})
    assert s.optimizer.name == "lars" and s.optimizer.hyperparameters == {"momentum": 0.8}  # no LAMB weight_decay
    s = load_strategy({"extends": "large_batch", "optimizer": {"lr": 0.002}})
    assert s.optimizer.hyperparameters == {"weight_decay": 0.01, "lr": 0.002}  # same optimizer: merged
    assert load_strategy({"extends": "large_batch", "optimizer": {"name": "keep"}}).optimizer.hyperparameters == {}
