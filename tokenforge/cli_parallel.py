"""The CLI's parallelism flags, with the playbook's spellings as aliases.

    --tensor-parallel-size N   (-tp, --model_parallelism, --model_parallelism_level, --shard-size)
    --pipeline-parallel-size N (-pp, --pipe_parallelism, --pipe_parallelism_level)
    --pipeline-steps N         (--pipeline_steps): steps in flight across the stages (default: PP)
    --num-gpus N               (--num_devices, --num_processes): N ranks, split as
                               --model-sharding-type says: parallel (TP = N, the default) or pipe
                               (PP = N); `load` means lazy loading (--load-format lazy)
    --distributed-executor-backend auto|uni|mp|torchrun  (--distributed_executor)
"""

from __future__ import annotations

import argparse

PARALLEL_NOTES = """  --model-sharding-type parallel|pipe|load  parallel: --num-gpus ranks of tensor parallelism;
                                pipe: of pipeline parallelism; load: = --load-format lazy
  --num-gpus / --num_devices / --num_processes N  ranks in all (see --model-sharding-type)
  --shard-size / --model_parallelism(_level) N    = --tensor-parallel-size N
  --pipe_parallelism(_level) N  = --pipeline-parallel-size N
  --distributed_executor        = --distributed-executor-backend
  --lazy-loading                = --load-format lazy (also --model-sharding-type load)
  --dynamic_sharding / --sharding_strategy auto  = --parallel auto (doctor's TP x PP proposal)
  --sharding_strategy tensor|pipeline  = --model-sharding-type parallel|pipe
  --engine_cache_dir DIR / --use_cache  = --engine-cache-dir DIR (default folder with --use_cache)
"""


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", "--model_parallelism", "--model_parallelism_level",
                   "--model-parallelism", "--shard-size", dest="tensor_parallel_size", type=int, default=None,
                   help="split every layer across N ranks (GPUs, or CPU processes with gloo)")
    g.add_argument("--pipeline-parallel-size", "-pp", "--pipe_parallelism", "--pipe_parallelism_level",
                   "--pipe-parallelism", dest="pipeline_parallel_size", type=int, default=None,
                   help="split the layers into N contiguous stages, one rank (or TP group) each")
    g.add_argument("--num-gpus", "--num_gpus", "--num-gpu", "--num_devices", "--num_processes", dest="num_gpus",
                   type=int, default=None, help="ranks in all; split as --model-sharding-type says")
    g.add_argument("--model-sharding-type", "--model_sharding_type", choices=["parallel", "pipe", "load"],
                   default=None, help="playbook: parallel = TP, pipe = PP over --num-gpus; load = lazy loading")
    g.add_argument("--pipeline-steps", "--pipeline_steps", dest="pipeline_steps", type=int, default=None,
                   metavar="N", help="with pipeline parallelism: steps (batches of distinct requests) in flight at "
                                     "once, so every stage has work (default: the pipeline parallel size)")
    g.add_argument("--parallel", choices=["auto", "manual"], default="manual",
                   help="auto: TP x PP from `tokenforge doctor --gpus` for the visible GPUs (playbook: "
                        "--dynamic_sharding, --sharding_strategy auto)")
    g.add_argument("--dynamic_sharding", "--dynamic-sharding", dest="parallel", action="store_const", const="auto",
                   help=argparse.SUPPRESS)
    g.add_argument("--sharding_strategy", "--sharding-strategy", dest="sharding_strategy",
                   choices=["auto", "tensor", "pipeline"], default=None,
                   help="playbook: auto = --parallel auto; tensor / pipeline = how --num-gpus is split")
    g.add_argument("--distributed-executor-backend", "--distributed_executor", "--distributed-executor",
                   dest="distributed_executor_backend", choices=["auto", "uni", "mp", "torchrun"], default="auto",
                   help="mp: one worker process per rank on this host (default with TP/PP); torchrun: ranks "
                        "started by torchrun (auto-detected from WORLD_SIZE)")


def add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine cache")
    g.add_argument("--engine-cache-dir", "--engine_cache_dir", dest="engine_cache_dir", default=None,
                   help="keep the Triton and compile caches here, so a restart skips the JIT")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="N",
                   help="CUDA: keep N GB of weights (the last layers) in pinned host memory, each copied in one "
                        "layer ahead on a side stream (runs without CUDA graphs)")
    g.add_argument("--use-cache", "--use_cache", dest="use_cache", action="store_true",
                   help="the engine cache in its default folder (~/.cache/tokenforge/engine)")


def cache_kwargs(args: argparse.Namespace) -> dict:
    """The engine cache folder and CPU offload (LoadConfig)."""
    folder = args.engine_cache_dir
    if folder is None and args.use_cache:
        import os  # noqa: PLC0415

        folder = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenforge", "engine")
    return {"engine_cache_dir": folder, "cpu_offload_gb": args.cpu_offload_gb}


def parallel_kwargs(args: argparse.Namespace) -> dict:
    if args.model_sharding_type == "load":
        args.load_format = "lazy"
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    sharding, n = args.model_sharding_type, args.num_gpus
    if args.sharding_strategy in ("tensor", "pipeline") and sharding is None:
        sharding = "parallel" if args.sharding_strategy == "tensor" else "pipe"
    if n is not None:
        if sharding == "pipe":
            if pp is not None and pp != n:
                raise ValueError(f"--num-gpus {n} with --model-sharding-type pipe conflicts with "
                                 f"--pipeline-parallel-size {pp}")
            pp = n
        elif tp is None and pp is None:
            tp = n
        elif (tp or 1) * (pp or 1) != n:
            raise ValueError(f"--num-gpus {n} does not equal --tensor-parallel-size x --pipeline-parallel-size "
                             f"= {(tp or 1)} x {(pp or 1)}")
    return {"tensor_parallel_size": tp or 1, "pipeline_parallel_size": pp or 1,
            "pipeline_steps": getattr(args, "pipeline_steps", None),
            "distributed_executor_backend": args.distributed_executor_backend}
