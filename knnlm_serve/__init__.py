"""knnlm-serve: nearest-neighbour language models (kNN-LM) served through vLLM."""

__version__ = "0.1.0"
