"""The datastore manifest's records: what `manifest.json` holds (datastore.py reads and writes it).

Values are never NaN or infinite: JSON's NaN and Infinity are refused wherever they appear.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from knnlm_core.config import AdaptiveLambda, KeyType

FORMAT = "knnlm-datastore"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
QUANTIZER = "quantizer.faiss"  # the trained index with no entries, which every shard is a copy of


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON's NaN and Infinity are never a setting


class FileEntry(_Record):
    path: str  # relative to the datastore directory
    bytes: int
    sha256: str


class ShardEntry(_Record):
    name: str
    entries: int
    index: FileEntry
    values: FileEntry
    keys: FileEntry | None = None
    removed: int = 0  # entries an erasing forget took out of an IVF index's lists: its ids span entries, it holds fewer


class ModelIdentity(_Record):
    name: str
    fingerprint: str
    hidden_size: int
    vocab_size: int
    dtype: str


class IndexSpec(_Record):
    factory: str  # the FAISS index_factory string, e.g. "IVF1024,PQ64"
    metric: Literal["l2"] = "l2"
    nprobe: int | None = None  # default search breadth for IVF indexes
    train_size: int = 0  # keys the quantizers were trained on (0: no training needed)


class CorpusStats(_Record):
    sources: list[str]
    documents: int
    tokens: int
    skipped_files: list[str] = []


class BuildStats(_Record):
    context_length: int
    stride: int
    seconds: float
    encode_tokens_per_s: float
    calibration_seconds: float = 0.0
    created: str
    tool_version: str


class SkipRule(_Record):
    """Adaptive retrieval: rows where the LM's top probability exceeds `threshold` skip the search
    and are served p_LM. Fitted to cost at most `tolerance` of perplexity on the fitting half."""

    threshold: float = Field(ge=0, le=1)  # 1: never skip
    skipped: float  # share of the judged half's tokens skipped,
    ppl: float  # its perplexity with the skips,
    full_ppl: float  # and with every row searched
    tolerance: float


class KPoint(_Record):
    k: int
    tune_ppl: float  # best over (τ, λ) at this k on the fitting half,
    report_ppl: float  # and that setting on the judged half


class KCurve(_Record):
    """Perplexity against k: the served k is the smallest within `tolerance` of the best on the
    fitting half (a smaller k is a cheaper search, answer, merge and mix)."""

    tolerance: float
    ks: list[KPoint]


class NprobePoint(_Record):
    nprobe: int
    tune_ppl: float  # best over (k, τ, λ) searching this many IVF lists, on the fitting half,
    report_ppl: float  # and that setting on the judged half


class NprobeCurve(_Record):
    """Perplexity against IVF lists probed: the served nprobe is the smallest within `tolerance` of
    the build's nprobe on the fitting half (fewer lists, fewer codes scanned a query)."""

    tolerance: float
    nprobes: list[NprobePoint]


class PointerRule(_Record):
    """Pointer following: a decode step follows the last step's neighbours when at least
    `min_pointers` successors survive (0: off). Fitted, after the skip rule, to cost at most
    `tolerance` of perplexity on the fitting half."""

    min_pointers: int = Field(ge=0)
    saved: float  # share of the judged half's tokens that followed pointers instead of searching,
    ppl: float  # its perplexity,
    full_ppl: float  # and with every non-skipped token searched
    tolerance: float


class Calibration(_Record):
    """The mixing settings that fit this datastore best on held-out text (served by default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    lambda_: float = Field(alias="lambda", ge=0, le=1)
    temperature: float = Field(gt=0)
    k: int = Field(gt=0)
    adaptive_lambda: AdaptiveLambda
    mode: Literal["fixed", "adaptive"]  # which λ a request that sets none gets
    tokens: int  # held-out tokens fitted on (first half) and judged on (second half)
    base_ppl: float  # on the judged half: the LM alone,
    knn_ppl: float  # kNN-LM at the fitted fixed λ,
    adaptive_ppl: float  # and with the adaptive curve
    ceiling_tolerance: float = 0.0  # perplexity share the adaptive curve gave up for a higher λ at distance 0
    k_curve: KCurve | None = None  # None: calibrated before k was chosen for cost (the best k was served)
    skip: SkipRule | None = None  # None: calibrated before adaptive retrieval existed (never skips)
    pointers: PointerRule | None = None  # None: no document boundaries, or calibrated before pointers existed
    heldout: str  # what the held-out text was
    nprobe: int | None = Field(gt=0)  # IVF lists the fit searched, served by default (see served_nprobe)
    nprobe_curve: NprobeCurve | None = None  # None: not IVF, or calibrated before nprobe was chosen (the build's was served)
    created: str


class HeldOutDocument(_Record):
    """A document (or its last tokens) that the build held out to calibrate on. It is stored and
    served like every other; calibrating on the build's slice leaves its entries out of the search."""

    document: int  # its number at build time
    source: str
    sha256: str  # of its text: how a later calibration finds it again after compactions
    tokens: tuple[int, int]  # the held-out tokens [first, end) of the document


class ForgetRecord(_Record):
    """An audit line of `knnlm-index forget`: which document, when, and which copies were erased;
    never its text. Its entries [first, end) are masked from every search and lookup; their codes
    stay in the index files until `compact`, unless the forget erased them (`erased_codes`)."""

    document: int
    source: str
    line: int | None
    id: str | None
    sha256: str  # of the document's text, to show which text it was
    entries: tuple[int, int]
    at: str
    erased_codes: list[str] = []  # shards whose index files no longer hold its entries (`forget --erase`)
    erased_texts: list[str] = []  # the server's copies of its text that were erased ("source:line")


class AddRecord(_Record):
    """An audit line of `knnlm-index add`: documents [first_document, ...) and their entries, in new shards."""

    first_document: int
    documents: int
    entries: int
    shards: list[str]
    sources: list[str]
    seconds: float
    encode_seconds: float
    at: str


class CompactRecord(_Record):
    """An audit line of `knnlm-index compact`: the tombstones and added shards it folded in."""

    at: str
    removed_entries: int
    tombstone_share: float  # of the entries, before
    folded_additions: int
    forgotten: list[ForgetRecord]  # their audit records, kept (their entry ranges are of the layout before)
    seconds: float


class PassageIndexEntry(_Record):
    """The passage index (knnlm_core/passages.py): documents cut into spans for in-context retrieval."""

    file: FileEntry
    tokens: int  # a passage's length in tokens (a document's last one up to MIN_TAIL_TOKENS more)
    passages: int
    gate: float | None  # relevance a best passage needs to go into a prompt; None: not calibrated (no held-out text)
    relevance: Literal["phrase", "bm25_per_word"] = "bm25_per_word"  # the gate's measure; left out: fitted before phrase relevance
    gate_questions: int | None = None  # held-out documents' questions the gate was fitted on (phrase relevance),
    gate_offtopic_pass: float | None = None  # the share of them it lets through against this index, which lacks their documents,
    gate_answerable_pass: float | None = None  # and the share it lets through against their own documents
    gate_heldout_pass: float | None = None  # bm25_per_word: the share of chance queries (held-out words drawn at random) it lets through,
    gate_stored_pass: float | None = None  # and of phrases of stored passages


class Manifest(_Record):
    format: Literal["knnlm-datastore"] = FORMAT
    format_version: int = FORMAT_VERSION
    model: ModelIdentity
    key_type: KeyType
    dim: int
    key_dtype: Literal["float16"] = "float16"
    index: IndexSpec
    entries: int
    shards: list[ShardEntry]
    corpus: CorpusStats
    build: BuildStats
    calibration: Calibration | None = None
    calibration_note: str | None = None  # why there is no calibration
    calibration_history: list[Calibration] = []  # earlier calibrations, oldest first
    calibration_documents: list[HeldOutDocument] = []  # what the build held out to calibrate on (stored all the same)
    quantizer: FileEntry | None = None  # quantizer.faiss; None: built before it was kept (`add` empties a shard's copy)
    documents: FileEntry | None = None  # documents.npy; None: no document boundaries (no pointer following)
    provenance: FileEntry | None = None  # provenance.json; None: cannot explain its neighbours
    passages: PassageIndexEntry | None = None  # passages.sqlite; None: built before passages existed (no in-context retrieval)
    additions: list[AddRecord] = []  # `knnlm-index add` runs since the build (or the last compact), oldest first
    forgotten: list[ForgetRecord] = []  # documents forgotten since the build (or the last compact), oldest first
    compactions: list[CompactRecord] = []
    checksum: str | None = None  # sha256 of this manifest without this field (None: written before it existed)

    def files(self) -> list[FileEntry]:
        """Every data file the manifest lists, with its size and checksum."""
        extra = (self.quantizer, self.documents, self.provenance, self.passages.file if self.passages else None)
        return [f for s in self.shards for f in shard_files(s)] + [f for f in extra if f is not None]


def job_record(manifest: Manifest, job: Literal["add", "compact"]) -> dict:
    """The audit record of the `knnlm-index add` or `compact` that wrote this version, as that
    command prints it (a compact's tombstone records left out: they are the forgets' own)."""
    if job == "add":
        return manifest.additions[-1].model_dump(mode="json")
    return manifest.compactions[-1].model_dump(mode="json", exclude={"forgotten"})


def served_nprobe(manifest: Manifest) -> int | None:
    """IVF lists a search probes by default: the calibration's choice, else the build's."""
    calibration = manifest.calibration
    return calibration.nprobe if calibration is not None and calibration.nprobe else manifest.index.nprobe


def shard_files(shard: ShardEntry) -> list[FileEntry]:
    return [f for f in (shard.index, shard.values, shard.keys) if f is not None]
