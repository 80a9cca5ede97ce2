"""How long should prompt lookup's drafts be? Decoding with drafts replayed over fixed outputs.

    .venv/bin/python benchmarks/draft_lengths.py --costs benchmarks/results/speculation_pydocs_c1.json
    # ~4 min on 2 CPU cores once the store exists (one server)

Drafts change only the speed: greedy decoding gives the same tokens with or without them (tested).
So each prompt's output is generated once, on a server without speculation, and decoding with
drafts is replayed over it: after each step, vLLM's n-gram search (its `ngram` drafter, n-grams
of 2 to 4 tokens, as our drafter runs it) proposes up to L tokens from the request's own text; the
next step accepts the draft's prefix that the output repeats, plus one token, and costs one row
per draft token more. Policies for L: fixed, 1 to 8; and grow-on-accept, where the next draft is
one token longer than the last one's accepted prefix, up to a cap. Drafts from the datastore are
not replayed (they need the server's neighbours).

The time is a cost model: a step costs what one token costs without drafts, and each draft row
a fixed share of a plain step more. Both are fitted from a `benchmarks/speculation.py` run on the
same machine (--costs: its tokens per second and counted drafts, at c1), and the report gives the
ratio over plain vLLM also where a draft row costs nothing (a GPU at one stream, roughly). Prompts,
modes and the store are speculation.py's (pydocs: `plain`, kNN off; `knn`, the calibrated
defaults). Writes benchmarks/results/draft_lengths.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import run_record  # noqa: E402
from speculation import prompt_sets, server_config  # noqa: E402
from task_eval import prepare_corpora  # noqa: E402

from knnlm_core.default_model import prepare_default_model  # noqa: E402
from knnlm_serve.server.process import RunningServer  # noqa: E402

MODES = {"plain": {"knn": False}, "knn": {}}  # mode -> vllm_xargs beyond the datastore's name
DRAFTED = {"plain": "plain+drafts", "knn": "knn+drafts"}  # the speculation mode each cost is fitted from
POLICIES = [*(f"fixed-{n}" for n in range(1, 9)), "grow-4", "grow-8"]
NGRAM = (2, 4)


def outputs(corpora: dict, sets: dict, tokens: int, work: Path) -> dict:
    """set -> mode -> [(prompt, greedy output token ids)], from one server without speculation."""
    (work / "draft-lengths").mkdir(parents=True, exist_ok=True)
    found = {}
    with RunningServer(server_config("base", corpora), work / "draft-lengths") as server:
        client = server.openai_client()
        for set_name, prompts in sets.items():
            for mode, xargs in MODES.items():
                runs = []
                for prompt in prompts:
                    out = client.completions.create(
                        model="smollm2",
                        prompt=prompt,
                        max_tokens=tokens,
                        temperature=0,
                        extra_body={"vllm_xargs": {**xargs, "knn_datastore": "pydocs"}, "ignore_eos": True, "return_token_ids": True},
                    )
                    runs.append((prompt, list(out.choices[0].token_ids)))
                found.setdefault(set_name, {})[mode] = runs
                print(f"{set_name} {mode}: {len(runs)} outputs", flush=True)
    return found


def replay(prompt: list[int], output: list[int], policy: str) -> tuple[int, int, int]:
    """(steps, draft rows, accepted draft tokens) to decode `output` after `prompt` with `policy`."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as lookup

    kind, cap = policy.split("-")
    cap = int(cap)
    context = np.array([*prompt, *output], dtype=np.int32)
    done, steps, rows, accepted, length = 1, 1, 0, 0, cap  # the prefill step samples the first token
    while done < len(output):
        draft = lookup(context[: len(prompt) + done], *NGRAM, 10**9, length).tolist()
        taken = 0
        while taken < len(draft) and done + taken < len(output) and draft[taken] == output[done + taken]:
            taken += 1
        if draft and kind == "grow":
            length = min(cap, taken + 1)
        rows, accepted, steps = rows + len(draft), accepted + taken, steps + 1
        done += taken + 1
    return steps, rows, accepted


def fitted_costs(costs: dict, set_name: str) -> dict:
    """mode -> a step's time and a draft row's time, in plain steps, from a speculation run at c1
    (its drafts mode's time less its steps, the tokens not drafted, at the mode's own step time,
    per draft token it proposed), and that run's measured ratio, which the fixed length it ran
    should replay."""
    run = costs["results"]["pydocs"][set_name]["c1"]
    per_s = {mode: figures["median"] for mode, figures in run["tokens_per_s"].items()}
    fitted = {}
    for mode, drafted_mode in DRAFTED.items():
        step = per_s["plain"] / per_s[mode]
        share, accepted = run["drafted_share"][drafted_mode], run["accepted_share_of_draft_tokens"][drafted_mode]
        drafted = sum(share[s] for s in share if share[s])
        draft_tokens = sum(share[s] / accepted[s] for s in share if share[s] and accepted[s])
        time = per_s["plain"] / per_s[drafted_mode]  # plain steps per generated token
        fitted[mode] = {
            "step_in_plain_steps": round(step, 3),
            "draft_row_in_plain_steps": round((time - (1 - drafted) * step) / draft_tokens, 3),
            f"measured_over_plain_fixed_{costs['settings']['draft_tokens']}": run["over_plain"][drafted_mode]["median"],
        }
    return fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", type=Path, required=True, help="a benchmarks/speculation.py result with pydocs at c1")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set (speculation.py's, seeded)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/knnlm-context-eval"), help="where corpus stores are built once")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/draft_lengths.json")
    args = parser.parse_args()
    record = run_record("draft_lengths")
    from transformers import AutoTokenizer

    costs = json.loads(args.costs.read_text())
    model_dir = prepare_default_model()
    corpora = prepare_corpora(["pydocs"], args.work, model_dir)
    sets = prompt_sets(corpora, AutoTokenizer.from_pretrained(model_dir), args.prompts)["pydocs"]
    found = outputs(corpora, sets, args.tokens, args.work)
    results = {}
    for set_name, by_mode in found.items():
        fitted = fitted_costs(costs, set_name)
        for mode, runs in by_mode.items():
            step, row = fitted[mode]["step_in_plain_steps"], fitted[mode]["draft_row_in_plain_steps"]
            generated = sum(len(output) for _, output in runs)
            for policy in POLICIES:
                steps, rows, accepted = np.sum([replay(p, o, policy) for p, o in runs], axis=0).tolist()
                results.setdefault(set_name, {}).setdefault(mode, {})[policy] = {
                    "tokens_per_step": round(generated / steps, 3),
                    "draft_rows_per_token": round(rows / generated, 3),
                    "accepted_share_of_draft_tokens": round(accepted / max(rows, 1), 3),
                    "over_plain": round(generated / (steps * step + rows * row), 3),
                    "over_plain_free_rows": round(generated / (steps * step), 3),
                }
            results[set_name][mode]["costs"] = fitted[mode]
            best = max(POLICIES, key=lambda p: results[set_name][mode][p]["over_plain"])
            print(f"{set_name} {mode}: best {best} {results[set_name][mode][best]['over_plain']}", flush=True)
    report = {
        **record,
        "settings": {"costs": str(args.costs), "tokens": args.tokens, "prompts": args.prompts, "ngram": NGRAM, "modes": MODES},
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
