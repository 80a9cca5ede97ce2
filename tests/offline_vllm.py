"""Several models through vLLM in one process, one in-process engine at a time: plain vLLM (what
`knn: false` must equal), or with the kNN plugin (`--knn`, the engine knnlm-eval opens).

    python tests/offline_vllm.py SPEC.json OUT.json [--knn]

SPEC: [{"model": DIR, "max_model_len": n, "kv_cache_gib": x, "k": n, "datastores": {name: DIR},
        "requests": [{"prompt": [ids], "max_tokens": n, "xargs": {...}}]}]
(`k` and `datastores` with --knn only; the first datastore is the default). Each request is greedy,
with the logprob of each generated token and of each prompt token after the first, as the OpenAI
server returns them (`logprobs=1`, and `echo=True`); `xargs` are its `vllm_xargs`. OUT: per model,
per request, {"tokens", "logprobs", "prompt_logprobs"}. Engine start dominates a test server's
cost: one process for every model pays vLLM's import once.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def open_llm(item: dict, knn: bool):
    if not knn:
        from vllm import LLM

        return LLM(
            model=item["model"],
            dtype="float32",
            enforce_eager=True,
            max_model_len=item["max_model_len"],
            kv_cache_memory_bytes=int(item["kv_cache_gib"] * 2**30),
        )
    from knnlm_core.datastore import read_manifest
    from knnlm_serve.eval.score import open_engine
    from knnlm_serve.runtime import DatastoreInfo

    infos = [DatastoreInfo.of(name, path, read_manifest(path)) for name, path in item["datastores"].items()]
    return open_engine(item["model"], infos, k=item["k"], max_model_len=item["max_model_len"], kv_cache_gib=item["kv_cache_gib"])


def answer(llm, request: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], logprobs=1, prompt_logprobs=1, extra_args=request["xargs"])
    (out,) = llm.generate({"prompt_token_ids": request["prompt"]}, params, use_tqdm=False)
    completion = out.outputs[0]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)],
        "prompt_logprobs": [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], request["prompt"][1:])],
    }


def main(spec_path: str, out_path: str, *mode: str) -> None:
    knn = mode == ("--knn",)
    if not knn:
        os.environ["VLLM_PLUGINS"] = ""  # no general plugin: vLLM exactly as installed
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    results = []
    for item in json.loads(open(spec_path).read()):
        llm = open_llm(item, knn)
        results.append([answer(llm, request) for request in item["requests"]])
        del llm
        gc.collect()
    open(out_path, "w").write(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
