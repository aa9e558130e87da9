"""The parallel flags (vLLM's names, short forms, defaults), the layer split, the refusals
of what is not built yet and the GPU each CUDA rank takes; no process is started here."""

from __future__ import annotations

import pytest
import torch

from pagellm.distributed.config import ParallelArgs, get_pp_indices, layer_partition
from pagellm.distributed.group import ENGINE_SLOT_ENV, RankInfo, check_gpus, rank_device
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.cli import build_parser


def _engine_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args(["serve", *argv]))


def test_short_flags_and_defaults() -> None:
    defaults = _engine_args()
    assert [getattr(defaults, name) for name in (
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
        "data_parallel_size_local", "data_parallel_start_rank", "data_parallel_rank",
        "data_parallel_address", "data_parallel_rpc_port", "data_parallel_backend", "headless",
        "api_server_count", "distributed_executor_backend", "nnodes", "node_rank",
        "master_addr", "master_port")] == [1, 1, 1, None, 0, None, "127.0.0.1", 29550, "mp",
                                           False, 1, None, 1, None, "127.0.0.1", 29501]
    assert ParallelArgs().parallel_config().node_rank == 0  # the head, unless --headless
    args = _engine_args("-tp", "2", "-pp", "3", "-dp", "4", "-dpl", "2", "-dpr", "2", "-dpn",
                        "1", "-dpa", "10.0.0.1", "-dpp", "13345", "-dpb", "ray", "--headless",
                        "--api-server-count", "8", "--nnodes", "2", "--node-rank", "1",
                        "--master-addr", "10.0.0.2", "--master-port", "29600",
                        "--distributed-executor-backend", "mp")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size,
            args.data_parallel_size_local, args.data_parallel_start_rank,
            args.data_parallel_rank, args.data_parallel_address, args.data_parallel_rpc_port,
            args.data_parallel_backend, args.headless, args.api_server_count, args.nnodes,
            args.node_rank, args.master_addr, args.master_port,
            args.distributed_executor_backend) == (2, 3, 4, 2, 2, 1, "10.0.0.1", 13345, "ray",
                                                   True, 8, 2, 1, "10.0.0.2", 29600, "mp")


def test_executor_is_chosen_as_vllm_chooses() -> None:
    assert ParallelArgs().parallel_config().distributed_executor_backend == "uni"
    one_on_mp = ParallelArgs(distributed_executor_backend="mp").parallel_config()
    assert (one_on_mp.world_size, one_on_mp.distributed_executor_backend) == (1, "mp")
    config = ParallelArgs(tensor_parallel_size=2, pipeline_parallel_size=2).parallel_config()
    assert (config.world_size, config.distributed_executor_backend) == (4, "mp")
    config = ParallelArgs(data_parallel_size=2, data_parallel_backend="ray",
                          tensor_parallel_size=2).parallel_config()  # Ray places the ranks too
    assert (config.distributed_executor_backend, config.data_parallel.backend) == ("ray", "ray")
    with pytest.raises(ValueError, match="'uni' runs one process; a world size of 2 needs"):
        ParallelArgs(tensor_parallel_size=2,
                     distributed_executor_backend="uni").parallel_config()


@pytest.mark.parametrize("overrides, refused", [
    ({"data_parallel_size": 2, "tensor_parallel_size": 2,
      "distributed_executor_backend": "ray"}, "data parallelism combined with "
                                              "distributed_executor_backend 'ray'"),
    ({"headless": True}, "--headless without --nnodes or data_parallel_size"),
    ({"nnodes": 2, "data_parallel_size": 2}, "data parallelism combined with --nnodes"),
    ({"api_server_count": 4, "data_parallel_size": 2, "data_parallel_size_local": 1},
     "api_server_count 4 with data parallel ranks on other nodes (-dpl below -dp)"),
])
def test_unbuilt_combinations_are_refused(overrides: dict, refused: str) -> None:
    with pytest.raises(ValueError, match="is not supported by pagellm yet") as error:
        ParallelArgs(**overrides).parallel_config()
    assert refused in str(error.value)


def test_sizes_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        ParallelArgs(tensor_parallel_size=0).parallel_config()
    with pytest.raises(ValueError, match="api_server_count must be at least 1, got 0"):
        ParallelArgs(api_server_count=0).parallel_config()
    with pytest.raises(SystemExit):  # argparse: "must be 0 or more, got -1"
        _engine_args("--api-server-count", "-1")


def test_api_servers_run_with_local_engines_only() -> None:
    """Several API servers, with one engine or data parallel ones on this node (or one
    rank behind an outside balancer); never on a headless node, which serves no API."""
    for overrides in ({}, {"data_parallel_size": 2}, {"data_parallel_size": 2,
                                                      "data_parallel_rank": 1}):
        ParallelArgs(api_server_count=2, **overrides).parallel_config()
    with pytest.raises(ValueError, match="api_server_count 2 with --headless: a headless node "
                                         "runs no API server."):
        ParallelArgs(api_server_count=2, headless=True, data_parallel_size=2,
                     data_parallel_size_local=1, data_parallel_start_rank=1).parallel_config()


@pytest.mark.parametrize("layers, stages, expected", [
    (22, 4, [5, 6, 6, 5]), (3, 2, [2, 1]), (30, 2, [15, 15]), (7, 3, [2, 3, 2]),
])
def test_layer_split_gives_the_remainder_to_the_stages_before_the_last(
        layers: int, stages: int, expected: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PAGELLM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION"):
        monkeypatch.delenv(name, raising=False)
    assert layer_partition(layers, stages) == expected
    bounds = [get_pp_indices(layers, rank, stages) for rank in range(stages)]
    assert [stop - start for start, stop in bounds] == expected
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(stages - 1))


@pytest.mark.parametrize("name", ["VLLM_PP_LAYER_PARTITION", "PAGELLM_PP_LAYER_PARTITION"])
def test_layer_partition_from_the_environment(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, "1,3")
    assert get_pp_indices(4, 1, 2) == (1, 4)
    monkeypatch.setenv(name, "1,1,2")
    with pytest.raises(ValueError, match=r"len\(partition\)=3 does not match pp_size=2\."):
        layer_partition(4, 2)
    monkeypatch.setenv(name, "1,2")
    with pytest.raises(ValueError, match=r"sum\(partition\)=3 does not match num_layers=4\."):
        layer_partition(4, 2)
    monkeypatch.setenv(name, "a,b")
    with pytest.raises(ValueError, match="Invalid partition string: a,b"):
        layer_partition(4, 2)


def _cuda_rank(rank: int, tp: int, pp: int, nnodes: int = 1) -> RankInfo:
    return RankInfo(rank, tp, pp, "tcp://127.0.0.1:1", nnodes, "cuda")


@pytest.mark.parametrize("rank, tp, pp, nnodes, slot, device", [
    (0, 2, 1, 1, "0/1", 0), (1, 2, 1, 1, "0/1", 1),  # one engine: its ranks in order
    (3, 2, 2, 1, "0/1", 3),
    (1, 2, 1, 1, "1/2", 3),  # -dp 2 -tp 2: engine 1's rank 1 after engine 0's two GPUs
    (3, 2, 2, 2, "0/1", 1),  # --nnodes 2: global rank 3 is node 1's second rank
])
def test_cuda_ranks_take_their_nodes_gpus_in_order(rank: int, tp: int, pp: int, nnodes: int,
                                                   slot: str, device: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_SLOT_ENV, slot)
    info = _cuda_rank(rank, tp, pp, nnodes)
    assert info.backend == "nccl"
    assert rank_device(info) == torch.device("cuda", device)
    assert rank_device(RankInfo(rank, tp, pp, "tcp://127.0.0.1:1", nnodes)) == torch.device("cpu")


def test_too_few_gpus_for_a_nodes_ranks_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """-dp 2 -tp 2 on one node needs 4 GPUs; 3 visible stop it before any process starts."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv(ENGINE_SLOT_ENV, "0/2")
    with pytest.raises(ValueError) as error:
        check_gpus(_cuda_rank(0, 2, 1))
    assert str(error.value) == (
        "tensor parallel size 2 x pipeline parallel size 1 puts 2 CUDA ranks on this node for "
        "each of its 2 data parallel engines, one GPU each: 4 GPUs are needed and 3 are visible "
        "(CUDA_VISIBLE_DEVICES=0,1,2); lower the parallel sizes or add GPUs.")
    monkeypatch.setenv(ENGINE_SLOT_ENV, "0/1")
    check_gpus(_cuda_rank(0, 2, 1))  # one engine's 2 ranks fit
