"""All of knnlm-serve's settings: one pydantic model per section, loaded from `configs/*.yaml`
(knnlm_core/config_file.py).

Every knob a user can turn lives here, with its default and its meaning; the CLIs only map
their flags onto these models. A process gets its settings by one route: the launcher passes
`ServeConfig` explicitly, and vLLM's worker processes get the serving runtime (built from
`KnnConfig`) through vLLM's own worker RPC (knnlm_serve.engine.worker_extension).
"""

from __future__ import annotations

import re
import secrets
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KeyType = Literal["final", "ffn_input"]
DATASTORE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a whole name: it appears in routes, actor names and metric labels


def datastore_name_problem(name: str) -> str | None:
    """Why `name` cannot name a datastore, or None."""
    if isinstance(name, str) and DATASTORE_NAME.fullmatch(name):
        return None
    return f"datastore name {name!r} is invalid: use 1-64 letters, digits, '-' and '_' (no dots, spaces or other characters)"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class BuildConfig(_Strict):
    """How `knnlm-index build` turns a corpus into a datastore."""

    key_type: KeyType = Field("ffn_input", description="final: input of the LM head; ffn_input: input of the last layer's MLP")
    context_length: int = Field(512, gt=1, description="tokens per encoded window")
    stride: int = Field(256, gt=0, description="new tokens per window; the rest is left context")
    batch_size: int = Field(8, gt=0, description="windows per forward pass")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the forward pass (match the server)")
    index: str = Field("auto", description="flat | ivfpq | hnsw | auto | any FAISS factory string")
    pca_dim: int | None = Field(None, gt=0, description="reduce keys to this dimension with PCA first")
    shards: int = Field(1, gt=0)
    train_sample: int = Field(262_144, gt=0, description="keys sampled to train the quantizers")
    keep_keys: bool = Field(False, description="store fp16 keys beside each shard for exact re-scoring")
    calibrate: bool = Field(True, description="hold out a slice of the corpus and fit the served λ, τ, k on it")
    skip_tolerance: float = Field(
        0.005, ge=0, description="calibration: share of perplexity the skip and pointer rules may cost on the fitting half"
    )
    k_tolerance: float = Field(
        0.0025, ge=0, description="calibration: share of perplexity a smaller (cheaper) k may cost against the best k on the fitting half"
    )
    ceiling_tolerance: float = Field(
        0.0,
        ge=0,
        description="calibration: the adaptive-λ curve that trusts a near-verbatim match most (the highest λ at distance 0) among those "
        "within this share of the best curve's perplexity on the fitting half; 0: the best curve",
    )
    nprobe_tolerance: float = Field(
        0.0025,
        ge=0,
        description="calibration, IVF indexes: share of perplexity probing fewer (cheaper) lists may cost against the build's nprobe "
        "on the fitting half",
    )
    text_field: str = Field("text", description="field holding the text in .jsonl inputs")
    on_bad_utf8: Literal["skip", "error"] = Field("skip", description="files that are not UTF-8: skip with a warning, or fail")
    seed: int = 0

    @model_validator(mode="after")
    def _stride_leaves_context(self) -> BuildConfig:
        if self.stride >= self.context_length:
            raise ValueError(f"stride ({self.stride}) must be below context_length ({self.context_length})")
        return self


class BuildCluster(_Strict):
    """Where `knnlm-index build` encodes and adds, and whether its keys stream; none of it changes
    the datastore it makes."""

    ray_address: str | None = Field(None, description="a running Ray cluster's HOST:PORT, or auto; None: this process")
    workers: int | None = Field(None, gt=0, description="encode workers (default: one per GPU, else one per --worker-cpus CPUs)")
    worker_cpus: float = Field(1.0, gt=0, description="CPUs of each encode worker (its torch threads on a CPU)")
    worker_gpus: float | None = Field(None, ge=0, description="GPUs of each encode worker (default: 1 where the cluster has GPUs)")
    stream: bool | None = Field(
        None,
        description="never write the whole corpus's keys: train on a sample, then encode and add shard by shard (default: "
        "when the keys would pass the disk budget)",
    )
    disk_budget_gib: float | None = Field(
        None, gt=0, description="the keys' disk budget that turns streaming on (default: half the free space)"
    )
    part_entries: int = Field(65_536, gt=0, description="entries per encode job: what a killed worker loses")
    node_wait_s: float = Field(
        60.0,
        gt=0,
        description="how long the build waits for a node that can run an encode worker when none is left, before it stops (resumable)",
    )


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
    backend: Literal["ray", "local"] = Field("ray", description="ray: one actor per shard; local: in-process")
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
    shard_timeout_s: float = Field(10.0, gt=0, description="a step waits this long for a shard before leaving it out")
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
    compiled_graphs: bool | None = Field(
        None,
        description="reach shard actors through Ray Compiled Graphs (shared-memory channels: a cheaper round trip than "
        "plain actor calls), but every graph's reader polls a core while it exists; "
        "default: where each of a datastore version's shard actors has a core to itself (on its node, no more "
        "actors than CPUs outside the engine's: its bound cores, or one where it binds none)",
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
        "last MLP, the final norm and the LM head run; rows the skip rule then drops are searched too (false: search "
        "only the rows the skip rule keeps, after the logits)",
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
    vllm_args: list[str] = Field(default_factory=list, description="extra vLLM server flags, passed through verbatim")
    knn: KnnConfig = Field(default_factory=KnnConfig)


class SweepGrid(_Strict):
    """The (λ, τ, k) grid searched by `knnlm-eval` and by calibration."""

    lambdas: tuple[Annotated[float, Field(ge=0, le=1)], ...] = tuple(round(0.05 * i, 2) for i in range(21))
    temperatures: tuple[Annotated[float, Field(gt=0)], ...] = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    ks: tuple[Annotated[int, Field(ge=1)], ...] = (16, 32, 64, 128, 256, 512, 1024)
    k_tolerance: float = Field(0.0025, ge=0, description="calibration: the smallest k within this share of the best k's perplexity")
    skip_tolerance: float = Field(
        0.005, ge=0, description="adaptive retrieval: skip searches while tuning perplexity stays within this share of full retrieval"
    )
    ceiling_tolerance: float = Field(0.0, ge=0, description=BuildConfig.model_fields["ceiling_tolerance"].description)


class EvalConfig(SweepGrid):
    """What `knnlm-eval` sweeps and how it windows the text."""

    context_length: int = Field(512, gt=1)
    stride: int = Field(256, gt=0, description="scored (new) tokens per window")
    nprobes: tuple[Annotated[int, Field(ge=1)], ...] = ()  # IVF datastores: also search at these nprobe (default: the manifest's)
    exact: bool = False  # also search exactly (flat L2 over the kept keys; needs --keep-keys)
    fractions: tuple[Annotated[float, Field(gt=0, le=1)], ...] = ()  # also search random fractions of the first datastore (1: the whole)
    tune_fraction: float = Field(0.2, gt=0, lt=1, description="the first this share of scored tokens tunes; the rest is reported")
    seed: int = 0
    batch_size: int = Field(8, gt=0)
    kv_cache_gib: float = Field(1.0, gt=0)
    text_field: str = "text"
    progress: bool = True

    @model_validator(mode="after")
    def _stride_below_context(self) -> EvalConfig:
        if self.stride >= self.context_length:
            raise ValueError(f"stride ({self.stride}) must be below context_length ({self.context_length})")
        return self
