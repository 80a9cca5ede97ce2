"""knnlm_serve: kNN-LM served through vLLM.

server/   the API-server process: launcher, datastore registry, admin routes
engine/   the vLLM seam, in vLLM's worker processes: model wrapper, batch tracking, mix
eval/     knnlm-eval: perplexity through the serving path
"""
