"""Probes on real models, loaders and this machine: what the ``match:`` rules are evaluated against."""
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from aiak.strategy import MODULE_KINDS, Probes, probe
from aiak.strategy.probes import LENGTH_PROBE_SAMPLES, model_features, module_counts
from aiak.util.machine import cpu, devices
from aiak.util.machine.cpu import cpu_features
from aiak.util.machine.devices import model_device
from aiak.strategy.select import model_features as model_features_from_select

_spec = importlib.util.spec_from_file_location("real_models", Path(__file__).with_name("real_models.py"))
real_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_models)
timm_swin, torchvision_swin, hf_swin, hf_bert = (real_models.timm_swin, real_models.torchvision_swin,
                                                 real_models.hf_swin, real_models.hf_bert)
torchvision_resnet18, encoder = real_models.torchvision_resnet18, real_models.encoder


# (factory, the counts that must be exact, the kinds that must be absent); 12 = the blocks of Swin-T (2+2+6+2)
MODELS = [
    (timm_swin, {"window_attention": 12}, {"multihead_attention", "batchnorm"}),
    (torchvision_swin, {"window_attention": 12}, {"multihead_attention", "batchnorm"}),
    (hf_swin, {"window_attention": 2}, {"multihead_attention"}),  # SwinAttention once, not also its bias module
    (hf_bert, {"multihead_attention": 2, "embedding": 3}, {"window_attention", "conv2d"}),  # BertAttention once
    (torchvision_resnet18, {"conv2d": 20, "batchnorm": 20, "linear": 1}, {"layernorm", "multihead_attention"}),
    (encoder, {"multihead_attention": 2, "layernorm": 4}, {"window_attention", "conv2d"}),
]


@pytest.mark.parametrize("factory, exact, absent", MODELS, ids=[m[0].__name__ for m in MODELS])
def test_module_kinds_are_counted_with_the_surgerys_recogniser(factory, exact, absent):
    counts = module_counts(factory())
    assert set(counts) == set(MODULE_KINDS)
    for kind, n in exact.items():
        assert counts[kind] == n, (kind, counts)
    for kind in absent:
        assert counts[kind] == 0, (kind, counts)
    assert model_features_from_select(factory()) == {k for k, n in counts.items() if n}


def test_swin_window_attention_count_equals_what_surgery_replaces():
    """The probe and the surgery agree: every module the probe counts is one the surgery fuses."""
    from aiak.ops import replace_window_attention

    for factory in (timm_swin, torchvision_swin, hf_swin):
        model = factory()
        assert module_counts(model)["window_attention"] == replace_window_attention(model) > 0


def test_kind_details():
    class LayerNorm2d(nn.Module):  # a class named *LayerNorm* counts as layernorm
        pass

    class CausalSelfAttention(nn.Module):  # holds an nn.MultiheadAttention: counted once
        def __init__(self):
            super().__init__()
            self.inner = nn.MultiheadAttention(8, 2)

    model = nn.Sequential(nn.Conv3d(1, 2, 3), nn.GroupNorm(1, 2), LayerNorm2d(), CausalSelfAttention(),
                          nn.Dropout(0.0), nn.Dropout(0.1), nn.EmbeddingBag(10, 4), nn.SyncBatchNorm(2))
    counts = module_counts(model)
    assert counts == {**dict.fromkeys(MODULE_KINDS, 0), "conv3d": 1, "groupnorm": 1, "layernorm": 1,
                      "multihead_attention": 1, "dropout": 1, "embedding": 1, "batchnorm": 1,
                      "linear": 1}  # MultiheadAttention's out_proj is an nn.Linear


def test_parameter_counts_and_optimizer():
    model = torchvision_resnet18()
    model.fc.weight.requires_grad_(False)
    found = probe(model, torch.optim.AdamW(model.parameters()))
    assert found.params == sum(p.numel() for p in model.parameters()) == 11_181_642
    assert found.trainable_params == found.params - model.fc.weight.numel()
    assert found.optimizer == "AdamW"
    assert probe(model).optimizer is None


def test_this_machines_hardware():
    found = probe(nn.Linear(2, 2))
    assert found.device == "cpu" and found.cuda is None and found.cuda_capability is None
    assert found.cpu_features == cpu_features() and found.cpu_cores >= 1 and found.cpu_model
    assert found.bf16_native == bool(cpu_features() & {"avx512_bf16", "amx_bf16", "bf16"})
    assert found.fp16_native == bool(cpu_features() & {"amx_fp16", "fphp", "asimdhp"})
    assert (found.world_size, found.local_size, found.nodes, found.backend) == (1, 1, 1, None)


@pytest.mark.parametrize("flags, fp16", [("avx512f avx512_bf16 amx_bf16 avx512_fp16", False),
                                         ("avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_fp16", True)])
def test_avx512_fp16_alone_does_not_make_fp16_native(tmp_path, monkeypatch, flags, fp16):
    """AVX512-FP16 without AMX-FP16 made fp16 steps 55-94x slower than fp32 on CNNs here, so the trials must not
    propose fp16 on such a CPU (`aiak.tune.candidates` reads `fp16_native`)."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(f"processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu {flags}\n")
    monkeypatch.setattr(cpu, "CPUINFO", str(fake))
    cpu.cpu_features.cache_clear()
    try:
        assert probe().fp16_native is fp16
    finally:
        cpu.cpu_features.cache_clear()


def test_cpu_model_is_the_model_name_line(tmp_path, monkeypatch):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\n")
    monkeypatch.setattr(cpu, "CPUINFO", str(fake))
    cpu.cpu_model.cache_clear()
    cpu.cpu_features.cache_clear()
    try:
        assert cpu.cpu_model() == "AMD EPYC 9654 96-Core Processor"
        assert cpu.cpu_features() == {"fpu", "avx2", "avx512f", "avx512_bf16"}
        assert probe().bf16_native and not probe().fp16_native
    finally:
        cpu.cpu_model.cache_clear()
        cpu.cpu_features.cache_clear()


def test_a_cpu_probe_never_touches_cuda(monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("the probe touched CUDA for a CPU model")

    for name in ("is_available", "device_count", "current_device", "get_device_properties", "get_device_capability",
                 "get_device_name", "init", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, touched)
    model = torchvision_resnet18()
    loader = DataLoader(TokenDataset([3, 5, 7]), batch_size=1)
    assert probe(model, torch.optim.SGD(model.parameters(), lr=0.1), loader).device == "cpu"


@pytest.mark.parametrize("capability, bf16, fp16", [((8, 6), True, True), ((7, 0), False, True),
                                                    ((6, 1), False, False)])
def test_a_cuda_probe_reads_the_models_device(monkeypatch, capability, bf16, fp16):
    """No GPU here: torch.cuda's queries answer as a 2-GPU machine would, to check which device is asked about
    and how its answers become probes (benchmarks/gpu_check.py is where a real GPU checks them)."""
    asked = []

    class Properties:
        name, total_memory = "NVIDIA RTX A6000", 51_527_024_640

    def capability_of(index):
        asked.append(index)
        return capability

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or Properties())
    devices._capability_of.cache_clear()
    try:
        found = probe(nn.Linear(2, 2), device="cuda:1")
    finally:
        devices._capability_of.cache_clear()
    assert set(asked) == {1}
    assert found.device == "cuda" and found.cuda == {"name": "NVIDIA RTX A6000",
                                                     "capability": f"{capability[0]}.{capability[1]}",
                                                     "count": 2, "memory_gb": 48.0}
    assert found.cuda_capability == capability and (found.bf16_native, found.fp16_native) == (bf16, fp16)


def test_to_dict_is_json_ready():
    model = encoder()
    found = probe(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TokenDataset([2, 4]), batch_size=2))
    data = json.loads(json.dumps(found.to_dict()))
    assert data["cpu_features"] == sorted(found.cpu_features)
    assert data["modules"]["multihead_attention"] == 2 and data["optimizer"] == "SGD"
    assert data["loader"] == {"present": True, "batch_size": 2, "num_workers": 0, "pin_memory": False,
                              "variable_length": True}
    assert set(data) == {f for f in Probes.__dataclass_fields__}


def test_model_device_follows_the_parameters_unless_a_device_is_given():
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(None) == torch.device("cpu")
    assert model_device(nn.Linear(2, 2), "meta") == torch.device("meta")
    assert model_features(None) == set() and module_counts(None) == dict.fromkeys(MODULE_KINDS, 0)


# -- loader ---------------------------------------------------------------------------------------------------
class TokenDataset(Dataset):
    """Samples of the given lengths; counts how many were read."""

    def __init__(self, lengths, as_dict=False):
        self.sizes, self.as_dict, self.reads = list(lengths), as_dict, 0

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        self.reads += 1
        tokens = torch.arange(self.sizes[i])
        return {"input_ids": tokens, "labels": 0} if self.as_dict else (tokens, 0)


def test_variable_length_reads_at_most_32_samples():
    fixed_then_longer = [8] * LENGTH_PROBE_SAMPLES + [9] * 1000
    dataset = TokenDataset(fixed_then_longer)
    facts = probe(loader=DataLoader(dataset, batch_size=4, num_workers=0)).loader
    assert dataset.reads == LENGTH_PROBE_SAMPLES == 32
    assert facts == {"present": True, "batch_size": 4, "num_workers": 0, "pin_memory": False,
                     "variable_length": False}  # the first 32 are all 8 long: what the probe can know
    varying = TokenDataset([5, 9] * 600, as_dict=True)
    assert probe(loader=DataLoader(varying, batch_size=4)).loader["variable_length"] is True
    assert varying.reads == 32


def test_declared_lengths_are_used_without_reading_samples():
    dataset = TokenDataset([4] * 100)
    dataset.lengths = [4] * 99 + [7]
    assert probe(loader=DataLoader(dataset)).loader["variable_length"] is False  # only the first 32 count
    dataset.lengths = lambda: [4, 7] * 50
    assert probe(loader=DataLoader(dataset)).loader["variable_length"] is True
    assert dataset.reads == 0


def test_variable_length_is_unknown_where_it_cannot_be_measured():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([torch.zeros(3)])

    assert probe(loader=DataLoader(Stream())).loader["variable_length"] is None
    batches = [(torch.zeros(2, 3), torch.zeros(2))]
    assert probe(loader=batches).loader == {"present": True, "batch_size": None, "num_workers": None,
                                            "pin_memory": None, "variable_length": None}
    unmeasurable = DataLoader([object(), object()], batch_size=1, collate_fn=lambda b: b)
    assert probe(loader=unmeasurable).loader["variable_length"] is None
    assert probe(loader=DataLoader(TokenDataset([]))).loader["variable_length"] is None
    assert probe().loader["present"] is False


def test_reading_samples_leaves_the_random_streams_as_they_were():
    """Random transforms in ``__getitem__`` draw from the global RNGs; the probe's reads must not shift the
    user's run (its augmentations and everything after)."""
    class Augmented(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            crop = int(torch.randint(1, 9, ()).item()) + random.randint(0, 3) + int(np.random.randint(0, 3))
            return torch.zeros(crop)

    def draws():
        return torch.rand(3), random.random(), np.random.rand()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert probe(loader=DataLoader(Augmented())).loader["variable_length"] is True
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
