"""The vLLM server flags a config makes: the server's own, tensor parallelism and each CPU rank's
cores, datastore drafts, and CUDA graphs that keep the key capture."""

from __future__ import annotations

import json
import logging

from knnlm_core.config import ServeConfig
from knnlm_core.errors import ConfigError

logger = logging.getLogger("knnlm_serve")

V2_ONLY_FLAGS = ("--watermark-config",)  # vLLM options that switch its Model Runner V2 on whatever the environment says


def vllm_server_argv(config: ServeConfig, model_dir: str) -> list[str]:
    argv = ["--model", model_dir, "--host", config.host, "--port", str(config.port), "--max-model-len", str(config.max_model_len)]
    argv += ["--dtype", config.dtype, "--kv-cache-memory-bytes", str(int(config.kv_cache_gib * 2**30))]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if config.served_model_name:
        argv += ["--served-model-name", config.served_model_name]
    if config.tensor_parallel_size > 1:  # one process a rank, never Ray's executor (this process has started Ray for the shards)
        argv += ["--tensor-parallel-size", str(config.tensor_parallel_size), "--distributed-executor-backend", "mp"]
    return argv + list(config.vllm_args)


def cpu_rank_binding(ranks: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each of `ranks` CPU ranks an equal share of `cores`, in
    order ("0|1", "0,1|2,3"): vLLM's own default wants a NUMA node per rank. With fewer cores than
    ranks, ranks share them in turn (it runs, slowly: a model whose heads divide only by more ranks)."""
    if len(cores) < ranks:
        logger.warning("tensor_parallel_size %d on %d CPU core(s): ranks share cores, each step waits on the slowest", ranks, len(cores))
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    share = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * share : (r + 1) * share])) for r in range(ranks))


def draft_flags(config: ServeConfig) -> list[str]:
    """vLLM's speculative config for datastore drafts (knn.draft_tokens); one of the user's own
    (`vllm_args`, e.g. prompt lookup) is kept where drafts are off, and refused beside them."""
    from knnlm_serve.engine.drafts import DRAFTER

    if config.knn.draft_tokens == 0:
        return []
    own = [a for a in config.vllm_args if a.split("=", 1)[0].split(".", 1)[0] in ("--speculative-config", "-sc")]
    if own:
        raise ConfigError(
            f"knn.draft_tokens sets vLLM's speculative config (datastore drafts) and vllm_args sets one too ({own[0]}): keep one of them"
        )
    drafts = {"method": "custom_class", "model": DRAFTER, "num_speculative_tokens": config.knn.draft_tokens}
    return ["--speculative-config", json.dumps(drafts)]


def cuda_graph_flags(config: ServeConfig, cuda: bool) -> list[str]:
    """vLLM's flags for kNN under CUDA graphs: piecewise ones (vllm_adapter.PIECEWISE_CUDA_GRAPHS
    says why). A compilation config of the user's own (`vllm_args`) could bring back full graphs
    and wrong keys without a sign, so it is refused rather than merged."""
    from knnlm_serve.engine.vllm_adapter import PIECEWISE_CUDA_GRAPHS

    if not cuda or config.enforce_eager:
        return []
    own = [a for a in config.vllm_args if a.split("=", 1)[0].split(".", 1)[0] in ("--compilation-config", "-cc")]
    if own:
        raise ConfigError(
            f"vllm_args sets vLLM's compilation config ({own[0]}); on a GPU knnlm-serve sets it itself for kNN "
            f"({json.dumps(PIECEWISE_CUDA_GRAPHS)}: full CUDA graphs would skip the key capture). Remove it from "
            "vllm_args, or set enforce_eager: true"
        )
    return ["--compilation-config", json.dumps(PIECEWISE_CUDA_GRAPHS)]
