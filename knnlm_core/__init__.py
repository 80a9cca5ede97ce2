"""knnlm_core: what the index builder, the server, the evaluator and the benchmarks share.

The datastore format, search and merge, the corpus -> windows -> keys path, the mixture formula,
typed config, atomic writes and one error base. It imports neither `knnlm_serve` nor
`index_builder` (tests/test_layout.py checks).
"""

__version__ = "0.2.0"
