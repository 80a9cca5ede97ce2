"""The server's settings: the model and HTTP server (`ServeConfig`) and kNN at serving time (`KnnConfig`)."""

from __future__ import annotations

import secrets
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from knnlm_core.config.base import _Strict, datastore_name_problem


class AdaptiveLambda(_Strict):
    """λ = lambda_max·sigmoid(slope·(center − d₁)), d₁ = the nearest neighbour's squared distance.

    Fitted per datastore by `knnlm-eval` (results.json, "adaptive"): distance scales differ."""

    lambda_max: float = Field(gt=0, le=1)
    slope: float = Field(gt=0)
    center: float


class DatastoreOverride(_Strict):
    """Per-datastore settings that beat its calibration (a request's vllm_xargs still beat these)."""

    lambda_: float | None = Field(None, ge=0, le=1, alias="lambda")
    k: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, gt=0)
    skip_threshold: float | None = Field(None, ge=0, le=1)
    min_pointers: int | None = Field(None, ge=0)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FilesConfig(_Strict):
    """The OpenAI Files and Vector Stores API (docs/vector-stores.md): uploads below
    `knn.datastore_root`, each vector store a datastore there, owned by the key that made it."""

    max_file_bytes: int = Field(8 * 2**20, gt=0, description="largest upload, in bytes (a larger one is a 413)")
    max_bytes_per_key: int = Field(256 * 2**20, gt=0, description="bytes of uploads one key (or, without keys, the server) may hold")
    max_vector_stores_per_key: int = Field(100, gt=0, description="vector stores one key (or, without keys, the server) may hold")
    store_search: Literal["worker", "backend"] = Field(
        "worker",
        description="where a vector store's datastore is searched: in vLLM's worker process (no process per store, so hundreds "
        "fit), or like every other datastore by knn.backend (with ray: shard actors for each store)",
    )


class KnnConfig(_Strict):
    """kNN-LM at serving time. Requests may override `enabled`, `lambda_`, `k`, `temperature`,
    `skip_threshold` and the datastore per request through `vllm_xargs` (knn, knn_lambda, knn_k,
    knn_temperature, knn_skip_threshold, knn_datastore)."""

    datastores: dict[str, str] = Field(default_factory=dict, description="name -> datastore directory")
    default_datastore: str | None = Field(None, description="used when a request names none; default: the first")
    enabled: bool = Field(True, description="kNN for requests that do not say knn=true/false")
    lambda_: float = Field(0.25, ge=0, le=1, alias="lambda", description="weight of p_kNN for datastores without a calibration")
    adaptive_lambda: dict[str, AdaptiveLambda] = Field(
        default_factory=dict, description="datastore -> adaptive λ, used when a request sets no knn_lambda (beats calibration)"
    )
    overrides: dict[str, DatastoreOverride] = Field(
        default_factory=dict, description="datastore -> {lambda, k, temperature, skip_threshold, min_pointers} that beat its calibration"
    )
    k: int = Field(1024, gt=0, description="neighbours per query for datastores without a calibration")
    max_k: int = Field(2048, gt=0, description="largest k a request may ask for")
    temperature: float = Field(1.0, gt=0, description="softmax temperature over negative L2 distances, without a calibration")
    skip_threshold: float = Field(
        1.0,
        ge=0,
        le=1,
        description="skip the search (serve p_LM) for rows whose LM top probability exceeds this, without a calibration; 1 = never",
    )
    min_pointers: int = Field(
        0,
        ge=0,
        description="decode steps score the last step's neighbours' successors instead of searching when this many survive, "
        "without a calibration; 0 = off",
    )
    nprobe: int | None = Field(None, gt=0, description="IVF lists searched; default: the datastore's calibrated nprobe, else its build's")
    backend: Literal["ray", "local"] = Field(
        "ray",
        description="ray: one actor per shard; local: in the vLLM worker, on a thread off its bound cores "
        "(the cheapest step at one stream on one host; no replicas or other nodes, and a hang holds its thread)",
    )
    ray_address: str | None = Field(None, description="join this Ray cluster; default: RAY_ADDRESS (a Ray job's), else a new local one")
    ray_namespace: str = Field(
        default_factory=lambda: f"knnlm-{secrets.token_hex(4)}",
        min_length=1,
        description="namespace of this server's shard actors; default: one of its own, so servers that share a Ray cluster never share actors",
    )
    follow_changes_s: float | None = Field(
        None,
        gt=0,
        description="check each serving datastore's directory this often and serve a new version found there "
        "(another server's add, forget or compact, or knnlm-index run on it); default: off",
    )
    shard_timeout_s: float = Field(10.0, gt=0, description="a step waits this long for a shard (or the local search) before leaving it out")
    on_shard_failure: Literal["partial", "lm_only"] = Field(
        "partial", description="a dead or late shard: partial = merge the shards that answered; lm_only = skip kNN for the step"
    )
    datastore_root: str | None = Field(None, description="admin API: datastores may be loaded only from below this directory")
    admin_token: str | None = Field(None, description="admin API token (or env KNNLM_ADMIN_TOKEN); unset = admin API disabled")
    keys_file: str | None = Field(
        None,
        description="tenants: YAML file of API keys, each with the datastores it may use and its rights there "
        "(knnlm_core/keys_file.py, docs/serving.md#tenants); re-read when it changes. Unset: every client reaches "
        "every datastore (behind vLLM's --api-key, if given)",
    )
    files: FilesConfig = Field(
        default_factory=FilesConfig,
        description="the OpenAI Files and Vector Stores API, served where datastore_root is set (docs/vector-stores.md)",
    )
    ui: bool = Field(False, description="serve the kNN page at /knn/ui/ (docs/serving.md#the-knn-page); off: that path is a 404")
    audit_log: str | None = Field(
        None, description="tenants: append one JSON line per request that read or was refused a datastore to this file"
    )
    gpu: bool | None = Field(None, description="shards on the GPU (flat: torch; IVF: faiss-gpu); default: where faiss-gpu and Ray see one")
    gpu_fraction: float = Field(0.1, gt=0, le=1, description="share of a GPU each Ray shard actor reserves")
    shard_threads: int | None = Field(None, gt=0, description="FAISS threads per shard actor; default: the node's cores")
    mmap: bool = Field(
        True, description="shard indexes are memory-mapped read-only, not read: fast loads, pages shared by actors on one node"
    )
    compiled_graphs: bool | Literal["auto"] = Field(
        False,
        description="reach shard actors through Ray Compiled Graphs (shared-memory channels: a cheaper round trip than "
        "plain actor calls), but every graph's reader polls a core while it exists, and Ray keeps each torn-down graph's "
        "shared memory until it shuts down (a graph is rebuilt after idling, for each new version and each restarted "
        "actor); auto: where each of a datastore version's shard actors has a core to itself (on its node, no more "
        "actors than CPUs outside the engine's: its bound cores, or one where it binds none); default: plain calls",
    )
    graph_idle_s: float = Field(
        10.0,
        gt=0,
        description="compiled graphs: a version's graphs are torn down after this long without a search (their readers "
        "stop polling) and rebuilt at the next one, which plain calls serve meanwhile",
    )
    overlap: bool = Field(
        True,
        description="start a step's searches mid-forward, at the last layer's FFN input, so the shards search while the "
        "last MLP, the final norm and the LM head run, even those of rows the skip rule then drops. The skip rule needs "
        "the logits, so it is predicted from each request's last step: where the LM was confident on every request "
        "then, the step searches only the rows the rule keeps, after the logits (false: always so)",
    )
    draft_tokens: int = Field(
        0,
        ge=0,
        le=16,
        description="speculative decoding with datastore drafts: after each step, a request whose nearest neighbour "
        "predicted its newest token is given up to this many of the stored tokens that follow, or, where longer, what "
        "followed its newest tokens earlier in its own text (prompt lookup), which vLLM verifies "
        "against the kNN-LM in the next step (the same output, faster where the text is stored); 0 = off. Sets "
        "vLLM's speculative config, so vllm_args may not set one too",
    )
    model_runner: Literal["auto", "v1", "v2"] = Field(
        "auto",
        description="vLLM's model runner kNN serves on. auto: vLLM's own choice, which is Model Runner V2 where Triton "
        "has a backend for the device (every CUDA host) and V1 elsewhere, and V1 with datastore drafts (V2 loads no "
        "custom drafter); v1, v2: that runner, or a clear refusal at startup where it cannot serve",
    )
    replicas: int = Field(1, ge=1, description="actors per shard; a step asks one, another when it fails or is late (spread over nodes)")
    shard_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each shard actor requires, e.g. {knn_shards: 0.01}: places the shards on the "
        "nodes that offer them (`ray start --resources`), which may be other nodes than the engine's",
    )

    fail_open: bool = Field(
        True,
        description="an unexpected error in kNN's per-step path serves the affected rows from the LM alone, is logged and "
        'counted (knnlm_fallbacks_total{reason="error"}), and a datastore version that keeps failing is marked unhealthy; '
        "false: the error propagates and stops the engine (the test suite's setting, so that bugs are loud)",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _consistent(self) -> KnnConfig:
        for name in self.datastores:
            if problem := datastore_name_problem(name):
                raise ValueError(problem)
        if self.k > self.max_k:
            raise ValueError(f"k ({self.k}) exceeds max_k ({self.max_k})")
        if self.min_pointers > self.max_k:
            raise ValueError(f"min_pointers ({self.min_pointers}) exceeds max_k ({self.max_k})")
        for name, override in self.overrides.items():
            for field in ("k", "min_pointers"):
                if (getattr(override, field) or 0) > self.max_k:
                    raise ValueError(f"overrides.{name}.{field} ({getattr(override, field)}) exceeds max_k ({self.max_k})")
        if self.audit_log is not None and self.keys_file is None:
            raise ValueError("audit_log records the tenants' requests: set keys_file too, or remove audit_log")
        if self.default_datastore is not None and self.default_datastore not in self.datastores:
            raise ValueError(f"default_datastore {self.default_datastore!r} is not one of datastores {sorted(self.datastores)}")
        return self

    @property
    def default_name(self) -> str | None:
        return self.default_datastore or next(iter(self.datastores), None)

    def worker_settings(self) -> KnnConfig:
        """What vLLM's workers get: these settings without the startup datastore list (the runtime
        tracks the serving set) and without what only the API server uses (the admin token, the
        datastore root): secrets stay in the server process."""
        return self.model_copy(update={"datastores": {}, "default_datastore": None, "admin_token": None, "datastore_root": None})


class ServeConfig(_Strict):
    """`knnlm-serve --config FILE`: the model, the HTTP server, and what vLLM gets."""

    model: str = Field("default", description='"default" (embedded SmolLM2) or an HF causal-LM directory')
    served_model_name: str | None = Field(None, description="model name clients send; default: the directory name")
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    max_model_len: int = Field(2048, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="vLLM's compute dtype; the datastore's keys must have been built in the same"
    )
    kv_cache_gib: float = Field(2.0, gt=0, description="memory reserved for the KV cache (CPU RAM or GPU memory)")
    enforce_eager: bool = Field(False, description="skip torch.compile: faster start, slower decode")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vLLM's tensor parallelism: the model split across this many ranks (GPUs; on a CPU, groups of cores, "
        "one process each); kNN searches on rank 0 and every rank mixes its answer",
    )
    vllm_args: list[str] = Field(default_factory=list, description="extra vLLM server flags, passed through verbatim")
    knn: KnnConfig = Field(default_factory=KnnConfig)

    @model_validator(mode="after")
    def _one_tensor_parallel_setting(self) -> ServeConfig:
        own = [a for a in self.vllm_args if a.split("=", 1)[0] in ("--tensor-parallel-size", "-tp")]
        if own:
            raise ValueError(f"vllm_args sets {own[0]}: set tensor_parallel_size instead (it also binds each CPU rank its cores)")
        return self
