"""How an engine spreads over processes: vLLM's parallel flags, their defaults and checks.

`ParallelArgs` holds the flags as `EngineArgs` fields (so `LLM(tensor_parallel_size=2)` works
as in vLLM); `ParallelConfig` is what the engine runs with, validated once at start. A
combination that is not built here yet is refused with one clear line, never ignored.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from pagellm.logger import init_logger

logger = init_logger(__name__)

EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
PP_PARTITION_ENV_VARS = ("PAGELLM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")
THREADS_BIND_ENV_VARS = ("PAGELLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND")
DEFAULT_DP_ADDRESS = "127.0.0.1"
DEFAULT_DP_RPC_PORT = 29550
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501

# field name -> (short flag or None, help)
_FLAGS: dict[str, tuple[str | None, str]] = {
    "tensor_parallel_size": ("-tp", "shard every layer over this many processes (Megatron-style)"),
    "pipeline_parallel_size": ("-pp", "split the layers into this many stages"),
    "data_parallel_size": ("-dp", "independent engine replicas behind one API server"),
    "data_parallel_size_local": ("-dpl", "data parallel ranks on this node (default: all "
                                         "from -dpr on; 0 on the head: API server only; "
                                         "-dpb ray: the first ones, on the head's Ray node)"),
    "data_parallel_start_rank": ("-dpr", "first data parallel rank of this node (a "
                                         "--headless one)"),
    "data_parallel_rank": ("-dpn", "this process is exactly this data parallel rank "
                                   "(external load balancing)"),
    "data_parallel_address": ("-dpa", "address of the data parallel head node, where it "
                                      "waits for the other nodes' engines"),
    "data_parallel_rpc_port": ("-dpp", "port of the data parallel head node, where it waits "
                                       "for the other nodes' engines"),
    "data_parallel_backend": ("-dpb", "mp or ray: how data parallel ranks are started"),
    "headless": (None, "run engines only, no API server (secondary nodes, with --nnodes or "
                       "-dp)"),
    "api_server_count": (None, "API server processes (HTTP, tokenization, detokenization) "
                               "sharing the port and the engine cores"),
    "distributed_executor_backend": (None, "mp, ray or uni (default: uni for one process, "
                                           "else mp)"),
    "nnodes": (None, "nodes of a multi-node run without Ray"),
    "node_rank": (None, "this node's rank in a multi-node run without Ray (default 0; a "
                        "--headless node without it is given the next free rank by the "
                        "head, in the order nodes join)"),
    "master_addr": (None, "head node address of a multi-node run without Ray"),
    "master_port": (None, "head node port of a multi-node run without Ray"),
}


@dataclass
class ParallelArgs:
    """The parallel flags, with vLLM's names and defaults."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_rank: int | None = None
    data_parallel_address: str = DEFAULT_DP_ADDRESS
    data_parallel_rpc_port: int = DEFAULT_DP_RPC_PORT
    data_parallel_backend: str = "mp"
    headless: bool = False
    api_server_count: int = 1
    distributed_executor_backend: str | None = None
    nnodes: int = 1
    node_rank: int | None = None  # 0, or on a --headless node: the head assigns it
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT

    def parallel_config(self) -> "ParallelConfig":
        return ParallelConfig.from_args(self)


PARALLEL_FIELDS = tuple(f.name for f in fields(ParallelArgs))


def add_parallel_cli_args(parser: argparse.ArgumentParser) -> None:
    """`--tensor-parallel-size/-tp` and the rest, with vLLM's spellings."""
    group = parser.add_argument_group("parallelism")
    for field in fields(ParallelArgs):
        short, help_text = _FLAGS[field.name]
        names = ["--" + field.name.replace("_", "-")] + ([short] if short else [])
        if field.type == "bool":
            group.add_argument(*names, action="store_true", help=help_text)
            continue
        kind = int if field.type.startswith("int") else str
        choices = {"data_parallel_backend": DATA_PARALLEL_BACKENDS,
                   "distributed_executor_backend": EXECUTOR_BACKENDS}.get(field.name)
        group.add_argument(*names, type=_at_least_zero if kind is int else str, choices=choices,
                           default=field.default, help=help_text)


def _at_least_zero(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


@dataclass(frozen=True)
class DataParallelConfig:
    """Where the data parallel ranks run. The head (the API server) hosts ranks
    0..`size_local`-1 and waits at `address`:`rpc_port` for the rest, which `--headless`
    nodes host from their `start_rank` on; `rank` set: this process is exactly that rank,
    behind an outside load balancer."""

    size: int = 1
    size_local: int = 1
    start_rank: int = 0
    rank: int | None = None
    address: str = DEFAULT_DP_ADDRESS
    rpc_port: int = DEFAULT_DP_RPC_PORT
    headless: bool = False
    backend: str = "mp"  # ray: every rank is a Ray actor that joins the head (size_local 0)
    ray_head_ranks: int | None = None  # -dpb ray -dpl L: ranks 0..L-1 on the head's Ray node

    @property
    def local_ranks(self) -> range:
        """The ranks this process starts (one, under an outside load balancer)."""
        if self.rank is not None:
            return range(self.rank, self.rank + 1)
        return range(self.start_rank, self.start_rank + self.size_local)

    @property
    def served_ranks(self) -> range:
        """The ranks behind this process's API server: all of them, or the one of an outside
        load balancer."""
        return self.local_ranks if self.rank is not None else range(self.size)

    @property
    def remote_ranks(self) -> range:
        """The ranks the head waits for: those its own command does not start."""
        return range(0) if self.headless or self.rank is not None else range(
            self.size_local, self.size)

    @classmethod
    def from_args(cls, args: ParallelArgs) -> "DataParallelConfig":
        size, start = args.data_parallel_size, args.data_parallel_start_rank
        local = size - start if args.data_parallel_size_local is None else \
            args.data_parallel_size_local
        if args.data_parallel_backend == "ray" and size > 1:
            _check_ray_layout(args)
            return cls(size, 0, 0, None, args.data_parallel_address, 0, False, "ray",
                       args.data_parallel_size_local)
        if args.data_parallel_rank is not None:
            _check_external_rank(args)
        elif start + local > size:
            raise ValueError(f"data parallel ranks {start}-{start + local - 1} (-dpr {start} "
                             f"-dpl {local}) go beyond data_parallel_size {size}.")
        elif start and not args.headless:
            raise ValueError(f"data_parallel_start_rank {start} runs engines only: add "
                             "--headless (the head, with the API server, starts at rank 0).")
        elif args.headless and size > 1 and local == 0:
            raise ValueError("a --headless node with data_parallel_size_local 0 runs nothing.")
        return cls(size, local, start, args.data_parallel_rank, args.data_parallel_address,
                   args.data_parallel_rpc_port, args.headless and size > 1)


def _check_ray_layout(args: ParallelArgs) -> None:
    """-dpb ray: Ray places every engine, from the head's one command, so the flags of the
    other nodes' commands do not apply; -dpl only says how many stay on the head's node."""
    by_hand = {"-dpr": args.data_parallel_start_rank > 0,
               "-dpn": args.data_parallel_rank is not None, "--headless": args.headless}
    given = [flag for flag, set_ in by_hand.items() if set_]
    if given:
        raise ValueError(f"data_parallel_backend 'ray' places every engine on the Ray "
                         f"cluster's nodes itself: leave out {', '.join(given)}.")
    local, size = args.data_parallel_size_local, args.data_parallel_size
    if local is not None and local > size:
        raise ValueError(f"data_parallel_size_local {local} (-dpl, the ranks Ray keeps on the "
                         f"head node) is above data_parallel_size {size}.")


def _check_external_rank(args: ParallelArgs) -> None:
    """-dpn R: one rank per process, each its own endpoint."""
    if args.data_parallel_rank >= args.data_parallel_size:
        raise ValueError(f"data_parallel_rank {args.data_parallel_rank} must be below "
                         f"data_parallel_size {args.data_parallel_size}.")
    if (args.headless or args.data_parallel_size_local is not None
            or args.data_parallel_start_rank):
        raise ValueError("data_parallel_rank runs exactly one rank behind its own API server: "
                         "leave out -dpl, -dpr and --headless.")


@dataclass
class ParallelConfig:
    """What the engine runs with: world = tensor x pipeline processes, per data parallel rank;
    with `nnodes` > 1, `world / nnodes` of them on each node, the driver's on node 0. A
    headless node's `node_rank` is None when the head assigns it."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    nnodes: int = 1
    node_rank: int | None = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    data_parallel: DataParallelConfig = DataParallelConfig()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @classmethod
    def from_args(cls, args: ParallelArgs) -> "ParallelConfig":
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "api_server_count", "nnodes"):
            if getattr(args, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(args, name)}.")
        _refuse_unbuilt(args)
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        _check_nodes(args, world)
        data_parallel = DataParallelConfig.from_args(args)
        _check_api_servers(args, data_parallel)
        engines = len(data_parallel.local_ranks) if data_parallel.size > 1 else 1
        if engines:  # every core set this node's engines pin to is there, at start
            bound_cores(0, world // args.nnodes, 0, engines)
        return cls(args.tensor_parallel_size, args.pipeline_parallel_size,
                   _executor_backend(args, world),
                   args.nnodes, _node_rank(args), args.master_addr, args.master_port,
                   data_parallel)

    @property
    def layout(self) -> tuple[int, int, int]:
        """What every node of a run must agree on: tensor, pipeline sizes and node count."""
        return self.tensor_parallel_size, self.pipeline_parallel_size, self.nnodes


def _node_rank(args: ParallelArgs) -> int | None:
    """The node rank given, else 0 for the head and None (assigned on joining) if headless."""
    if args.node_rank is not None:
        return args.node_rank
    return None if args.headless else 0


def _check_nodes(args: ParallelArgs, world: int) -> None:
    """Multi-node without Ray: the world splits evenly over the nodes; node 0 serves."""
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        raise ValueError(f"node_rank {args.node_rank} must be below nnodes {args.nnodes}.")
    if args.nnodes > 1 and world % args.nnodes:
        raise ValueError(f"a world of {world} ranks (tensor x pipeline parallel size) does not "
                         f"split evenly over nnodes {args.nnodes}.")
    if args.nnodes > 1 and args.distributed_executor_backend not in (None, "mp"):
        raise ValueError("--nnodes runs the mp executor; with Ray, start the nodes with "
                         "`ray start` and use --distributed-executor-backend ray instead.")
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless runs a secondary node's ranks (--node-rank 1 and up, or "
                         "no --node-rank: the head assigns one); node 0 runs the API server.")
    if args.node_rank and not args.headless:
        raise ValueError(f"node_rank {args.node_rank} runs only engine ranks: add --headless.")


def _check_api_servers(args: ParallelArgs, data_parallel: DataParallelConfig) -> None:
    """Several API server processes reach the engine cores of their own node only."""
    count = args.api_server_count
    if count > 1 and args.headless:
        raise ValueError(f"api_server_count {count} with --headless: a headless node runs no "
                         "API server.")
    if count > 1 and data_parallel.backend == "ray":
        raise ValueError(f"api_server_count {count} with data_parallel_backend 'ray' is not "
                         "supported by pagellm yet; use -dpb mp, or one API server.")
    if count > 1 and data_parallel.remote_ranks:
        raise ValueError(f"api_server_count {count} with data parallel ranks on other nodes "
                         "(-dpl below -dp) is not supported by pagellm yet; run the engines "
                         "on the head node, or one API server.")


def _executor_backend(args: ParallelArgs, world_size: int) -> str:
    """vLLM's automatic choice: uni for one process, ray for the ranks of engines that Ray
    places (-dpb ray), else mp."""
    requested = args.distributed_executor_backend
    if requested is None:
        if world_size == 1:
            return "uni"
        if args.data_parallel_size > 1 and args.data_parallel_backend == "ray":
            logger.info("Using ray distributed inference because data_parallel_backend is ray")
            return "ray"
        logger.info("Defaulting to use mp for distributed inference")
        return "mp"
    if requested == "uni" and world_size > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one process; a world size "
                         f"of {world_size} needs 'mp'.")
    return requested


def _refuse_unbuilt(args: ParallelArgs) -> None:
    """Flags whose feature is not built here yet: a clear error at start."""
    ray_data_parallel = args.data_parallel_size > 1 and args.data_parallel_backend == "ray"
    unbuilt = {
        "distributed_executor_backend 'external_launcher'":
            args.distributed_executor_backend == "external_launcher",
        "data parallelism combined with distributed_executor_backend 'ray' (use "
        "data_parallel_backend 'ray')": args.data_parallel_size > 1
            and args.distributed_executor_backend == "ray" and not ray_data_parallel,
        "VLLM_CPU_OMP_THREADS_BIND with data_parallel_backend 'ray' (each node's engines "
        "split its cores)": ray_data_parallel and _threads_bound(),
        "--headless without --nnodes or data_parallel_size": args.headless and args.nnodes == 1
            and args.data_parallel_size == 1,
        "data parallelism combined with --nnodes (run data parallel nodes with -dpl, -dpr "
        "and -dpa)": args.nnodes > 1 and args.data_parallel_size > 1,
    }
    refused = [name for name, asked in unbuilt.items() if asked]
    if refused:
        raise ValueError(f"{refused[0]} is not supported by pagellm yet; tensor and pipeline "
                         "parallelism run with the mp or ray executor, data parallelism as "
                         "engine cores of one process or Ray actor each.")


def _threads_bound() -> bool:
    return any(os.environ.get(name, "auto") not in ("", "auto", "all")
               for name in THREADS_BIND_ENV_VARS)


def bound_cores(rank: int, ranks: int, engine: int = 0, engines: int = 1) -> list[int] | None:
    """The cores VLLM_CPU_OMP_THREADS_BIND gives rank `rank` of the `ranks` a node holds of
    engine `engine` (of the `engines` data parallel engines this node runs), or None if it
    is not set. It lists `engines` x `ranks` core sets separated by '|', engine 0's ranks
    first, then engine 1's: vLLM's CPU worker takes the sets of local data parallel rank i
    at i x world size. A wrong count is a ValueError of one line."""
    for name in THREADS_BIND_ENV_VARS:
        text = os.environ.get(name)
        if not text or text in ("auto", "all"):
            continue
        sets = text.split("|")
        if len(sets) != engines * ranks:
            layout = (f"{engines} data parallel engines x {ranks} ranks" if engines > 1
                      else f"{ranks} ranks")
            raise ValueError(f"{name}={text} lists {len(sets)} core sets for {layout}; "
                             "separate one set per rank with '|'"
                             + (", engine 0's ranks first." if engines > 1 else "."))
        return _parse_cores(sets[engine * ranks + rank])
    return None


def _parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers of stage `pp_rank`: vLLM's split, from the environment's
    partition if set, else `num_layers // pp_size` each with the remainder given one by one
    to the stages before the last (which also holds the norm and the output head)."""
    partition = layer_partition(num_layers, pp_size)
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]


def layer_partition(num_layers: int, pp_size: int) -> list[int]:
    for name in PP_PARTITION_ENV_VARS:
        text = os.environ.get(name)
        if text:
            return _parse_partition(text, num_layers, pp_size, name)
    partition = [num_layers // pp_size] * pp_size
    for index in range(2, num_layers % pp_size + 2):
        partition[-index] += 1
    if num_layers % pp_size:
        logger.info("Hidden layers were unevenly partitioned: [%s]. This can be manually "
                    "overridden using the VLLM_PP_LAYER_PARTITION environment variable",
                    ",".join(map(str, partition)))
    return partition


def _parse_partition(text: str, num_layers: int, pp_size: int, name: str) -> list[int]:
    try:
        partition = [int(layer) for layer in text.split(",")]
    except ValueError as error:
        raise ValueError(f"Invalid partition string: {text}") from error
    if len(partition) != pp_size:
        raise ValueError(f"{len(partition)=} does not match {pp_size=}.")
    if sum(partition) != num_layers:
        raise ValueError(f"{sum(partition)=} does not match {num_layers=}.")
    if min(partition) < 1:
        raise ValueError(f"{name}={text}: every stage needs at least one layer.")
    return partition
