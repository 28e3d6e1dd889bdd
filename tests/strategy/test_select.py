"""The auto-selector: the YAML rules composed on real models, on this machine and on described machines."""
import dataclasses
import importlib.util
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import aiak
from aiak.strategy import Knob, Selection, StrategyError, compose, list_profiles, load_strategy, probe
from aiak.strategy.select import resolve_strategy, select, select_strategy

_spec = importlib.util.spec_from_file_location("real_models", Path(__file__).with_name("real_models.py"))
real_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_models)

# Machines, described as the probes would find them.
CPU_BF16 = dict(device="cpu", cuda=None, cpu_features=frozenset({"avx2", "avx512f", "avx512_bf16"}),
                bf16_native=True, fp16_native=False)
CPU_PLAIN = dict(device="cpu", cuda=None, cpu_features=frozenset({"avx2", "fma"}), bf16_native=False,
                 fp16_native=False)
CUDA_70 = dict(device="cuda", cuda={"name": "Tesla V100-SXM2-32GB", "capability": "7.0", "count": 8,
                                    "memory_gb": 31.7}, bf16_native=False, fp16_native=True)
CUDA_80 = dict(device="cuda", cuda={"name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "count": 8,
                                    "memory_gb": 79.2}, bf16_native=True, fp16_native=True)
TWO_NODES = dict(world_size=16, local_size=8, nodes=2, backend="nccl")
MACHINES = {"cpu_bf16": CPU_BF16, "cpu_plain": CPU_PLAIN, "cuda_7.0": CUDA_70, "cuda_8.0": CUDA_80,
            "cuda_8.0_2_nodes": {**CUDA_80, **TWO_NODES}, "cpu_bf16_2_nodes": {**CPU_BF16, **TWO_NODES}}


class Tokens(Dataset):
    def __init__(self, lengths):
        self.lengths_ = lengths

    def __len__(self):
        return len(self.lengths_)

    def __getitem__(self, i):
        return torch.ones(self.lengths_[i], dtype=torch.long), 0


SWINS = {"timm_swin": real_models.timm_swin, "torchvision_swin": real_models.torchvision_swin,
         "hf_swin": real_models.hf_swin}
CNNS = {"timm_resnet18": real_models.timm_resnet18, "torchvision_resnet18": real_models.torchvision_resnet18}


@pytest.fixture(scope="module")
def model_probes():
    """Each real model probed once on this machine (with an SGD optimizer); the machine is then swapped."""
    found = {}
    for name, factory in {**SWINS, **CNNS, "hf_bert": real_models.hf_bert}.items():
        model = factory()
        found[name] = probe(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = real_models.encoder()
    opt = torch.optim.AdamW(model.parameters())
    found["encoder_variable"] = probe(model, opt, DataLoader(Tokens([5, 9, 13] * 20), batch_size=4))
    found["encoder_fixed"] = probe(model, opt, DataLoader(Tokens([16] * 60), batch_size=4))
    return found


def on(found, machine: str):
    return dataclasses.replace(found, **MACHINES[machine])


def leaves(data, prefix=""):
    for key, value in data.items():
        if not prefix and key in ("name", "extends", "description", "match"):
            continue
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def knob(selection: Selection, path: str) -> Knob:
    return selection.knobs[path]


# -- real models --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("model", list(SWINS))
def test_swin_models_get_fused_window_attention_on_every_machine(model_probes, model, machine):
    selection = compose(on(model_probes[model], machine))
    assert selection.strategy.fused_ops == ["window_attention"]
    assert "window_attention" in selection.matched
    assert knob(selection, "fused_ops").source in ("profile:window_attention", "profile:swin")


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("model", list(CNNS))
def test_cnns_get_channels_last_on_every_machine(model_probes, model, machine):
    selection = compose(on(model_probes[model], machine))
    assert selection.strategy.channels_last is True
    assert knob(selection, "channels_last").source in ("profile:channels_last", "profile:cnn")
    # on a CPU, the 1x1 convolutions of their downsampling shortcuts as matrix multiplies (configs/pointwise_conv.yaml)
    assert selection.strategy.fused_ops == (["pointwise_conv"] if machine.startswith("cpu") else [])


def test_this_machine_with_real_models():
    """``select`` probes this machine itself: bf16 exactly where its CPU has bf16 hardware, never fp16."""
    for factory in (real_models.timm_swin, real_models.torchvision_resnet18):
        model = factory()
        selection = select(model, torch.optim.SGD(model.parameters(), lr=0.1))
        p = selection.strategy.precision
        assert selection.probes.device == "cpu"
        if selection.probes.bf16_native:
            assert (p.level, p.dtype) == ("O1", "bf16") and "cpu_bf16" in selection.matched
        else:
            assert p.level == "O0" and "cpu_bf16" in selection.skipped
        assert not (p.level != "O0" and p.dtype == "fp16")
        assert selection.strategy.tune.enabled and selection.strategy.loader.prefetch == 2
    assert select(real_models.timm_swin()).strategy.fused_ops == ["window_attention"]
    assert select(real_models.torchvision_resnet18()).strategy.channels_last


@pytest.mark.parametrize("machine, level, dtype", [("cpu_bf16", "O1", "bf16"), ("cpu_plain", "O0", "bf16"),
                                                   ("cuda_7.0", "O2", "fp16"), ("cuda_8.0", "O1", "bf16")])
def test_precision_of_a_cnn_follows_the_hardware(model_probes, machine, level, dtype):
    """bf16 only with bf16 hardware; fp16 O2 (the cnn profile) only on a GPU with fp16 tensor cores."""
    p = compose(on(model_probes["torchvision_resnet18"], machine)).strategy.precision
    assert (p.level, p.dtype) == (level, dtype)


@pytest.mark.parametrize("machine, level", [("cpu_bf16", "O1"), ("cpu_plain", "O0"), ("cuda_7.0", "O0"),
                                            ("cuda_8.0", "O2")])
def test_precision_of_a_swin_follows_the_hardware(model_probes, machine, level):
    p = compose(on(model_probes["timm_swin"], machine)).strategy.precision
    assert p.level == level and (level == "O0" or p.dtype == "bf16")


def test_a_resnet_on_an_a100_composes_in_name_order(model_probes):
    """The example in docs/strategy.md: cnn (O2 fp16) comes before cuda_bf16 (O1 bf16), which wins the keys it sets."""
    selection = compose(on(model_probes["torchvision_resnet18"], "cuda_8.0"))
    assert selection.matched == ["auto_base", "channels_last", "cnn", "cuda", "cuda_bf16"]
    s = selection.strategy
    assert (s.precision.level, s.precision.dtype, s.precision.loss_scale) == ("O1", "bf16", "dynamic")
    assert knob(selection, "precision.level").source == "profile:cuda_bf16"
    assert knob(selection, "precision.loss_scale").source == "profile:cnn"
    assert (s.tf32, s.cudnn_benchmark, s.loader.pin_memory) == (True, True, True)
    assert knob(selection, "tf32").source == "profile:cuda"  # cuda comes after cnn; both set it


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("model", [*SWINS, *CNNS, "hf_bert", "encoder_variable", "encoder_fixed"])
def test_invariants_on_every_model_and_machine(model_probes, model, machine):
    selection = compose(on(model_probes[model], machine))
    s = selection.strategy
    assert s.name == "auto"
    if MACHINES[machine]["device"] == "cpu":
        assert not (s.precision.level != "O0" and s.precision.dtype == "fp16"), "fp16 on a CPU"
    if not MACHINES[machine]["bf16_native"]:
        assert not (s.precision.level != "O0" and s.precision.dtype == "bf16"), "bf16 without bf16 hardware"
    assert s.optimizer.name == "keep", "LAMB/LARS from auto"
    assert s.loader.balanced is (model == "encoder_variable" and machine.startswith("cuda_8.0"))
    if s.loader.balanced:
        assert knob(selection, "loader.balanced").source == "profile:transformer"
    # every knob: present, with a source and a non-empty reason
    expected_paths = [path for path, _ in leaves(s.to_dict())]
    assert list(selection.knobs) == expected_paths
    for path, value in leaves(s.to_dict()):
        k = selection.knobs[path]
        assert k.value == value, path
        assert k.source == "default" or k.source.removeprefix("profile:") in selection.matched, (path, k.source)
        assert k.reason.strip(), path
    assert set(selection.matched).isdisjoint(selection.skipped)
    assert set(selection.matched) | set(selection.skipped) == set(list_profiles())
    assert all(why for why in selection.skipped.values())
    assert "large_batch" in selection.skipped and "default" in selection.skipped
    assert ("multi_node_comm" in selection.matched) is machine.endswith("2_nodes")
    assert "multi_node" in selection.skipped and selection.strategy.grad_accumulation == 1


def test_transformer_balanced_batches_only_with_variable_length_samples(model_probes):
    varying = compose(on(model_probes["encoder_variable"], "cuda_8.0"))
    fixed = compose(on(model_probes["encoder_fixed"], "cuda_8.0"))
    assert varying.strategy.loader.balanced and "transformer" in varying.matched
    assert not fixed.strategy.loader.balanced
    assert fixed.skipped["transformer"] == "variable_length: true (found false)"
    assert (fixed.strategy.precision.level, fixed.strategy.precision.dtype) == ("O1", "bf16")  # cuda_bf16 still
    no_loader = compose(on(model_probes["hf_bert"], "cuda_8.0"))
    assert no_loader.skipped["transformer"].startswith("variable_length: true (found unknown")


def test_two_nodes_turn_on_the_comm_autotuner_and_never_accumulation(model_probes):
    selection = compose(on(model_probes["torchvision_resnet18"], "cuda_8.0_2_nodes"))
    assert "multi_node_comm" in selection.matched and "multi_node" not in selection.matched
    assert selection.strategy.comm.autotune and selection.strategy.grad_accumulation == 1
    assert knob(selection, "comm.autotune").source == "profile:multi_node_comm"
    assert compose(on(model_probes["torchvision_resnet18"], "cuda_8.0")).skipped["multi_node_comm"] == \
        "nodes >=2 (found 1)"


def test_reasons_and_the_public_tuple(model_probes):
    selection = compose(on(model_probes["torchvision_resnet18"], "cpu_bf16"))
    reasons = selection.reasons
    assert reasons["*"].startswith("auto: default.yaml, then each profile whose match: holds, in order: "
                                   "auto_base, channels_last, cpu_bf16")
    assert reasons["channels_last"].startswith("profile 'channels_last' matched (modules all of [conv2d, batchnorm] "
                                                "(found 20 conv2d, 20 batchnorm))")
    assert reasons["precision.level"].startswith("profile 'cpu_bf16' matched (device: cpu (found cpu); "
                                                 "cpu_features any of [avx512_bf16, amx_bf16] (found avx512_bf16))")
    assert reasons["tf32"] == "no profile that matched sets it: default.yaml's value (plain PyTorch)"
    model = real_models.torchvision_resnet18()
    strategy, reasons = aiak.select_strategy(model, None, None)
    assert strategy == select(model).strategy and set(reasons) == {"*", *select(model).knobs}
    assert select_strategy is aiak.select_strategy


def test_profiles_contribute_only_the_keys_they_set_not_defaults(tmp_path, monkeypatch, model_probes):
    """A user profile extending default and setting one knob does not reset channels_last (set by an earlier
    rule) back to default.yaml's false."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "tf32_everywhere.yaml").write_text("extends: default\ndescription: mine\nmatch: {}\ntf32: true\n")
    (folder / "like_cnn.yaml").write_text("extends: cnn\ndescription: cnn everywhere\nmatch: {device: cpu}\n"
                                          "precision: {level: O0}\n")
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(folder))
    selection = compose(on(model_probes["torchvision_resnet18"], "cpu_bf16"))
    assert selection.matched[-2:] == ["like_cnn", "tf32_everywhere"]
    s = selection.strategy
    assert s.channels_last and knob(selection, "channels_last").source == "profile:like_cnn"  # via extends: cnn
    assert s.tf32 and knob(selection, "tf32").source == "profile:tf32_everywhere"
    assert s.precision.level == "O0" and knob(selection, "precision.level").source == "profile:like_cnn"
    assert s.precision.dtype == "fp16"  # inherited from cnn, with level O0 it is unused: no fp16 math
    assert s.loader.pin_memory and knob(selection, "loader.pin_memory").source == "profile:like_cnn"
    assert knob(selection, "grad_accumulation").source == "default"  # cnn extends default; default's keys excluded


# -- user profiles ------------------------------------------------------------------------------------------
def write(folder, name, text):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_user_profile_overrides_a_built_in_knob_and_is_named_as_its_source(tmp_path, monkeypatch, model_probes):
    path = write(tmp_path / "team", "no_nhwc.yaml", """
        description: our CNNs are faster in NCHW
        match: {modules: [conv2d]}
        channels_last: false
    """)
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "team"))
    selection = compose(on(model_probes["torchvision_resnet18"], "cpu_bf16"))
    assert selection.strategy.channels_last is False
    assert knob(selection, "channels_last") == Knob(False, "profile:no_nhwc", "profile 'no_nhwc' matched "
                                                    "(modules: conv2d (found 20 conv2d)): our CNNs are faster in NCHW")
    assert selection.matched[-1] == "no_nhwc"
    assert "no_nhwc" in list_profiles() and "no_nhwc" not in list_profiles(user=False)
    assert load_strategy("no_nhwc").channels_last is False and load_strategy("no_nhwc").name == "no_nhwc"
    assert resolve_strategy("no_nhwc").knobs["channels_last"].source == "default"  # same as default.yaml
    assert path.parent in aiak.strategy.user_profile_dirs()


def test_search_order_env_folders_in_order_then_home(tmp_path, monkeypatch, model_probes):
    first, second, home = tmp_path / "first", tmp_path / "second", tmp_path / "home"
    write(first, "z_prefetch.yaml", "match: {}\nloader: {prefetch: 3}\n")
    write(second, "a_prefetch.yaml", "match: {}\nloader: {prefetch: 5}\n")  # later folder wins, whatever the name
    write(home / ".config" / "aiak" / "profiles", "b_prefetch.yaml", "match: {loader: true}\nloader: {prefetch: 7}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AIAK_PROFILE_PATH", f"{first}:{second}")
    found = model_probes["encoder_fixed"]
    selection = compose(on(found, "cpu_plain"))
    assert selection.matched[-3:] == ["z_prefetch", "a_prefetch", "b_prefetch"]
    assert selection.strategy.loader.prefetch == 7 and knob(selection, "loader.prefetch").source == "profile:b_prefetch"
    no_loader = compose(on(model_probes["hf_bert"], "cpu_plain"))
    assert no_loader.strategy.loader.prefetch == 5
    assert no_loader.skipped["b_prefetch"] == "loader: true (found no loader)"
    monkeypatch.setenv("AIAK_PROFILE_PATH", f"{second}:{first}")
    assert compose(on(found, "cpu_plain")).matched[-3:] == ["a_prefetch", "z_prefetch", "b_prefetch"]


def test_a_user_profile_named_like_a_built_in_is_evaluated_under_its_path(tmp_path, monkeypatch, model_probes):
    path = write(tmp_path / "p", "cnn.yaml", "match: {}\ncompile: true\n")
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "p"))
    selection = compose(on(model_probes["hf_bert"], "cpu_plain"))
    assert selection.matched[-1] == str(path) and knob(selection, "compile").source == f"profile:{path}"
    assert load_strategy("cnn").precision.dtype == "fp16"  # the name still loads the built-in


def test_a_user_profile_with_a_bad_match_key_is_reported(tmp_path, monkeypatch, model_probes):
    path = write(tmp_path / "p", "broken.yaml", "match: {modulse: [conv2d], device: gpu}\ntf32: true\n")
    write(tmp_path / "p", "also_broken.yaml", "match: {nodes: many}\n")
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "p"))
    with pytest.raises(StrategyError) as err:
        compose(on(model_probes["torchvision_resnet18"], "cpu_bf16"))
    problems = err.value.problems
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"{tmp_path / 'p' / 'also_broken.yaml'}: match.nodes must be")
    assert problems[1] == (f"{path}: match.modulse: unknown key (did you mean 'modules'?); valid keys: ['modules', "
                           "'device', 'cuda_capability', 'cpu_features', 'world_size', 'nodes', 'params', "
                           "'fp8_linear_share', 'training_state_share', 'lm_head_logits_bytes', 'optimizer', "
                           "'variable_length', 'loader']")
    assert problems[2].startswith(f"{path}: match.device must be one of ['cpu', 'cuda'], got 'gpu'")
    with pytest.raises(StrategyError, match="match.modulse"):
        aiak.select_strategy(real_models.torchvision_resnet18())


def test_a_user_profile_asking_for_fp16_on_a_cpu_is_refused_with_the_reason(tmp_path, monkeypatch, model_probes):
    write(tmp_path / "p", "fp16.yaml", "match: {}\nprecision: {level: O2, dtype: fp16}\ncompile: true\n")
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "p"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selection = compose(on(model_probes["torchvision_resnet18"], "cpu_bf16"))
    p = selection.strategy.precision
    assert (p.level, p.dtype) == ("O1", "bf16")  # what cpu_bf16 had set before
    assert knob(selection, "precision.level").source == "profile:cpu_bf16"
    assert "kept although profile 'fp16' asks for fp16: this cpu has no fp16 hardware" in \
        knob(selection, "precision.dtype").reason
    assert selection.strategy.compile and "fp16" in selection.matched  # the profile's other knobs still apply
    assert [str(w.message) for w in caught if "fp16" in str(w.message)] == [
        f"aiak: strategy 'auto' ignored the fp16 precision of profile 'fp16' ({tmp_path / 'p' / 'fp16.yaml'}): "
        f"{knob(selection, 'precision.dtype').reason.split('asks for fp16: ')[1]}"]
    on_plain = compose(on(model_probes["torchvision_resnet18"], "cpu_plain")).strategy.precision
    assert on_plain.level == "O0"
    on_volta = compose(on(model_probes["hf_bert"], "cuda_7.0")).strategy.precision
    assert (on_volta.level, on_volta.dtype) == ("O2", "fp16")  # fp16 tensor cores: allowed


def test_lamb_only_when_a_profile_allows_it(tmp_path, monkeypatch, model_probes):
    for machine in MACHINES:
        assert compose(on(model_probes["hf_bert"], machine)).strategy.optimizer.name == "keep"
    write(tmp_path / "p", "lamb_for_adamw.yaml", """
        match: {optimizer: [AdamW], params: "<1e9"}
        optimizer: {name: lamb, weight_decay: 0.01}
    """)
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "p"))
    with_adamw = compose(on(model_probes["encoder_fixed"], "cpu_plain"))
    assert with_adamw.strategy.optimizer.name == "lamb"
    assert with_adamw.strategy.optimizer.hyperparameters == {"weight_decay": 0.01}
    assert knob(with_adamw, "optimizer.weight_decay").source == "profile:lamb_for_adamw"
    with_sgd = compose(on(model_probes["hf_bert"], "cpu_plain"))
    assert with_sgd.strategy.optimizer.name == "keep"
    assert with_sgd.skipped["lamb_for_adamw"] == "optimizer any of [AdamW] (found SGD)"


def test_a_composition_that_is_impossible_names_the_profiles(tmp_path, monkeypatch, model_probes):
    write(tmp_path / "p", "no_prefetch.yaml", "match: {}\nloader: {prefetch: 0}\n")
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "p"))
    with pytest.raises(StrategyError) as err:
        compose(on(model_probes["torchvision_resnet18"], "cuda_8.0"))  # cuda sets pin_memory: true
    assert "loader.pin_memory needs loader.prefetch >= 1" in err.value.problems[0]
    assert "loader.pin_memory = true from profile:cuda" in err.value.problems[-1]
    assert "loader.prefetch = 0 from profile:no_prefetch" in err.value.problems[-1]


def test_the_digest_covers_every_profile_file(tmp_path, monkeypatch, model_probes):
    found = on(model_probes["hf_bert"], "cpu_plain")
    base = compose(found).profiles_digest
    assert compose(found).profiles_digest == base and len(base) == 40
    path = write(tmp_path / "p", "late.yaml", "match: {device: cuda}\ntf32: true\n")
    monkeypatch.setenv("AIAK_PROFILE_PATH", str(tmp_path / "p"))
    with_user = compose(found)
    assert "late" in with_user.skipped and with_user.profiles_digest != base  # evaluated, so part of the key
    path.write_text("match: {device: cuda}\ntf32: false\n")
    assert compose(found).profiles_digest not in (base, with_user.profiles_digest)


# -- explicit strategies ------------------------------------------------------------------------------------
def test_resolve_a_named_profile_a_path_a_dict_and_a_strategy(tmp_path):
    cnn = resolve_strategy("cnn", nn.Linear(2, 2))
    assert cnn.strategy == load_strategy("cnn") and cnn.matched == [] and cnn.skipped == {}
    assert cnn.knobs["precision.dtype"] == Knob("fp16", "profile:cnn", "set by profile 'cnn' (default: bf16)")
    assert cnn.knobs["compile"].source == "default" and cnn.knobs["compile"].reason
    assert cnn.reasons["*"].startswith("strategy 'cnn' given explicitly: Convolutional networks")
    assert cnn.probes.device == "cpu" and len(cnn.profiles_digest) == 40
    path = tmp_path / "mine.yaml"
    path.write_text("extends: cnn\ncompile: true\n")
    mine = resolve_strategy(str(path))
    assert mine.knobs["compile"].source == "user" and mine.knobs["precision.dtype"].source == "user"
    assert mine.profiles_digest != cnn.profiles_digest
    as_dict = resolve_strategy({"tune": True})
    assert as_dict.knobs["tune.enabled"] == Knob(True, "user", "set by the strategy given (a dict) (default: false)")
    assert as_dict.knobs["tune.candidates"].source == "default"
    as_strategy = resolve_strategy(load_strategy("swin"))
    assert as_strategy.knobs["fused_ops"].source == "user"
    for selection in (cnn, mine, as_dict, as_strategy):
        assert list(selection.knobs) == [p for p, _ in leaves(selection.strategy.to_dict())]
        assert all(k.reason for k in selection.knobs.values())


def test_resolve_auto_is_select():
    model = real_models.torchvision_resnet18()
    auto = resolve_strategy("auto", model)
    assert auto.strategy == select(model).strategy and auto.matched == select(model).matched


# -- fp8 ------------------------------------------------------------------------------------------------------
CUDA_90 = {**CUDA_80, "cuda": {**CUDA_80["cuda"], "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}}


@pytest.mark.parametrize("machine", list(MACHINES))
def test_auto_never_proposes_fp8_without_fp8_tensor_cores(model_probes, machine):
    """CPUs, V100 and A100 (compute capability below 8.9): fp8 would be emulated, so no rule proposes it."""
    for name, found in model_probes.items():
        assert compose(on(found, machine)).strategy.precision.fp8 == "off", (name, machine)


def test_on_hopper_auto_proposes_fp8_for_a_transformer_and_not_for_a_cnn(model_probes):
    """The fp8 profile matches where the eligible Linear layers carry most of the matrix-multiply work: BERT's do
    (share 0.88 as probed), a ResNet's convolutions carry nearly all of it (share 0)."""
    bert = compose(dataclasses.replace(model_probes["hf_bert"], **CUDA_90))
    assert bert.strategy.precision.fp8 == "tensorwise" and bert.strategy.compile is True
    assert bert.knobs["precision.fp8"].source == "profile:fp8"
    assert "fp8_linear_share >=0.5 (found 0.88)" in bert.knobs["precision.fp8"].reason
    resnet = compose(dataclasses.replace(model_probes["torchvision_resnet18"], **CUDA_90))
    assert resnet.strategy.precision.fp8 == "off"
    assert resnet.skipped["fp8"] == "fp8_linear_share >=0.5 (found 0.00)"


def test_without_torchao_auto_leaves_fp8_out_and_says_why(model_probes, monkeypatch, warnings_said_again, said):
    import sys

    monkeypatch.setattr(sys.modules["aiak.strategy.select"], "torchao_problem", lambda: "needs torchao, which is not installed: pip "
                                                                  "install 'aiak[fp8]' (torchao)")
    with said:
        bert = compose(dataclasses.replace(model_probes["hf_bert"], **CUDA_90))
    assert bert.strategy.precision.fp8 == "off"
    assert "asks for fp8 tensorwise: precision.fp8 needs torchao" in bert.knobs["precision.fp8"].reason
    assert "ignored the fp8 tensorwise precision of profile 'fp8'" in said.text and "aiak[fp8]" in said.text
