"""`knnlm-eval tasks`: does kNN help on the user's own task? Items (prompt, answer) are scored
through a running server's OpenAI API, with kNN off, with the served defaults, and with any set of
knobs, and each setting is paired with kNN off item by item.

Per item and setting: the answer's log-probability given the prompt (one echo request over
prompt + answer) and greedy exact match (a completion of the answer's length). With `chat`, the
prompt is the user's message and the answer the assistant's reply, asked through the chat route
as a chat client asks, so that the server applies its chat template and puts `knn_context`
passages where it puts them for every chat (retrieved for the user's message); the answer is
scored as the assistant's message continued (`continue_final_message`, prompt logprobs). A chat
model answers in prose, so there a match is a greedy reply (up to CHAT_REPLY_TOKENS more than the
answer) that names the answer as a whole word. Each setting's greedy text is kept in the report.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from knnlm_serve.eval.task_items import TaskItem, TokenizedItem, tokenize_item
from knnlm_serve.eval.text import EvalError

logger = logging.getLogger("knnlm_serve")

TIE = 1e-4  # nats: log-probabilities closer than this are a tie
CHAT_REPLY_TOKENS = 32  # a chat reply's greedy tokens beyond the answer's: room for the sentence around it


@dataclass(frozen=True)
class ItemScore:
    logprob: float  # of the answer's tokens given the prompt
    exact: bool  # greedy decoding gives the answer's tokens (chat: its reply names the answer)
    passages: list[dict]  # the `knn_context` passages in the prompt, as the server described them
    greedy: str  # what greedy decoding gave


def tokenize_items(tokenizer, items: list[TaskItem], chat: bool) -> tuple[list[TokenizedItem], list[TaskItem]]:
    """The items that tokenize cleanly, and those skipped (their prompt/answer boundary falls inside a token)."""
    kept, skipped = [], []
    for item in items:
        tokenized = _chat_item(tokenizer, item) if chat else tokenize_item(tokenizer, item)
        (kept.append(tokenized) if tokenized else skipped.append(item))
    return kept, skipped


def _chat_item(tokenizer, item: TaskItem) -> TokenizedItem | None:
    """The user's message and the reply in the chat template: the reply's tokens must end the
    template continued from it, as they stand alone."""
    messages = [{"role": "user", "content": item.prompt}, {"role": "assistant", "content": item.answer}]
    text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids  # the template carries its own special tokens
    answer_ids = tokenizer(item.answer, add_special_tokens=False).input_ids
    if not answer_ids or tokenizer.decode(answer_ids) != item.answer or ids[-len(answer_ids) :] != answer_ids:
        return None
    return TokenizedItem(item, list(ids[: -len(answer_ids)]), list(answer_ids))


def score(client, model: str, item: TokenizedItem, xargs: dict) -> ItemScore:
    """Greedy first: with `knn_context`, its response lists the context's token ids, which the echo
    request then scores the answer after (the passages are retrieved for the prompt, never the answer)."""
    greedy = client.completions.create(
        model=model,
        prompt=item.prompt_ids,
        max_tokens=len(item.answer_ids),
        temperature=0,
        extra_body={"vllm_xargs": xargs, "return_token_ids": True},
    )
    context = (greedy.model_extra or {}).get("knn_context") or {}
    prompt = (context.get("token_ids") or []) + item.prompt_ids
    echoed = client.completions.create(
        model=model,
        prompt=prompt + item.answer_ids,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"vllm_xargs": {k: v for k, v in xargs.items() if k != "knn_context"}},
    )
    scored = echoed.choices[0].logprobs.token_logprobs[len(prompt) : len(prompt) + len(item.answer_ids)]
    choice = greedy.choices[0]
    return ItemScore(float(sum(scored)), list(choice.token_ids) == item.answer_ids, context.get("passages", []), choice.text)


def score_chat(client, model: str, item: TokenizedItem, xargs: dict) -> ItemScore:
    """Through the chat route: the greedy reply to the user's message, then the answer as the
    assistant's message continued, scored by its prompt logprobs (the last tokens of the prompt)."""
    user = [{"role": "user", "content": item.item.prompt}]
    greedy = client.chat.completions.create(
        model=model,
        messages=user,
        max_tokens=len(item.answer_ids) + CHAT_REPLY_TOKENS,
        temperature=0,
        extra_body={"vllm_xargs": xargs, "return_token_ids": True},
    )
    continued = client.chat.completions.create(
        model=model,
        messages=[*user, {"role": "assistant", "content": item.item.answer}],
        max_tokens=1,
        temperature=0,
        extra_body={
            "vllm_xargs": xargs,
            "return_token_ids": True,
            "prompt_logprobs": 0,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    extra = continued.model_extra or {}
    ids, logprobs = extra["prompt_token_ids"], extra["prompt_logprobs"]
    n = len(item.answer_ids)
    if ids[-n:] != item.answer_ids:
        raise EvalError(f"item {item.item.id}: the server's chat template does not end with the answer's tokens: score it without --chat")
    scored = [step[str(token)]["logprob"] for step, token in zip(logprobs[-n:], ids[-n:])]
    context = (greedy.model_extra or {}).get("knn_context") or {}
    reply = greedy.choices[0].message.content or ""
    return ItemScore(float(sum(scored)), names(reply, item.item.answer), context.get("passages", []), reply)


def names(reply: str, answer: str) -> bool:
    """Whether `reply` holds `answer` (without its surrounding spaces) as a whole word or phrase."""
    wanted = answer.strip()
    return bool(wanted) and re.search(rf"(?<!\w){re.escape(wanted)}(?!\w)", reply) is not None


def compare(scores: dict[str, dict[str, ItemScore]], kinds: dict[str, str]) -> dict:
    """Per setting and kind (and `all`): items, exact-match rate, mean answer log-probability, and
    against kNN off, paired per item: log-probability wins / ties / losses, exact matches gained / lost."""
    off = scores["off"]
    out = {}
    for setting, by_item in scores.items():
        for kind in sorted(set(kinds.values())) + ["all"]:
            ids = [i for i in by_item if kind == "all" or kinds[i] == kind]
            if not ids:
                continue
            delta = [by_item[i].logprob - off[i].logprob for i in ids]
            out.setdefault(setting, {})[kind] = {
                "items": len(ids),
                "exact_match": sum(by_item[i].exact for i in ids) / len(ids),
                "mean_logprob": sum(by_item[i].logprob for i in ids) / len(ids),
                "vs_off": {
                    "wins": sum(d > TIE for d in delta),
                    "ties": sum(abs(d) <= TIE for d in delta),
                    "losses": sum(d < -TIE for d in delta),
                    "exact_gained": sum(by_item[i].exact and not off[i].exact for i in ids),
                    "exact_lost": sum(off[i].exact and not by_item[i].exact for i in ids),
                    "mean_logprob_gain": sum(delta) / len(ids),
                },
            }
    return out


def markdown(summary: dict, skipped: int) -> str:
    rows = [
        "| setting | kind | items | exact match | mean log p(answer) | vs kNN off: wins / ties / losses | exact gained / lost |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for setting, kinds in summary.items():
        for kind, s in kinds.items():
            v = s["vs_off"]
            rows.append(
                f"| {setting} | {kind} | {s['items']} | {s['exact_match']:.1%} | {s['mean_logprob']:.3f} | "
                f"{v['wins']} / {v['ties']} / {v['losses']} | {v['exact_gained']} / {v['exact_lost']} |"
            )
    rows.append(f"\n{skipped} item(s) skipped: their prompt/answer boundary does not tokenize cleanly.")
    return "\n".join(rows)


def run_tasks(
    items: list[TaskItem], client, model: str, tokenizer, settings: dict[str, dict], chat: bool = False, concurrency: int = 8
) -> dict:
    """Score every item under each setting (`off` is added: kNN off), `concurrency` requests at a
    time so that the server batches them; the report's JSON."""
    kept, skipped = tokenize_items(tokenizer, items, chat)
    settings = {"off": {"knn": False}, **settings}
    scores = {name: {} for name in settings}
    scorer = score_chat if chat else score
    with ThreadPoolExecutor(concurrency) as pool:
        futures = {
            pool.submit(scorer, client, model, item, xargs): (name, item.item.id) for item in kept for name, xargs in settings.items()
        }
        for done, future in enumerate(as_completed(futures), start=1):
            name, item_id = futures[future]
            scores[name][item_id] = future.result()
            if done % (25 * len(settings)) == 0 or done == len(futures):
                logger.info("scored %d of %d items", done // len(settings), len(kept))
    kinds = {t.item.id: t.item.kind for t in kept}
    return {
        "settings": settings,
        "chat": chat,
        "skipped": [{"id": i.id, "line": i.line} for i in skipped],
        "summary": compare(scores, kinds),
        "items": [{"id": t.item.id, "kind": t.item.kind, **{name: vars(scores[name][t.item.id]) for name in settings}} for t in kept],
    }


def plot(summary: dict, path) -> None:
    """Per kind, one bar per setting: exact match (chat: the reply names the answer), and the
    answer's log-probability gain over kNN off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(next(iter(summary.values())))
    fig, axes = plt.subplots(2, 1, figsize=(1.6 + 1.4 * len(kinds), 5.6), sharex=True)
    draw(axes, summary, kinds)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw(axes, summary: dict, kinds: list[str]) -> None:
    """`summary`'s bars on two axes: exact match above, mean log-probability gain over kNN off below."""
    width = 0.8 / len(summary)
    for n, (setting, by_kind) in enumerate(summary.items()):
        x = [k + n * width for k in range(len(kinds))]
        axes[0].bar(x, [by_kind[k]["exact_match"] for k in kinds], width, label=setting, color=f"C{n}")
        axes[1].bar(x, [by_kind[k]["vs_off"]["mean_logprob_gain"] for k in kinds], width, color=f"C{n}")
    axes[0].set_ylim(0, 1)  # a share: fixed, so that columns sharing the axis are not cut at the first one's top
    axes[1].axhline(0, color="grey", linewidth=0.8)
    axes[1].set_xticks([k + width * (len(summary) - 1) / 2 for k in range(len(kinds))], kinds, rotation=25, ha="right", fontsize=8)
    axes[0].set_ylabel("greedy exact match\n(chat: reply names it)")
    axes[1].set_ylabel("Δ log p(answer) vs off, nats")
