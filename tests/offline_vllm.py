"""Plain vLLM, without our plugin, for several models in one process: what `knn: false` must equal.

    python tests/plain_vllm.py SPEC.json OUT.json

SPEC: [{"model": DIR, "prompt": [ids], "ids": [ids], "max_tokens": n, "max_model_len": n, "kv_cache_gib": x}].
For each model, one in-process engine at a time (engine start dominates a test server's cost; one
process for all of them pays vLLM's import once): the greedy completion of `prompt` with its
logprobs, and the prompt logprobs of `ids`, as the OpenAI server returns them
(`completions` with `logprobs=1`, and with `echo=True, max_tokens=1`).
"""

from __future__ import annotations

import gc
import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    os.environ["VLLM_PLUGINS"] = ""  # no general plugin: vLLM exactly as installed
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    results = []
    for item in json.loads(open(spec_path).read()):
        llm = LLM(
            model=item["model"],
            dtype="float32",
            enforce_eager=True,
            max_model_len=item["max_model_len"],
            kv_cache_memory_bytes=int(item["kv_cache_gib"] * 2**30),
        )
        greedy = SamplingParams(temperature=0, max_tokens=item["max_tokens"], logprobs=1)
        (completion,) = llm.generate({"prompt_token_ids": item["prompt"]}, greedy, use_tqdm=False)
        scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        (prompt,) = llm.generate({"prompt_token_ids": item["ids"]}, scored, use_tqdm=False)
        out = completion.outputs[0]
        results.append(
            {
                "tokens": list(out.token_ids),
                "logprobs": [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)],
                "prompt_logprobs": [step[t].logprob for step, t in zip(prompt.prompt_logprobs[1:], item["ids"][1:])],
            }
        )
        del llm
        gc.collect()
    open(out_path, "w").write(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
