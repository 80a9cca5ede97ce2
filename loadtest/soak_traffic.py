"""A soak's traffic: each client sends a fixed mix of requests as one of two tenants, and every
answer is checked, not only its status.

Each tenant's datastore holds the same opening sentence with its own secret continuation. So a
greedy completion at λ 1 must continue with the tenant's own secret (a stored answer), passages
and neighbours must come from its own datastore, and no response may hold the other's secret.
Bad requests of the batteries' kinds must get their refusal.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import openai
import requests

PREFIX = "The vault under the old lighthouse opens only when the keeper says the words"
SECRETS = {
    "alpha": " zebra quartz maple lantern orbit velvet cobalt thistle ember falcon nimbus quill.",
    "beta": " copper willow seven harbour drum silent orchid marble tiger frost anchor plume.",
}
QUESTION = "Which words does the keeper say to open the vault under the old lighthouse?"
KINDS = ("completion", "stream", "passages", "explain", "prompt_logprobs", "disconnect", "bad", "completion", "stream", "passages")
BAD = ("lambda", "other_store", "unknown_key", "max_tokens")


@dataclass
class Tenant:
    key_id: str
    datastore: str
    key: str
    other: str  # the other tenant's datastore: never in this tenant's answers


@dataclass
class Traffic:
    """What the clients share: the server, the tenants' current keys, every request's outcome."""

    base_url: str
    model: str
    shared_datastore: str | None  # the config's own datastore, granted to both tenants
    tenants: list[Tenant]
    records: list[dict] = field(default_factory=list)
    sending: dict[int, str] = field(default_factory=dict)  # client -> the key of the request it is sending
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.started


def secret_words(datastore: str, count: int = 3) -> str:
    return " ".join(SECRETS[datastore].split()[:count])


def leaks(text: str, tenant: Tenant) -> bool:
    other = SECRETS[tenant.other].split()
    return any(" ".join(other[i : i + 2]) in text for i in range(len(other) - 1)) or f"{tenant.other}-" in text


def send(traffic: Traffic, tenant: Tenant, kind: str, turn: int) -> tuple[bool, str | None, bool]:
    """(ok, what went wrong, whether its answer is a stored one that a fault may excuse)."""
    client = openai.OpenAI(base_url=f"{traffic.base_url}/v1", api_key=tenant.key, max_retries=0, timeout=300)
    own = {"knn_datastore": tenant.datastore, "knn_lambda": 1.0}
    if kind in ("completion", "stream"):
        kwargs = dict(model=traffic.model, prompt=PREFIX, max_tokens=8, temperature=0, extra_body={"vllm_xargs": own})
        if kind == "stream":
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        if leaks(text, tenant):
            return False, f"leak: {text!r}", False
        stored = text.strip().startswith(secret_words(tenant.datastore))
        return stored, None if stored else f"not the stored answer: {text!r}", True
    if kind == "passages":
        chat = client.chat.completions.create(
            model=traffic.model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=6,
            stream=False,
            extra_body={"vllm_xargs": {"knn_datastore": tenant.datastore, "knn_context": 1}},
        )
        used = (chat.model_extra or {}).get("knn_context") or {}
        shown = json.dumps(used) + (chat.choices[0].message.content or "")
        mine = used.get("datastore") in (None, tenant.datastore) and all(
            p["id"].startswith(tenant.datastore) for p in used.get("passages", [])
        )
        return mine and not leaks(shown, tenant), None if mine else f"passages of another store: {shown[:300]}", False
    if kind == "explain":
        response = requests.post(
            f"{traffic.base_url}/v1/knn/explain",
            json={"prompt": PREFIX, "max_tokens": 4, "vllm_xargs": {**own, "knn_explain": 4}},
            headers={"Authorization": f"Bearer {tenant.key}"},
            timeout=300,
        )
        if response.status_code != 200:
            return False, f"explain: HTTP {response.status_code} {response.text[:200]}", False
        docs = {n.get("id") for t in response.json()["tokens"] for n in t["neighbours"]} - {None}  # a forgotten one shows no id
        mine = all(d.startswith(tenant.datastore) for d in docs) and not leaks(response.text, tenant)
        return mine, None if mine else f"neighbours of another store: {sorted(docs)[:5]}", False
    if kind == "prompt_logprobs":
        choice = client.completions.create(
            model=traffic.model, prompt=PREFIX, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1, "vllm_xargs": own}
        ).choices[0]
        logprobs = (choice.model_extra or {}).get("prompt_logprobs")
        return bool(logprobs), None if logprobs else "no prompt_logprobs in the answer", False
    if kind == "disconnect":
        xargs = {"knn_datastore": traffic.shared_datastore} if traffic.shared_datastore else {}
        stream = client.completions.create(
            model=traffic.model, prompt=QUESTION, max_tokens=64, stream=True, extra_body={"vllm_xargs": xargs}
        )
        chunks = 0
        for _ in stream:
            chunks += 1
            if chunks == 2:
                break
        stream.close()  # the client goes away mid-stream; the server must free what the request held
        return chunks > 0, None if chunks else "the stream sent nothing", False
    return refused_as_expected(traffic, tenant, BAD[turn % len(BAD)])


def refused_as_expected(traffic: Traffic, tenant: Tenant, bad: str) -> tuple[bool, str | None, bool]:
    def post(xargs: dict | None = None, key: str | None = None, **body) -> requests.Response:
        payload = {"model": traffic.model, "prompt": PREFIX, "max_tokens": 2, "vllm_xargs": xargs or {}, **body}
        headers = {"Authorization": f"Bearer {key or tenant.key}"}
        return requests.post(f"{traffic.base_url}/v1/completions", json=payload, headers=headers, timeout=300)

    if bad == "lambda":
        response = post({"knn_lambda": 2.0})
        ok = response.status_code == 400 and "knn_lambda" in response.text
    elif bad == "other_store":
        hidden, unknown = post({"knn_datastore": tenant.other}), post({"knn_datastore": "no-such-store"})
        ok = (
            hidden.status_code == unknown.status_code
            and hidden.status_code in (400, 404)
            and (hidden.content.replace(tenant.other.encode(), b"NAME") == unknown.content.replace(b"no-such-store", b"NAME"))
        )
        response = hidden
    elif bad == "unknown_key":
        response = post(key="sk-knn-soak-not-a-key")
        ok = response.status_code == 401 and "sk-knn-soak-not-a-key" not in response.text
    else:
        response = post(max_tokens=-1)
        ok = response.status_code == 400 and "max_tokens" in response.text
    return ok, None if ok else f"{bad}: HTTP {response.status_code} {response.text[:200]}", False


def client_loop(traffic: Traffic, index: int, stop: threading.Event, every_s: float = 0.0) -> None:
    """One client: the mix in turn, each request recorded with its outcome; a request every
    `every_s` seconds at most (0: back to back)."""
    turn, due = index, traffic.now()
    while not stop.wait(max(0.0, due - traffic.now())):
        due += every_s
        kind = KINDS[turn % len(KINDS)]
        with traffic.lock:
            tenant = traffic.tenants[index % len(traffic.tenants)]
            traffic.sending[index] = tenant.key
        start = traffic.now()
        try:
            ok, error, excusable = send(traffic, tenant, kind, turn // len(KINDS))
        except Exception as e:  # noqa: BLE001 - every failure is the report's to show
            ok, error, excusable = False, repr(e)[:300], False
        end = traffic.now()
        record = {
            "kind": kind,
            "tenant": tenant.key_id,
            "start_s": round(start, 2),
            "end_s": round(end, 2),
            "seconds": round(end - start, 3),
            "ok": ok,
            "error": error,
            "excusable": excusable,
            "measured": kind not in ("disconnect", "bad"),
        }
        with traffic.lock:
            traffic.records.append(record)
            traffic.sending.pop(index, None)
        turn += 1
