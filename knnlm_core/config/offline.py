"""The offline side's settings: `knnlm-index build` (what it makes, where it runs), and the grid
`knnlm-eval` and calibration sweep."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from knnlm_core.config.base import KeyType, _Strict


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
