"""All of knnlm-serve's settings: one pydantic model per section, loaded from `configs/*.yaml`
(knnlm_core/config_file.py); the offline side's in `offline`, the server's in `serve`.

Every knob a user can turn lives here, with its default and its meaning; the CLIs only map
their flags onto these models. A process gets its settings by one route: the launcher passes
`ServeConfig` explicitly, and vLLM's worker processes get the serving runtime (built from
`KnnConfig`) through vLLM's own worker RPC (knnlm_serve.engine.worker_extension).
"""

from knnlm_core.config.base import DATASTORE_NAME, KeyType, datastore_name_problem
from knnlm_core.config.offline import BuildCluster, BuildConfig, EvalConfig, SweepGrid
from knnlm_core.config.serve import AdaptiveLambda, DatastoreOverride, KnnConfig, ServeConfig

__all__ = [
    "DATASTORE_NAME",
    "AdaptiveLambda",
    "BuildCluster",
    "BuildConfig",
    "DatastoreOverride",
    "EvalConfig",
    "KeyType",
    "KnnConfig",
    "ServeConfig",
    "SweepGrid",
    "datastore_name_problem",
]
