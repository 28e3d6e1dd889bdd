"""What :mod:`aiak.comm.algorithms.powersgd` takes from torch's PowerSGD hook module, pinned: two private
functions (``_orthogonalize``, ``_should_compress``) and the fields of ``PowerSGDState`` it reads and writes. A
torch release that renames, re-signs or changes them fails here, by name, instead of inside a 2-rank run."""
import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd


def test_should_compress_keeps_its_arguments_and_its_rule():
    params = list(inspect.signature(torch_powersgd._should_compress).parameters)
    assert params == ["num_rows", "num_cols", "matrix_approximation_rank", "min_compression_rate"]
    # worth compressing when (rows + cols) * rank * min_rate < rows * cols; returns both element counts
    assert torch_powersgd._should_compress(64, 32, 4, 2) == (True, 64 * 32, (64 + 32) * 4)
    assert torch_powersgd._should_compress(8, 8, 4, 2) == (False, 64, 64)
    assert torch_powersgd._should_compress(16, 16, 4, 2)[0] is False  # (16 + 16) * 4 * 2 == 256: not strictly less
    assert torch_powersgd._should_compress(17, 16, 4, 2)[0] is True   # 264 < 272


@pytest.mark.parametrize("rank", [1, 2, 4])   # rank <= 2 takes Gram-Schmidt, above it QR
def test_orthogonalize_makes_each_matrix_of_a_batch_orthonormal_in_place(rank):
    assert list(inspect.signature(torch_powersgd._orthogonalize).parameters) == ["matrices", "epsilon"]
    torch.manual_seed(0)
    batch = torch.randn(3, 16, rank)
    storage = batch.data_ptr()
    torch_powersgd._orthogonalize(batch, 0)
    assert batch.data_ptr() == storage
    eye = torch.eye(rank).expand(3, rank, rank)
    torch.testing.assert_close(batch.transpose(1, 2) @ batch, eye, atol=1e-5, rtol=0)


def test_powersgd_state_has_the_fields_aiak_reads_and_writes(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=3,
                                             start_powerSGD_iter=5, use_error_feedback=True, warm_start=True,
                                             random_seed=7)
    finally:
        dist.destroy_process_group()
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.iter) == (3, 5, 0)
    assert state.use_error_feedback and state.warm_start
    for table in ("error_dict", "p_memory_dict", "q_memory_dict"):
        assert getattr(state, table) == {}
    assert isinstance(state.rng, np.random.RandomState)
    assert state.rng.get_state()[1].tolist() == np.random.RandomState(7).get_state()[1].tolist()
    assert isinstance(state.min_compression_rate, (int, float))
    assert isinstance(state.orthogonalization_epsilon, (int, float))
