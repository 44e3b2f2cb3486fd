"""DTensor dispatch and async-TP graph shape on a 2-rank fake process group (in-process, no data).

The fake group runs collectives without communicating, so these tests check paths and
graphs only; numerics on a real gloo group are in test_tp_distributed.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fusible_ops.parallel import (
    PATH_ASYNC_TP,
    PATH_BMM,
    PATH_LINEAR,
    TPLinear,
    select_tp_linear_path,
    shard_colwise,
    shard_rowwise,
    tp_linear_forward,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (WORLD_SIZE,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def micro_pipeline_tp():
    import torch._inductor.config as inductor_config

    saved = inductor_config._micro_pipeline_tp
    torch._dynamo.reset()

    def set_flag(value: bool) -> None:
        inductor_config._micro_pipeline_tp = value

    yield set_flag
    inductor_config._micro_pipeline_tp = saved
    torch._dynamo.reset()


def _dtensor(mesh, shape, placement):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    place = Replicate() if placement == "replicate" else Shard(placement)
    return distribute_tensor(torch.randn(shape), mesh, [place])


# "replicate" or a Shard dim -> (eager path, path while tracing with async TP)
DTENSOR_CASES = {
    (3, "replicate"): (PATH_LINEAR, PATH_ASYNC_TP),
    (3, 0): (PATH_BMM, PATH_BMM),
    (3, 1): (PATH_BMM, PATH_BMM),
    (3, -2): (PATH_BMM, PATH_BMM),  # negative dims are normalised
    (3, -3): (PATH_BMM, PATH_BMM),
    (3, 2): (PATH_LINEAR, PATH_ASYNC_TP),
    (3, -1): (PATH_LINEAR, PATH_ASYNC_TP),
    (2, 0): (PATH_LINEAR, PATH_ASYNC_TP),
    (2, -1): (PATH_LINEAR, PATH_ASYNC_TP),
    (4, 1): (PATH_LINEAR, PATH_ASYNC_TP),
}
SHAPES = {2: (8, 16), 3: (2, 4, 16), 4: (2, 4, 2, 16)}


@pytest.mark.parametrize("ndim, placement", list(DTENSOR_CASES))
def test_dtensor_path_selection(mesh, micro_pipeline_tp, ndim, placement):
    eager_path, async_tp_path = DTENSOR_CASES[ndim, placement]
    x = _dtensor(mesh, SHAPES[ndim], placement)
    weight = _dtensor(mesh, (6, 16), 0)
    micro_pipeline_tp(True)
    assert select_tp_linear_path(x, True) == eager_path  # eager: the flag is ignored

    seen = []
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x, w):
        seen.append(select_tp_linear_path(x, True))
        return tp_linear_forward(x, w, None, True)

    out = torch.compile(fn, backend=capture, fullgraph=True)(x, weight)
    assert out.shape == (*SHAPES[ndim][:-1], 6)
    assert seen == [async_tp_path]
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.bmm in targets) == (async_tp_path == PATH_BMM)
    assert (F.linear in targets) == (async_tp_path == PATH_ASYNC_TP)


# ----------------------------------------------------------------------------- Inductor post-grad graph
class _MLP(nn.Module):
    """Colwise fc1 -> ReLU -> rowwise fc2, sequence-parallel in and out.

    fc2 has no bias: a rowwise bias is added to the partial sum before the reduce-scatter,
    which hides the mm from the pass.
    """

    def __init__(self, hidden: int = 16, ffn: int = 32) -> None:
        super().__init__()
        self.fc1 = TPLinear(hidden, ffn)
        self.fc2 = TPLinear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _fusible_patterns(graph: torch.fx.Graph) -> dict[str, int]:
    """How many all-gather -> mm and mm -> reduce-scatter patterns the micro-pipeline TP pass would fuse."""
    try:
        from torch._inductor.fx_passes.micro_pipeline_tp import (
            _find_consumer_matmuls,
            _find_producer_matmul,
            find_all_gather_patterns,
            find_reduce_scatter_patterns,
        )
    except ImportError:
        pytest.skip("this torch has no importable micro-pipeline TP matchers")
    all_gathers = find_all_gather_patterns(graph)
    reduce_scatters = find_reduce_scatter_patterns(graph)
    return {
        "all_gathers": len(all_gathers),
        "reduce_scatters": len(reduce_scatters),
        "all_gather_mm": sum(bool(_find_consumer_matmuls(ag.res_node)) for ag in all_gathers),
        "mm_reduce_scatter": sum(_find_producer_matmul(rs.input_node) is not None for rs in reduce_scatters),
    }


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="Inductor needs a C++ compiler"
)
@pytest.mark.parametrize("async_tp", [True, False], ids=["async_tp_on", "async_tp_off"])
def test_inductor_sees_micro_pipeline_tp_patterns(mesh, micro_pipeline_tp, async_tp):
    """Flag on: the post-grad graph has the all-gather -> mm and mm -> reduce-scatter the pass fuses.
    Flag off (the bmm path): neither."""
    import torch._inductor.config as inductor_config
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    mlp = _MLP()
    shard_colwise(mlp.fc1, mesh, input_layouts=Shard(1))
    shard_rowwise(mlp.fc2, mesh, output_layouts=Shard(1))
    found = []
    micro_pipeline_tp(async_tp)
    with inductor_config.patch(
        post_grad_custom_post_pass=lambda graph: found.append(_fusible_patterns(graph))
    ):
        with torch.no_grad():
            local_x = torch.randn(2, 4, 16)  # this rank's half of an 8-token sequence
            out = torch.compile(mlp)(local_x)
    assert out.shape == (2, 4, 16)
    assert len(found) == 1
    patterns = found[0]
    assert patterns["all_gathers"] == 1 and patterns["reduce_scatters"] == 1
    if async_tp:
        assert patterns["all_gather_mm"] == 1 and patterns["mm_reduce_scatter"] == 1
    else:
        assert patterns["all_gather_mm"] == 0 and patterns["mm_reduce_scatter"] == 0


def test_lora_styles_shard_a_plain_linear_in_the_same_plan(mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from fusible_ops.parallel import LinearLoRA, lora_colwise_parallel, lora_rowwise_parallel

    model = torch.nn.ModuleDict(
        {"a": torch.nn.Linear(8, 6), "b": LinearLoRA(8, 6, r=2), "c": torch.nn.Linear(6, 8)}
    )
    parallelize_module(
        model,
        mesh,
        {"a": lora_colwise_parallel(), "b": lora_colwise_parallel(), "c": lora_rowwise_parallel()},
    )
    assert model["a"].weight.placements == (Shard(0),)
    assert model["b"].weight.placements == (Shard(0),) and model["b"].lora_A.placements == (Replicate(),)
    assert model["c"].weight.placements == (Shard(1),)
